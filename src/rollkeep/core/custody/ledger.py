"""The ledger: the one object that owns every prompt of every epoch.

Custody invariants (checked by `rollkeep.core.custody.audit.audit`; docs/design.md §1):

  I1. For every epoch, every ordinal below the source cursor has exactly one owner among
      SPARE, LEDGER, REPLAY, TRAINED and DROPPED.
  I2. No owner holds a key at or past the cursor (those belong to SOURCE).
  I3. Every group record is well formed: its per-sibling arrays have the group's size,
      current attempts are RESERVED, DISPATCHED or SEALED, and its state agrees with them
      (a RESERVED group has dispatched nothing; a GENERATING group has an unsealed
      sibling; a finished group has every sibling sealed; only READY and CLAIMED groups
      carry advantages; only the next step claims).
  I4. Stamped target steps and shortfalls are for steps not yet committed.
  I5. Committed steps are accounted for: the step records cover steps 1..version once
      each, in order; each step trained at least one group, and its groups plus its
      shortfall are at most the widest `num_prompts_per_step` ever configured; the TRAINED
      sets hold exactly as many keys as the step records say were trained.
  I6. Every persisted number is one an honest run can produce, bounded by what the
      ledger itself recorded: advantages are finite and at most MAX_ADVANTAGE in
      magnitude; a target step is at most start version + 1 + the widest window ever
      configured; a dropped key's step lies in [1, version + 1 + window] and its reason
      has at most MAX_REASON characters; a shortfall is at most `num_prompts_per_step`.
      (Bounds that need a configured limit are checked once a `configured` event has
      recorded one.)

Owners of a key (epoch, ordinal):

    SOURCE   at or past the cursor
    SPARE    in the spare pool
    LEDGER   a group record in state RESERVED, GENERATING, READY_TO_FINALIZE or FINALIZING
    REPLAY   a group record in state READY or CLAIMED(step)
    TRAINED  in the epoch's trained set (a roaring bitmap of ordinals)
    DROPPED  in the dropped map, with its reason and step

The only way to change any of it is `Ledger.apply(event)`. Each handler validates the
whole event first and raises `IllegalTransition` with nothing changed, then mutates, then
the event goes to the subscribers. Legality and the next state come from the two tables of
`rollkeep.core.custody.transitions`, `GROUP_TABLE` (group state × event → next group state) and
`ATTEMPT_TABLE` (current attempt status × event → next status); the few rules that do not
fit a table are in `_special_rules_*` functions.

Cheap checkpoints: `capture()` is O(1). It marks every container shared and returns
references; the first mutation after a capture copies what it touches (copy-on-write),
so a captured state is never changed afterwards and can be encoded on another thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgspec
from pyroaring import BitMap

from ..errors import IllegalTransition
from .events import (
    FAILURE_KINDS,
    FROM_SOURCE,
    FROM_SPARE,
    GRANULARITIES,
    INFRA,
    LOST_VERSION,
    Abandoned,
    Admitted,
    Claimed,
    Configured,
    Dispatched,
    Dropped,
    EffectDone,
    EffectIntent,
    Event,
    Evicted,
    Failed,
    Finalizing,
    Progressed,
    Ready,
    Reason,
    Released,
    Sealed,
    Spared,
    StepCommitted,
    Taken,
    TurnSealed,
)
from .keys import Key, exhausted, group_id, next_key
from .records import (  # re-exported: what the ledger holds is read through this module too
    COUNT_KEYS,
    MAX_ADVANTAGE,
    MAX_REASON,
    AttemptStatus,
    GroupRecord,
    GroupState,
    LedgerState,
    Owner,
    StepRun,
    _copy_record,
)
from .transitions import (  # re-exported: the tables are read through this module too
    ATTEMPT_NEXT,
    ATTEMPT_TABLE,
    GRANULARITY_CODE,
    GROUP_NEXT,
    GROUP_TABLE,
    PROMPT_GROUP_CODE,
)

__all__ = [
    "ATTEMPT_TABLE",
    "COUNT_KEYS",
    "GROUP_TABLE",
    "MAX_ADVANTAGE",
    "MAX_REASON",
    "PROMPT_GROUP_CODE",
    "AttemptStatus",
    "FreedRows",
    "GroupRecord",
    "GroupState",
    "Ledger",
    "LedgerState",
    "Owner",
    "StepRun",
]


# Hot-path aliases: enum attribute lookups cost more than module globals.
_RESERVED, _GENERATING, _READY_TO_FINALIZE, _FINALIZING, _READY, _CLAIMED = (int(s) for s in GroupState)
_A_RESERVED, _A_DISPATCHED, _A_SEALED = 0, 1, 2
# The two hot handlers (`_dispatched`, `_sealed`) inline these values as literals.
assert (_GENERATING, _READY_TO_FINALIZE, _A_RESERVED, _A_DISPATCHED, _A_SEALED) == (1, 2, 0, 1, 2)

_PROMPT_GROUP = PROMPT_GROUP_CODE
_MAX_COUNTER = 255  # failure counters are stored as bytes

def _one_reserved(status: bytearray, gens: tuple[int, ...]) -> bool:
    g = gens[0]
    return 0 <= g < len(status) and not status[g]  # status 0 = RESERVED


def _all_with(status: bytearray, gens: tuple[int, ...], value: int) -> bool:
    """`gens` name siblings of `status`, at least one, each once, and each is at `value`."""
    n = len(status)
    for g in gens:
        if g < 0 or g >= n or status[g] != value:
            return False
    return len(gens) == 1 or (len(gens) > 1 and len(set(gens)) == len(gens))


FreedRows = tuple[tuple[str, int, int], ...]  # (group_id, generation, attempt) of rows now garbage
_NO_ROWS: FreedRows = ()


class Ledger:
    """Custody of every prompt: SOURCE, SPARE, LEDGER, REPLAY, TRAINED and DROPPED.

    `n_rows`, `seed` and `epochs` describe the prompt source (the permutation itself lives
    in `PromptSource`); the ledger keeps the cursor. `epochs=None` means unbounded.
    """

    def __init__(self, *, n_rows: int, seed: int, epochs: int | None) -> None:
        if n_rows < 1:
            raise ValueError(f"n_rows must be >= 1, got {n_rows}")
        if epochs is not None and epochs < 0:
            raise ValueError(f"epochs must be None or >= 0, got {epochs}")
        self.n_rows = n_rows
        self.seed = seed
        self.epochs = epochs
        self._cursor = Key(0, 0)
        self._version = 0
        self._spare: tuple[Key, ...] = ()
        self._groups: dict[str, GroupRecord] = {}
        self._trained: dict[int, BitMap] = {}
        self._dropped: dict[Key, tuple[str, int]] = {}
        self._shortfall: dict[int, int] = {}
        self._steps: list[StepRun] = []
        self._max_prompts_per_step: int | None = None
        self._max_window: int | None = None
        self._max_version = 0  # see LedgerState.max_version
        # Copy-on-write bookkeeping (see module docstring).
        self._shared = False  # containers above are referenced by a captured state
        self._owned: set[str] = set()  # records created or copied since the last capture
        # Derived indices, rebuilt by `from_state`; never persisted.
        self._ready: dict[str, None] = {}
        self._by_step: dict[int, dict[str, None]] = {}
        self._claimed_ids: dict[str, None] = {}  # CLAIMED groups (all of the next step)
        self._reserved: dict[str, None] = {}  # groups in state RESERVED (awaiting admission)
        self._pending: dict[str, None] = {}  # GENERATING groups with a RESERVED sibling
        self._sinks: list[Any] = []
        self._handlers = {
            Configured: self._configured,
            Taken: self._taken,
            Spared: self._spared,
            Admitted: self._admitted,
            Dispatched: self._dispatched,
            Progressed: self._progressed,
            TurnSealed: self._turn_sealed,
            EffectIntent: self._effect,
            EffectDone: self._effect,
            Sealed: self._sealed,
            Failed: self._failed,
            Abandoned: self._abandoned,
            Finalizing: self._finalizing,
            Ready: self._ready_event,
            Claimed: self._claimed,
            StepCommitted: self._step_committed,
            Released: self._released,
            Evicted: self._evicted,
            Dropped: self._dropped_event,
        }

    # ------------------------------------------------------------------ apply

    def apply(self, event: Event) -> FreedRows:
        """Validate, mutate, emit. Returns the rows that are now garbage.

        An illegal event raises `IllegalTransition` and changes nothing.
        """
        try:
            handler = self._handlers[type(event)]
        except KeyError:
            raise IllegalTransition(
                f"{type(event).__name__} is not a ledger event",
                expected="one of the types in rollkeep.core.custody.events.ALL_EVENTS",
                found=repr(event),
            ) from None
        freed = handler(event)
        if freed is None:  # a duplicate that changes nothing (e.g. a repeated seal)
            return _NO_ROWS
        for sink in self._sinks:
            sink(event)
        return freed

    def subscribe(self, sink) -> None:
        """Call `sink(event)` after every applied event (the trace, the journal)."""
        self._sinks.append(sink)

    # ------------------------------------------------------------------ capture

    def capture(self) -> LedgerState:
        """The atomic cut of custody state. O(1): shares containers, copies on next write."""
        self._shared = True
        self._owned = set()
        return LedgerState(
            n_rows=self.n_rows,
            seed=self.seed,
            epochs=self.epochs,
            cursor=self._cursor,
            version=self._version,
            spare=self._spare,
            groups=self._groups,
            trained=self._trained,
            dropped=self._dropped,
            shortfall=self._shortfall,
            steps=self._steps,
            max_prompts_per_step=self._max_prompts_per_step,
            max_window=self._max_window,
            max_version=self._max_version,
        )

    @classmethod
    def from_state(cls, state: LedgerState) -> Ledger:
        """A live ledger continuing from `state` (which stays unchanged)."""
        ledger = cls(n_rows=state.n_rows, seed=state.seed, epochs=state.epochs)
        ledger._cursor = Key(*state.cursor)
        ledger._version = state.version
        ledger._spare = tuple(Key(*k) for k in state.spare)
        ledger._groups = dict(state.groups)
        ledger._trained = dict(state.trained)
        ledger._dropped = dict(state.dropped)
        ledger._shortfall = dict(state.shortfall)
        ledger._steps = list(state.steps)
        ledger._max_prompts_per_step = state.max_prompts_per_step
        ledger._max_window = state.max_window
        ledger._max_version = max(state.max_version, state.version)
        ledger._shared = True  # records and bitmaps are still the state's
        for gid in sorted(ledger._groups, key=lambda g: ledger._groups[g].key):
            ledger._index_add(gid, ledger._groups[gid])
        ledger._claimed_ids = {g: None for g, r in ledger._groups.items() if r.state == _CLAIMED}
        return ledger

    def _unshare(self) -> None:
        self._groups = dict(self._groups)
        self._trained = {e: BitMap(b) for e, b in self._trained.items()}
        self._dropped = dict(self._dropped)
        self._shortfall = dict(self._shortfall)
        self._steps = list(self._steps)
        self._shared = False

    def _writable(self, gid: str) -> GroupRecord:
        """The record of `gid`, safe to mutate in place (copied if a capture holds it)."""
        if gid in self._owned:
            return self._groups[gid]
        if self._shared:
            self._unshare()
        rec = _copy_record(self._groups[gid])
        self._groups[gid] = rec
        self._owned.add(gid)
        return rec

    def _containers(self) -> None:
        """Call before mutating any container directly."""
        if self._shared:
            self._unshare()

    # ------------------------------------------------------------------ reading

    @property
    def cursor(self) -> Key:
        return self._cursor

    @property
    def version(self) -> int:
        """Weight version = number of committed optimizer steps."""
        return self._version

    @property
    def spare(self) -> tuple[Key, ...]:
        return self._spare

    @property
    def exhausted(self) -> bool:
        """True when the source has no key left (the spare pool may still hold some)."""
        return exhausted(self._cursor, self.epochs)

    def group(self, gid: str) -> GroupRecord:
        """The record of a group in LEDGER or REPLAY (read-only). KeyError if none."""
        return self._groups[gid]

    def __contains__(self, gid: object) -> bool:
        return gid in self._groups

    def groups(self) -> Iterator[tuple[str, GroupRecord]]:
        return iter(list(self._groups.items()))

    def __len__(self) -> int:
        return len(self._groups)

    def ready_ids(self) -> list[str]:
        """READY groups (not claimed), in the order they became ready."""
        return list(self._ready)

    def n_ready(self) -> int:
        """READY groups: finished, waiting for a train step (not claimed)."""
        return len(self._ready)

    def reserved_ids(self) -> list[str]:
        """Groups waiting for admission (state RESERVED), by key."""
        return sorted(self._reserved, key=lambda g: self._groups[g].key)

    def pending_ids(self) -> list[str]:
        """Admitted, generating groups with a sibling to dispatch, by key."""
        return sorted(self._pending, key=lambda g: self._groups[g].key)

    def n_claimed(self) -> int:
        """Groups claimed by the open train step."""
        return len(self._claimed_ids)

    def n_inflight(self) -> int:
        """Groups owned by LEDGER: taken, not finalized yet."""
        return len(self._groups) - len(self._ready) - len(self._claimed_ids)

    def stamped(self, step: int) -> list[str]:
        """Live groups (LEDGER or REPLAY) whose target step is `step`."""
        return list(self._by_step.get(step, ()))

    def n_stamped(self, step: int) -> int:
        """len(stamped(step)) without the copy: admission asks it once per group."""
        return len(self._by_step.get(step, ()))

    def stamped_steps(self) -> list[int]:
        return sorted(self._by_step)

    def shortfall(self, step: int) -> int:
        """Groups of `step` dropped with `shrink`: the step trains on that many fewer."""
        return self._shortfall.get(step, 0)

    def claimed(self, step: int) -> list[str]:
        # Only the next step can hold a claim (invariant I3), so the index is that step's.
        return list(self._claimed_ids) if step == self._version + 1 else []

    def is_current(self, gid: str, generation: int, attempt: int) -> bool:
        """Whether a result for (gid, generation, attempt) may still be sealed or failed."""
        rec = self._groups.get(gid)
        return (
            rec is not None
            and 0 <= generation < len(rec.status)
            and rec.attempts[generation] == attempt
            and rec.status[generation] == _A_DISPATCHED
        )

    def owner(self, key: tuple[int, int]) -> Owner:
        """Who owns `key` now. O(1) except for SPARE (a short tuple)."""
        key = Key(*key)
        gid = group_id(key)
        rec = self._groups.get(gid)
        if rec is not None:
            return rec.owner
        if key in self._dropped:
            return Owner.DROPPED
        bm = self._trained.get(key.epoch)
        if bm is not None and key.ordinal in bm:
            return Owner.TRAINED
        if key in self._spare:
            return Owner.SPARE
        return Owner.SOURCE

    @property
    def max_prompts_per_step(self) -> int | None:
        """The widest `num_prompts_per_step` ever configured (None before any)."""
        return self._max_prompts_per_step

    @property
    def max_window(self) -> int | None:
        """The widest sampler window ever configured (None before any)."""
        return self._max_window

    def steps(self) -> list[StepRun]:
        """The records of committed steps 1..version, as runs of equal counts (I5)."""
        return list(self._steps)

    def trained_count(self) -> int:
        return sum(len(b) for b in self._trained.values())

    def trained_ordinals(self, epoch: int) -> BitMap:
        return BitMap(self._trained.get(epoch, BitMap()))

    def dropped(self) -> dict[Key, tuple[str, int]]:
        return dict(self._dropped)

    def counts(self) -> dict[str, int]:
        """How many keys (or groups) each owner holds, for progress bars and metrics; the
        keys are `COUNT_KEYS`, in that order."""
        by_state = [0] * len(GroupState)
        for rec in self._groups.values():
            by_state[rec.state] += 1
        return {
            "spare": len(self._spare),
            "reserved": by_state[_RESERVED],
            "generating": by_state[_GENERATING],
            "finalizing": by_state[_READY_TO_FINALIZE] + by_state[_FINALIZING],
            "ready": by_state[_READY],
            "claimed": by_state[_CLAIMED],
            "trained": self.trained_count(),
            "dropped": len(self._dropped),
        }

    def commit_event(self, step: int) -> StepCommitted:
        """The `StepCommitted` event for the groups claimed by `step`, in key order."""
        gids = sorted(self.claimed(step), key=lambda g: self._groups[g].key)
        prompts = tuple((self._groups[g].epoch, self._groups[g].idx) for g in gids)
        return StepCommitted(step=step, weight_version=step, group_ids=tuple(gids), prompts=prompts)

    def normalize_for_restart(self) -> list[Event]:
        """The events that turn a restored ledger into one ready to run (docs/design.md §5):

        - a claimed step or a running finalization is released (they had no effect
          outside the ledger);
        - current DISPATCHED attempts are ABANDONED(restart) and get fresh attempts;
        - a PROMPT_GROUP group that is not complete also abandons its sealed siblings.

        The caller applies them (tracing them and freeing the rows they return).
        """
        # Only the groups it changes are sorted (by key; keys are distinct, so the tuples never
        # compare further), and groups with the same statuses share their generations: at
        # 100 k groups in flight, most have one of a few patterns.
        todo = sorted((rec.epoch, rec.ordinal, gid, rec) for gid, rec in self._groups.items()
                      if rec.state in (_CLAIMED, _FINALIZING, _GENERATING))
        gens_of: dict[tuple[bytes, bool], tuple[int, ...]] = {}
        restart = Reason.RESTART.value
        events: list[Event] = []
        for _, _, gid, rec in todo:
            if rec.state != _GENERATING:
                events.append(Released(group_id=gid))
                continue
            pattern = (bytes(rec.status), rec.granularity == _PROMPT_GROUP)
            gens = gens_of.get(pattern)
            if gens is None:
                gens = gens_of[pattern] = tuple(g for g, s in enumerate(rec.status)
                                                if (s != _A_RESERVED if pattern[1] else s == _A_DISPATCHED))
            if gens:
                events.append(Abandoned(group_id=gid, generations=gens, reason=restart))
        return events

    # ------------------------------------------------------------------ helpers

    def _illegal(self, event: Event, what: str, *, expected: str, found: str) -> IllegalTransition:
        return IllegalTransition(
            f"illegal {event.__struct_config__.tag} event: {what}",  # type: ignore[attr-defined]
            expected=expected,
            found=found,
            remedy="this is a bug in the caller of Ledger.apply or in rollkeep; the ledger is unchanged",
        )

    def _require_group(self, event: Event, gid: str, edge: str) -> GroupRecord:
        rec = self._groups.get(gid)
        if rec is None:
            raise self._illegal(
                event,
                f"group {gid} is not in LEDGER or REPLAY",
                expected="a group taken and not yet trained or dropped",
                found=f"owner {self.owner_of_gid(gid)}",
            )
        if (rec.state, edge) not in GROUP_NEXT:
            raise self._illegal(
                event,
                f"group {gid} is {GroupState(rec.state).name}",
                expected=f"a state in which '{edge}' is legal: "
                + ", ".join(s.name for (s, e) in GROUP_TABLE if e == edge),
                found=GroupState(rec.state).name,
            )
        return rec

    def owner_of_gid(self, gid: str) -> str:
        from .keys import parse_group_id

        try:
            return self.owner(parse_group_id(gid)).value
        except ValueError:
            return "none (not a group id)"

    def _require_attempts(
        self, event: Event, rec: GroupRecord, gid: str, gens: Iterable[int], edge: str
    ) -> None:
        seen = set()
        size = len(rec.status)
        for g in gens:
            if not (0 <= g < size) or g in seen:
                raise self._illegal(
                    event,
                    f"generation index {g} of group {gid}",
                    expected=f"distinct indices in [0, {size})",
                    found=str(list(gens)),
                )
            seen.add(g)
            if (rec.status[g], edge) not in ATTEMPT_NEXT:
                raise self._illegal(
                    event,
                    f"sibling {g} of group {gid} (attempt {rec.attempts[g]}) is "
                    f"{AttemptStatus(rec.status[g]).name}",
                    expected="a status in which '" + edge + "' is legal: "
                    + ", ".join(s.name for (s, e) in ATTEMPT_TABLE if e == edge),
                    found=AttemptStatus(rec.status[g]).name,
                )

    def _require_current(self, event: Event, rec: GroupRecord, g: int, attempt: int) -> None:
        if not (0 <= g < len(rec.status)):
            raise self._illegal(
                event,
                f"group {rec.group_id} has no generation {g}",
                expected=f"an index in [0, {len(rec.status)})",
                found=str(g),
            )
        if rec.attempts[g] != attempt:
            raise self._illegal(
                event,
                f"attempt {attempt} of sibling {g} of group {rec.group_id} is not current",
                expected=f"the current attempt {rec.attempts[g]}",
                found=f"attempt {attempt}",
            )

    def _index_add(self, gid: str, rec: GroupRecord) -> None:
        if rec.target_step is not None:
            self._by_step.setdefault(rec.target_step, {})[gid] = None
        if rec.state == _READY:
            self._ready[gid] = None
        elif rec.state == _RESERVED:
            self._reserved[gid] = None
        elif rec.state == _GENERATING and _A_RESERVED in rec.status:
            self._pending[gid] = None

    def _index_remove(self, gid: str, rec: GroupRecord) -> None:
        if rec.target_step is not None:
            bucket = self._by_step.get(rec.target_step)
            if bucket is not None:
                bucket.pop(gid, None)
                if not bucket:
                    del self._by_step[rec.target_step]
        self._ready.pop(gid, None)
        self._claimed_ids.pop(gid, None)
        self._reserved.pop(gid, None)
        self._pending.pop(gid, None)

    def _stamp_horizon(self, start_version: int) -> int | None:
        """The last step a group admitted at `start_version` may be stamped for (I6)."""
        return None if self._max_window is None else start_version + 1 + self._max_window

    def _sealed_rows(self, gid: str, rec: GroupRecord) -> FreedRows:
        return tuple((gid, g, rec.attempts[g]) for g, s in enumerate(rec.status) if s == _A_SEALED)

    def _check_take(self, event: Event, t: Taken) -> None:
        key = Key(t.epoch, t.ordinal)
        if t.origin == FROM_SOURCE:
            if self.exhausted:
                raise self._illegal(
                    event, "the source is exhausted", expected="a key before the end", found=str(key)
                )
            if key != self._cursor:
                raise self._illegal(
                    event,
                    "keys leave the source in cursor order",
                    expected=f"the cursor {tuple(self._cursor)}",
                    found=str(tuple(key)),
                )
        elif t.origin == FROM_SPARE:
            if key not in self._spare:
                raise self._illegal(
                    event, "key is not in the spare pool", expected=str(self._spare), found=str(key)
                )
        else:
            raise self._illegal(event, "unknown origin", expected="source or spare", found=t.origin)
        if not (0 <= t.idx < self.n_rows):
            raise self._illegal(event, "idx out of range", expected=f"[0, {self.n_rows})", found=str(t.idx))
        if not (1 <= t.group_size <= 4096):
            raise self._illegal(event, "group size", expected="1..4096", found=str(t.group_size))
        if t.granularity not in GRANULARITY_CODE:
            raise self._illegal(event, "granularity", expected=str(GRANULARITIES), found=t.granularity)

    def _do_take(self, t: Taken, state: int, target_step: int | None, start_version: int | None) -> str:
        key = Key(t.epoch, t.ordinal)
        self._containers()
        if t.origin == FROM_SOURCE:
            self._advance_cursor()
        else:
            spare = list(self._spare)
            spare.remove(key)
            self._spare = tuple(spare)
        n = t.group_size
        gid = group_id(key)
        rec = GroupRecord(
            t.epoch,
            t.ordinal,
            t.idx,
            t.task,
            t.row_fingerprint,
            GRANULARITY_CODE[t.granularity],
            state,
            target_step,
            start_version,
            None,
            bytearray(n),
            [0] * n,
            bytearray(n),
            bytearray(n),
            None,
        )
        self._groups[gid] = rec
        self._owned.add(gid)
        self._index_add(gid, rec)
        return gid

    def _advance_cursor(self) -> None:
        self._cursor = next_key(self._cursor, self.n_rows)

    # ------------------------------------------------------------------ handlers
    # Each handler: validate everything, then mutate. Return freed rows, or None for a no-op.

    def _configured(self, ev: Configured) -> FreedRows:
        if ev.num_prompts_per_step < 1 or ev.window < 0:
            raise self._illegal(
                ev,
                "limits",
                expected="num_prompts_per_step >= 1 and window >= 0",
                found=f"num_prompts_per_step {ev.num_prompts_per_step}, window {ev.window}",
            )
        if ev.epochs != self.epochs and not (
            ev.epochs is None or (self.epochs is not None and ev.epochs > self.epochs)
        ):
            raise self._illegal(
                ev,
                "the number of epochs can only grow",
                expected=f"None (unbounded) or more than {self.epochs}",
                found=str(ev.epochs),
            )
        self.epochs = ev.epochs
        self._max_prompts_per_step = max(self._max_prompts_per_step or 0, ev.num_prompts_per_step)
        self._max_window = max(self._max_window or 0, ev.window)
        return _NO_ROWS

    def _taken(self, ev: Taken) -> FreedRows:
        self._check_take(ev, ev)
        self._do_take(ev, _RESERVED, None, None)
        return _NO_ROWS

    def _spared(self, ev: Spared) -> FreedRows:
        key = Key(ev.epoch, ev.ordinal)
        if self.exhausted or key != self._cursor:
            raise self._illegal(
                ev,
                "only the key at the cursor can be spared",
                expected=f"the cursor {tuple(self._cursor)}" + (" (exhausted)" if self.exhausted else ""),
                found=str(tuple(key)),
            )
        self._advance_cursor()
        self._spare = self._spare + (key,)
        return _NO_ROWS

    def _admitted(self, ev: Admitted) -> FreedRows:
        rec = self._require_group(ev, ev.group_id, "admitted")
        if ev.target_step is not None and ev.target_step <= self._version:
            raise self._illegal(
                ev,
                f"target step {ev.target_step} is already committed",
                expected=f"a step > {self._version}",
                found=str(ev.target_step),
            )
        if not (0 <= ev.version <= self._version):
            raise self._illegal(
                ev, "weight version", expected=f"0..{self._version}", found=str(ev.version)
            )
        horizon = self._stamp_horizon(ev.version)
        if ev.target_step is not None and horizon is not None and ev.target_step > horizon:
            raise self._illegal(
                ev,
                f"target step {ev.target_step} is beyond the window",
                expected=f"a step <= {horizon} (version {ev.version} + 1 + window {self._max_window})",
                found=str(ev.target_step),
            )
        rec = self._writable(ev.group_id)
        rec.state = _GENERATING
        rec.target_step = ev.target_step
        rec.start_version = ev.version
        self._reserved.pop(ev.group_id, None)
        self._index_add(ev.group_id, rec)
        return _NO_ROWS

    def _dispatched(self, ev: Dispatched) -> FreedRows:
        gid, gens = ev.group_id, ev.generations
        rec = self._groups.get(gid)
        # Fast path: a generating group whose named siblings are all RESERVED, once each
        # (one sibling inline: the commonest event after `sealed`).
        if rec is None or rec.state != 1 or not (
            _one_reserved(rec.status, gens) if len(gens) == 1 else _all_with(rec.status, gens, 0)
        ):
            rec = self._require_group(ev, gid, "dispatched")
            if not gens:
                raise self._illegal(ev, "no generations", expected="at least one index", found="()")
            self._require_attempts(ev, rec, gid, gens, "dispatched")
        if gid not in self._owned:
            rec = self._writable(gid)
        status = rec.status
        for g in gens:
            status[g] = 1  # _A_DISPATCHED
        if 0 not in status:  # no sibling left RESERVED
            del self._pending[gid]
        return ()

    def _progressed(self, ev: Progressed) -> FreedRows:
        """Only checks: the attempt is current and DISPATCHED, and the count is sane."""
        rec = self._require_group(ev, ev.group_id, "progressed")
        self._require_current(ev, rec, ev.generation, ev.attempt)
        self._require_attempts(ev, rec, ev.group_id, (ev.generation,), "progressed")
        if not 0 <= ev.resumed_from < ev.tokens:
            raise self._illegal(ev, "token count", expected="0 <= resumed_from < tokens",
                                found=f"resumed_from {ev.resumed_from}, tokens {ev.tokens}")
        return _NO_ROWS

    def _turn_sealed(self, ev: TurnSealed) -> FreedRows:
        """Only checks, as for `progressed`: the attempt is current and DISPATCHED, the turn
        and the count are sane."""
        rec = self._require_group(ev, ev.group_id, "turn_sealed")
        self._require_current(ev, rec, ev.generation, ev.attempt)
        self._require_attempts(ev, rec, ev.group_id, (ev.generation,), "turn_sealed")
        if not (0 <= ev.turn and 0 <= ev.resumed_from <= ev.tokens):
            raise self._illegal(ev, "turn or token count", expected="turn >= 0, 0 <= resumed_from <= tokens",
                                found=f"turn {ev.turn}, resumed_from {ev.resumed_from}, tokens {ev.tokens}")
        return _NO_ROWS

    def _effect(self, ev: EffectIntent | EffectDone) -> FreedRows:
        """Only checks, as for `progressed`: the attempt is current and DISPATCHED (the
        effect store, `rollout.effects`, checks what the records say)."""
        edge = ev.__struct_config__.tag  # type: ignore[attr-defined]
        rec = self._require_group(ev, ev.group_id, edge)
        self._require_current(ev, rec, ev.generation, ev.attempt)
        self._require_attempts(ev, rec, ev.group_id, (ev.generation,), edge)
        return _NO_ROWS

    def _sealed(self, ev: Sealed) -> FreedRows | None:
        gid, g = ev.group_id, ev.generation
        rec = self._groups.get(gid)
        # Fast path: the current, dispatched attempt of a generating group.
        if (
            rec is None
            or rec.state != 1  # _GENERATING
            or g < 0
            or g >= len(rec.status)
            or rec.status[g] != 1  # _A_DISPATCHED
            or rec.attempts[g] != ev.attempt
        ):
            if rec is not None and self._special_rules_duplicate_seal(rec, ev):
                return None
            rec = self._require_group(ev, gid, "sealed")
            self._require_current(ev, rec, g, ev.attempt)
            self._require_attempts(ev, rec, gid, (g,), "sealed")
        if gid not in self._owned:
            rec = self._writable(gid)
        status = rec.status
        status[g] = 2  # _A_SEALED
        if status.count(2) == len(status):
            rec.state = 2  # _READY_TO_FINALIZE
        return ()

    def _failed(self, ev: Failed) -> FreedRows:
        gid, g = ev.group_id, ev.generation
        rec = self._require_group(ev, gid, "failed")
        if ev.kind not in FAILURE_KINDS:
            raise self._illegal(ev, "failure kind", expected=str(FAILURE_KINDS), found=ev.kind)
        self._require_current(ev, rec, g, ev.attempt)
        self._require_attempts(ev, rec, gid, (g,), "failed")
        counters = rec.infra_failures if ev.kind == INFRA else rec.data_failures
        if counters[g] >= _MAX_COUNTER:
            raise self._illegal(ev, "failure counter overflow", expected=f"< {_MAX_COUNTER}", found=str(counters[g]))
        rec = self._writable(gid)
        counters = rec.infra_failures if ev.kind == INFRA else rec.data_failures
        counters[g] += 1
        rec.attempts[g] += 1
        rec.status[g] = _A_RESERVED
        self._pending[gid] = None
        if rec.granularity != _PROMPT_GROUP:
            return _NO_ROWS
        # All-or-nothing: the other siblings' work is abandoned with it.
        freed = []
        for other, s in enumerate(rec.status):
            if s == _A_SEALED:
                freed.append((gid, other, rec.attempts[other]))
            if s != _A_RESERVED:
                rec.attempts[other] += 1
                rec.status[other] = _A_RESERVED
        return tuple(freed)

    def _special_rules_abandon(self, ev: Abandoned, rec: GroupRecord) -> None:
        """SEALED → ABANDONED only for PROMPT_GROUP groups: a SIBLING group never throws
        away a finished sibling (that is the point of sibling granularity) -- except work
        generated under a lost version (reason LOST_VERSION, at a restart with
        `recovery.lost_versions: regenerate`), which alone may also take a complete group
        (READY_TO_FINALIZE, READY) back to GENERATING."""
        if ev.reason == LOST_VERSION:
            return
        if rec.state != _GENERATING:
            raise self._illegal(
                ev, f"group {ev.group_id} is {GroupState(rec.state).name}",
                expected=f"a GENERATING group (a complete one only for reason {LOST_VERSION!r})",
                found=f"{GroupState(rec.state).name}, reason {ev.reason!r}")
        if rec.granularity == _PROMPT_GROUP:
            return
        for g in ev.generations:
            if rec.status[g] == _A_SEALED:
                raise self._illegal(
                    ev,
                    f"sibling {g} of SIBLING-granularity group {ev.group_id} is sealed",
                    expected="only DISPATCHED siblings (sealed work is kept at sibling granularity)",
                    found="SEALED",
                )

    def _special_rules_duplicate_seal(self, rec: GroupRecord, ev: Sealed) -> bool:
        """A repeated seal of a sealed current attempt is a no-op, in any state: engines
        may deliver a result twice. (The row store compares the payloads.)"""
        g = ev.generation
        return (
            0 <= g < len(rec.status)
            and rec.attempts[g] == ev.attempt
            and rec.status[g] == _A_SEALED
        )

    def _abandoned(self, ev: Abandoned) -> FreedRows:
        gid = ev.group_id
        rec = self._groups.get(gid)
        # Fast path (a restart abandons 100 k groups' attempts in flight): DISPATCHED
        # siblings of a generating group, each once, which every rule below allows.
        if rec is None or rec.state != _GENERATING or not _all_with(rec.status, ev.generations, _A_DISPATCHED):
            rec = self._require_group(ev, gid, "abandoned")
            if not ev.generations:
                raise self._illegal(ev, "no generations", expected="at least one index", found="()")
            self._require_attempts(ev, rec, gid, ev.generations, "abandoned")
            self._special_rules_abandon(ev, rec)
        rec = self._writable(gid)
        if rec.state != _GENERATING:  # a complete group's lost work (LOST_VERSION): generating again
            self._ready.pop(gid, None)
            rec.state = _GENERATING
            rec.advantages = None
        freed = []
        for g in ev.generations:
            if rec.status[g] == _A_SEALED:
                freed.append((gid, g, rec.attempts[g]))
            rec.attempts[g] += 1
            rec.status[g] = _A_RESERVED
        self._pending[gid] = None
        return tuple(freed)

    def _finalizing(self, ev: Finalizing) -> FreedRows:
        self._require_group(ev, ev.group_id, "finalizing")
        self._writable(ev.group_id).state = _FINALIZING
        return _NO_ROWS

    def _ready_event(self, ev: Ready) -> FreedRows:
        rec = self._require_group(ev, ev.group_id, "ready")
        if len(ev.advantages) != len(rec.status):
            raise self._illegal(
                ev,
                f"advantages of group {ev.group_id}",
                expected=f"{len(rec.status)} values (one per sibling)",
                found=f"{len(ev.advantages)} values",
            )
        bad = [a for a in ev.advantages if not abs(a) <= MAX_ADVANTAGE]  # catches NaN too
        if bad:
            raise self._illegal(
                ev,
                f"advantages of group {ev.group_id}",
                expected=f"finite values of magnitude <= {MAX_ADVANTAGE:g}",
                found=str(bad[:3]),
            )
        rec = self._writable(ev.group_id)
        rec.state = _READY
        rec.advantages = [float(a) for a in ev.advantages]
        self._ready[ev.group_id] = None
        return _NO_ROWS

    def _claimed(self, ev: Claimed) -> FreedRows:
        if ev.step != self._version + 1:
            raise self._illegal(
                ev,
                "only the next step can claim",
                expected=f"step {self._version + 1}",
                found=f"step {ev.step}",
            )
        if not ev.group_ids or len(set(ev.group_ids)) != len(ev.group_ids):
            raise self._illegal(ev, "group ids", expected="distinct, at least one", found=str(ev.group_ids))
        for gid in ev.group_ids:
            rec = self._require_group(ev, gid, "claimed")
            if rec.target_step is not None and rec.target_step != ev.step:
                raise self._illegal(
                    ev,
                    f"group {gid} is stamped for step {rec.target_step}",
                    expected=f"groups stamped {ev.step} or unstamped",
                    found=f"target_step {rec.target_step}",
                )
        if self.claimed(ev.step):
            raise self._illegal(
                ev, f"step {ev.step} already claimed groups", expected="one claim per step", found=str(self.claimed(ev.step))
            )
        limit = self._max_prompts_per_step
        if limit is not None and len(ev.group_ids) + self.shortfall(ev.step) > limit:
            raise self._illegal(
                ev,
                f"step {ev.step} claims too many groups",
                expected=f"at most {limit} (num_prompts_per_step) minus its shortfall {self.shortfall(ev.step)}",
                found=f"{len(ev.group_ids)} groups",
            )
        for gid in ev.group_ids:
            rec = self._writable(gid)
            rec.state = _CLAIMED
            rec.claim_step = ev.step
            self._ready.pop(gid, None)
            self._claimed_ids[gid] = None
        return _NO_ROWS

    def _step_committed(self, ev: StepCommitted) -> FreedRows:
        for gid in ev.group_ids:
            self._require_group(ev, gid, "step_committed")
        expected = msgspec.structs.replace(self.commit_event(self._version + 1), tokens=ev.tokens)
        if not expected.group_ids or ev != expected:
            raise self._illegal(
                ev,
                f"step {ev.step} does not match the open claim",
                expected=f"exactly Ledger.commit_event({self._version + 1}) = {expected}",
                found=str(ev),
            )
        self._containers()
        freed = []
        for gid in ev.group_ids:
            rec = self._groups.pop(gid)
            self._owned.discard(gid)
            self._index_remove(gid, rec)
            freed.extend(self._sealed_rows(gid, rec))
            bm = self._trained.get(rec.epoch)
            if bm is None:
                bm = self._trained[rec.epoch] = BitMap()
            bm.add(rec.ordinal)
        self._version = ev.step
        self._max_version = max(self._max_version, ev.step)
        self._record_step(ev.step, len(ev.group_ids), self._shortfall.pop(ev.step, 0))
        return tuple(freed)

    def _record_step(self, step: int, groups: int, shortfall: int) -> None:
        last = self._steps[-1] if self._steps else None
        if last is not None and last.last == step - 1 and (last.groups, last.shortfall) == (groups, shortfall):
            self._steps[-1] = StepRun(last.first, step, groups, shortfall)
        else:
            self._steps.append(StepRun(step, step, groups, shortfall))

    def _released(self, ev: Released) -> FreedRows:
        rec = self._require_group(ev, ev.group_id, "released")
        nxt = GROUP_NEXT[(rec.state, "released")]
        rec = self._writable(ev.group_id)
        rec.state = nxt
        if nxt == _READY:
            rec.claim_step = None
            self._ready[ev.group_id] = None
            del self._claimed_ids[ev.group_id]
        return _NO_ROWS

    def _evicted(self, ev: Evicted) -> FreedRows:
        gid = ev.group_id
        self._require_group(ev, gid, "evicted")
        rec = self._writable(gid)
        freed = self._sealed_rows(gid, rec)
        self._index_remove(gid, rec)
        rec.state = _RESERVED
        rec.target_step = None
        rec.start_version = None
        rec.advantages = None
        for g in range(len(rec.status)):
            rec.attempts[g] += 1
            rec.status[g] = _A_RESERVED
        self._reserved[gid] = None
        return freed

    def _dropped_event(self, ev: Dropped) -> FreedRows:
        gid = ev.group_id
        rec = self._require_group(ev, gid, "dropped")
        stamped = rec.target_step is not None
        if stamped and ev.shrink == (ev.replacement is not None):
            raise self._illegal(
                ev,
                f"group {gid} is stamped for step {rec.target_step}",
                expected="exactly one of shrink=True or a replacement",
                found=f"shrink={ev.shrink}, replacement={ev.replacement is not None}",
            )
        if not stamped and (ev.shrink or ev.replacement is not None):
            raise self._illegal(
                ev,
                f"group {gid} is unstamped",
                expected="no shrink and no replacement (the pump keeps taking)",
                found=f"shrink={ev.shrink}, replacement={ev.replacement is not None}",
            )
        step = rec.target_step if stamped else self._version + 1
        if len(ev.reason) > MAX_REASON:
            raise self._illegal(
                ev, "drop reason too long", expected=f"at most {MAX_REASON} characters", found=f"{len(ev.reason)}"
            )
        if tuple(ev.prompt) != (rec.epoch, rec.idx) or ev.step != step:
            raise self._illegal(
                ev,
                f"prompt or step of group {gid}",
                expected=f"prompt {[rec.epoch, rec.idx]}, step {step}",
                found=f"prompt {list(ev.prompt)}, step {ev.step}",
            )
        if ev.replacement is not None:
            self._check_take(ev, ev.replacement)
            if group_id((ev.replacement.epoch, ev.replacement.ordinal)) == gid:
                raise self._illegal(ev, "a group cannot replace itself", expected="another key", found=gid)
        self._containers()
        freed = self._sealed_rows(gid, rec)
        del self._groups[gid]
        self._owned.discard(gid)
        self._index_remove(gid, rec)
        self._dropped[rec.key] = (ev.reason, step)
        if ev.shrink:
            self._shortfall[step] = self._shortfall.get(step, 0) + 1
        if ev.replacement is not None:
            # The replacement takes over the dropped group's step. Admitted now, at `version`,
            # unless that step lies past this version's window (a journal replay took back the
            # steps the group was admitted under): then at the oldest version whose window
            # reaches it, so its stamp stays within I6's bound.
            start = self._version if self._max_window is None else max(self._version, step - 1 - self._max_window)
            self._do_take(ev.replacement, _GENERATING, step, start)
        return freed

"""Effect records: the calls a sibling's attempts made to the outside, and what each
returned (docs/design.md §13).

A call made through `rollkeep.effects.call` is announced by an `effect_intent` event
(durable before the call is made) and ended by an `effect_done` event (its result or its
error). The store keeps, per sibling, the record of each call by its place in the episode
(`turn`, the reward stage being turn -1, and `index`, the call's order within the turn),
and follows the ledger's events with one rule table, the same in the live run and in a
replay, so a restore rebuilds exactly the records the killed process had made durable:

    effect_intent              a record at (turn, index) with no outcome yet (one there
                               before is superseded: the attempt asked for something else)
    effect_done                the record named by `key` gets its outcome (once)
    sealed                     kept, frozen: the audit checks that a finalized sibling's
                               records all have outcomes
    failed, kind infra         kept: the next attempt continues the same work
    failed, kind data          gone: the next attempt makes new calls with new keys
    abandoned restart|shutdown kept: the attempt was cut off, not wrong
    abandoned (other), evicted, dropped, step_committed
                               gone (every record of the group for the last three)

These are the prefix store's rules (`rollout.prefixes`): records live exactly as long as
the work they were made for. A kept record answers a later attempt's call at the same
place, of the same kind, with the same request (its digest): with its outcome, never
calling again; without one (the process died during the call), by the policy the intent
declared (`decide`).

Threading: the loop thread only, except `capture` (at the cut), whose result the writer
encodes: a sibling's records are a tuple `apply` replaces, never mutates.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import msgspec

from ..custody.events import (
    DATA,
    Abandoned,
    Dropped,
    EffectDone,
    EffectIntent,
    Event,
    Evicted,
    Failed,
    Reason,
    StepCommitted,
)

__all__ = ["EFFECT_UNKNOWN", "EFFECTS_FILE", "EFFECTS_SCHEMA", "MAX_KEY", "MAX_KIND", "MAX_RESULT_BYTES", "POLICIES", "REWARD_TURN",
           "RETRY", "FAIL", "Answer", "Call", "EffectRecord", "EffectStore", "Unknown", "decode_effects",
           "effect_key", "encode_effects"]

RETRY = "retry"  # an intent without an outcome: the same key is sent again
FAIL = "fail"  # an intent without an outcome: the attempt fails as data (effect_unknown)
POLICIES = (RETRY, FAIL)
REWARD_TURN = -1  # the `turn` of the calls a reward function makes
EFFECT_UNKNOWN = "effect_unknown"
MAX_KIND, MAX_KEY = 64, 256
MAX_RESULT_BYTES = 16 << 20  # the most any record may hold (`effects.max_result_bytes` is at most this)
EFFECTS_FILE = "effects.msgpack"
EFFECTS_SCHEMA = 1
_KEPT_ON_ABANDON = frozenset({Reason.RESTART.value, Reason.SHUTDOWN.value})

Sibling = tuple[str, int]


class EffectRecord(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    attempt: int  # the attempt that made the call
    turn: int
    index: int
    kind: str
    key: str  # the idempotency key the call was made with (kept: a retry sends it again)
    digest: int  # xxh3-64 of the request's canonical JSON
    policy: str
    ok: bool | None = None  # None: no outcome recorded (the call may or may not have happened)
    result: bytes = b""  # the result's JSON, or the error's text


def effect_key(run: str, gid: str, gen: int, attempt: int, turn: int, index: int) -> str:
    """The idempotency key of a new call: deterministic in the run (`run`: what tells this
    run's calls from another's), the sibling, its attempt, the turn (`r` for the reward
    stage) and the call's index: `rk-<run>-<group>-<sibling>-<attempt>-<turn>-<index>`."""
    return f"rk-{run}-{gid}-{gen}-{attempt}-{'r' if turn == REWARD_TURN else turn}-{index}"


# ====================================================================== decisions


@dataclass(frozen=True)
class Answer:
    """Answered from the record: the call is not made."""

    ok: bool
    result: bytes
    key: str


@dataclass(frozen=True)
class Call:
    """Make the call with `key`; `again`: under `retry`, an intent with no outcome is sent
    again with its recorded key (no new intent is recorded)."""

    key: str
    again: bool = False


@dataclass(frozen=True)
class Unknown:
    """A call of policy `fail` whose outcome is unknown: the attempt fails (effect_unknown)."""

    key: str
    kind: str


Decision = Answer | Call | Unknown


class EffectStore:
    def __init__(self) -> None:
        self._records: dict[Sibling, tuple[EffectRecord, ...]] = {}

    # -- the rule table

    def apply(self, ev: Event) -> None:
        """Follow one applied ledger event. Raises ValueError for an `effect_done` that ends
        no intent of the sibling (a forged or damaged journal: the caller refuses it)."""
        if not self._records and type(ev) is not EffectIntent:  # the common case: nothing to follow
            return
        if isinstance(ev, EffectIntent):
            sib = (ev.group_id, ev.generation)
            kept = tuple(r for r in self._records.get(sib, ()) if (r.turn, r.index) != (ev.turn, ev.index))
            self._records[sib] = (*kept, EffectRecord(ev.attempt, ev.turn, ev.index, ev.kind, ev.key, ev.digest,
                                                      ev.policy))
        elif isinstance(ev, EffectDone):
            sib = (ev.group_id, ev.generation)
            records = self._records.get(sib, ())
            at = next((i for i, r in enumerate(records) if r.key == ev.key), None)
            if at is None or records[at].ok is not None:
                raise ValueError(f"effect_done for {ev.key!r} of sibling {sib[0]}/{sib[1]} ends no recorded intent"
                                 if at is None else f"effect_done for {ev.key!r} is its second outcome")
            done = msgspec.structs.replace(records[at], ok=ev.ok, result=ev.result)
            self._records[sib] = (*records[:at], done, *records[at + 1:])
        elif isinstance(ev, Failed):
            if ev.kind == DATA:
                self._records.pop((ev.group_id, ev.generation), None)
        elif isinstance(ev, Abandoned):
            if ev.reason not in _KEPT_ON_ABANDON:
                for g in ev.generations:
                    self._records.pop((ev.group_id, g), None)
        elif isinstance(ev, Evicted | Dropped):
            self._forget_groups({ev.group_id})
        elif isinstance(ev, StepCommitted):
            self._forget_groups(set(ev.group_ids))

    def _forget_groups(self, gids: set[str]) -> None:
        for sib in [s for s in self._records if s[0] in gids]:
            del self._records[sib]

    # -- decisions

    def decide(self, gid: str, gen: int, *, turn: int, index: int, kind: str, digest: int, new_key: str) -> Decision:
        """What a call at (turn, index) of sibling gid/gen does, given its records: answered
        from a record of the same kind and request; sent again with the recorded key (an
        intent of policy `retry` without outcome); the attempt fails (`fail`, without
        outcome, whatever was asked: what the lost call did is unknown); else a new call
        with `new_key`."""
        rec = self.record(gid, gen, turn, index)
        if rec is not None:
            if rec.ok is None and rec.policy == FAIL:
                return Unknown(rec.key, rec.kind)
            if rec.kind == kind and rec.digest == digest:
                return Answer(rec.ok, rec.result, rec.key) if rec.ok is not None else Call(rec.key, again=True)
        return Call(new_key)

    def record(self, gid: str, gen: int, turn: int, index: int) -> EffectRecord | None:
        return next((r for r in self._records.get((gid, gen), ()) if (r.turn, r.index) == (turn, index)), None)

    def unknown(self, gid: str, gen: int, *, policy: str | None = None) -> list[EffectRecord]:
        """The sibling's records without an outcome (of `policy`, if given)."""
        return [r for r in self._records.get((gid, gen), ()) if r.ok is None and policy in (None, r.policy)]

    # -- checkpoints

    def capture(self) -> dict[Sibling, tuple[EffectRecord, ...]]:
        return dict(self._records)

    def restore(self, records: Mapping[Sibling, tuple[EffectRecord, ...]]) -> None:
        self._records = dict(records)

    def __len__(self) -> int:
        return sum(map(len, self._records.values()))

    def __bool__(self) -> bool:  # O(1): asked once per sealed sibling (a sibling's tuple is never empty)
        return bool(self._records)

    def __iter__(self) -> Iterator[tuple[Sibling, tuple[EffectRecord, ...]]]:
        return iter(self._records.items())

    def counts(self) -> dict[str, int]:
        """`effects_replayed` (records with an outcome, which answer instead of a call) and
        `effects_unknown` (intents without one): the `restored` event's fields."""
        done = sum(r.ok is not None for rs in self._records.values() for r in rs)
        return {"effects_replayed": done, "effects_unknown": len(self) - done}


# ====================================================================== the checkpoint file


class _Sibling(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    group_id: str
    generation: int
    records: list[EffectRecord]


class _File(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    schema: int
    siblings: list[_Sibling]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_File)


def encode_effects(records: Mapping[Sibling, tuple[EffectRecord, ...]]) -> bytes:
    sibs = [_Sibling(gid, g, list(rs)) for (gid, g), rs in sorted(records.items()) if rs]
    return _encoder.encode(_File(EFFECTS_SCHEMA, sibs))


def check_record(rec: EffectRecord) -> str | None:
    """What is wrong with a record no honest run writes, or None."""
    if not (0 <= rec.attempt and -1 <= rec.turn and 0 <= rec.index):
        return f"attempt {rec.attempt}, turn {rec.turn}, index {rec.index} (expected >= 0, >= -1, >= 0)"
    if not (0 < len(rec.kind) <= MAX_KIND and 0 < len(rec.key) <= MAX_KEY):
        return f"a kind of {len(rec.kind)} and a key of {len(rec.key)} characters (at most {MAX_KIND}, {MAX_KEY})"
    if rec.policy not in POLICIES:
        return f"policy {rec.policy!r} (expected one of {', '.join(POLICIES)})"
    if not 0 <= rec.digest < 1 << 64:
        return f"digest {rec.digest} (expected a 64-bit hash)"
    if len(rec.result) > MAX_RESULT_BYTES or (rec.ok is None and rec.result):
        return f"a result of {len(rec.result)} bytes" + (" without an outcome" if rec.ok is None else "")
    return None


def decode_effects(data: bytes) -> dict[Sibling, tuple[EffectRecord, ...]]:
    """The records of an `effects.msgpack`. ValueError (the caller names the file) for
    bytes that are not one, a schema this version does not read, a record no honest run
    writes, a sibling listed twice or two records at one place."""
    try:
        f = _decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ValueError(f"not an effects file: {e}") from None
    if f.schema != EFFECTS_SCHEMA:
        raise ValueError(f"schema {f.schema} (this version reads {EFFECTS_SCHEMA})")
    out: dict[Sibling, tuple[EffectRecord, ...]] = {}
    for s in f.siblings:
        sib = (s.group_id, s.generation)
        if sib in out or not s.records or s.generation < 0:
            raise ValueError(f"sibling {s.group_id}/{s.generation} listed twice, empty or of a negative index")
        places, keys = set(), set()
        for r in s.records:
            problem = check_record(r)
            if problem is None and ((r.turn, r.index) in places or r.key in keys):
                problem = f"a second record at turn {r.turn}, index {r.index} or with key {r.key!r}"
            if problem is not None:
                raise ValueError(f"sibling {s.group_id}/{s.generation}: a record with {problem}")
            places.add((r.turn, r.index))
            keys.add(r.key)
        out[sib] = tuple(s.records)
    return out

"""Restore = a checkpoint + the journal's tail after it (docs/design.md §5.1).

`replay(base, rows, tail)` applies the events a killed process made durable after its
checkpoint, each through the same `Ledger.apply` that validated it the first time, so a
tail that does not continue this checkpoint's ledger is refused event by event. It then
**takes back the steps committed after the checkpoint**: their trainer state died with
the process (the checkpoint's trainer is at the checkpoint's step), so those steps are
trained again, from the same groups and rows, not generated again:

    version         back to the checkpoint's step; `max_version` keeps the newest reached
    their groups    back in REPLAY as READY, with their advantages, stamps and rows
    TRAINED         their keys leave it; the step records end at the checkpoint's step
    shortfalls      a taken-back step is short again by what it was short when committed
    a claim         (of the step in progress at the kill) is released: READY again

Everything else the tail did stays done: takes, admissions, dispatches, seals (their rows
come with the tail), failures, drops and their reasons. Rows a taken-back step freed are
kept for its groups; rows the tail freed otherwise are gone from the result.

A tail can span several processes: each one that restored this checkpoint (and replayed
what it found) wrote a `Restart` marker before its own events, at the step it took back
to. `replay` takes back there too, so the events after the marker apply to the ledger that
process had, and once more at the end.

Pure: no IO. The caller reads the tail (`rollkeep.core.journal.durable.read_tail`) and hands
`replay` the events with each seal's row.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from pyroaring import BitMap

from ..checkpoint.cut import referenced_set
from ..custody.events import Event, Progressed, Sealed, StepCommitted, TurnSealed
from ..custody.ledger import GroupRecord, GroupState, Ledger, LedgerState, StepRun
from ..custody.records import _copy_record
from ..errors import IllegalTransition
from ..rollout.effects import EffectRecord, EffectStore
from ..rollout.prefixes import Link, PrefixStore
from ..rollout.rows import RowId

__all__ = ["LostWork", "Replayed", "Restart", "replay", "take_back"]


class Restart(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    """A process started here with its ledger at `step` (steps after it taken back)."""

    step: int


@dataclass(frozen=True)
class LostWork:
    """What a tail holds that was generated under a lost version: a weight version newer
    than the checkpoint's step, whose weights died with the process (its steps are taken
    back). `rows`: sealed rows the state still references whose newest token is of such a
    version (`Sealed.version`); `chains`: the partial generations with a chunk recorded in
    the tail (a chunk's versions are not in its event: any may be lost). What a restart does
    with them is `recovery.lost_versions` (`Scheduler.start`)."""

    rows: frozenset[RowId] = frozenset()
    chains: frozenset[tuple[str, int]] = frozenset()


@dataclass(frozen=True)
class Replayed:
    state: LedgerState  # the ledger as of the tail's last event, its later steps taken back
    rows: dict[RowId, Any]  # every row the state references: a Row, or its RowLocation
    prefixes: dict[tuple[str, int], tuple[Link, ...]]  # the partial generations as of the tail's end
    events: int  # tail events applied
    steps_taken_back: list[int]  # [first, last] committed after the checkpoint, or []
    groups_returned: int  # their groups, READY again: trained again, not regenerated
    lost: LostWork = field(default_factory=LostWork)  # generated under lost versions
    effects: dict[tuple[str, int], tuple[EffectRecord, ...]] = field(default_factory=dict)  # as of the tail's end


def replay(base: LedgerState, rows: Mapping[RowId, Any],
           tail: Iterable[tuple[Event | Restart, Any]],
           prefixes: Mapping[tuple[str, int], tuple[Link, ...]] | None = None,
           effects: Mapping[tuple[str, int], tuple[EffectRecord, ...]] | None = None) -> Replayed:
    """`tail`: the events after the checkpoint whose state is `base`, in order, each
    `Sealed` with its row (None for every other event), and the `Restart` markers of the
    processes that wrote them. A row is a `Row` or where it is (a `RowLocation`): replay
    only keeps and drops them, so it reads none. Raises `IllegalTransition` naming the first event that does
    not continue the ledger."""
    ledger = Ledger.from_state(base)
    live = dict(rows)
    chains = PrefixStore()  # follows the events as the live run's did (a progressed comes with its chunk's place)
    chains.restore(prefixes or {})
    records = EffectStore()  # the effect records, by the same rule
    records.restore(effects or {})
    returned: dict[str, GroupRecord] = {}  # groups of the steps to take back, as claimed
    lost_rows: set[RowId] = set()
    touched: set[tuple[str, int]] = set()
    n = 0
    for ev, row in tail:
        if isinstance(ev, Restart):
            if not base.version <= ev.step <= ledger.version:
                raise IllegalTransition(
                    f"a restart marker after journal event {n} takes back to step {ev.step}",
                    expected=f"a step in [{base.version}, {ledger.version}]", found=str(ev.step),
                    remedy="the journal is damaged; resume from the checkpoint alone with journal.enabled=false")
            ledger = Ledger.from_state(take_back(ledger.capture(), ev.step, returned))
            returned = {gid: rec for gid, rec in returned.items() if rec.claim_step <= ev.step}
            continue
        if isinstance(ev, Sealed):
            if row is None:
                raise ValueError(f"tail event {n + 1}: a seal without its row ({ev.group_id} sibling {ev.generation})")
            live[RowId(ev.group_id, ev.generation, ev.attempt)] = row
            if ev.version > base.version:
                lost_rows.add(RowId(ev.group_id, ev.generation, ev.attempt))
        elif isinstance(ev, Progressed | TurnSealed):
            touched.add((ev.group_id, ev.generation))
        elif isinstance(ev, StepCommitted):
            returned.update((gid, _copy_record(ledger.group(gid))) for gid in ev.group_ids if gid in ledger)
        try:
            freed = ledger.apply(ev)
        except IllegalTransition as e:
            raise IllegalTransition(
                f"journal event {n + 1} after the checkpoint does not continue its ledger: {e.what}",
                expected=e.expected, found=e.found,
                remedy="the journal belongs to another lineage or is damaged; resume from the checkpoint "
                "alone with journal.enabled=false, or start over in a new run_dir",
            ) from None
        n += 1
        chains.apply(ev, at=row)
        try:
            records.apply(ev)
        except ValueError as e:
            raise IllegalTransition(
                f"journal event {n} after the checkpoint does not continue its effect records: {e}",
                expected="an effect_done after its effect_intent, once", found=type(ev).__name__,
                remedy="the journal was damaged or forged; resume from the checkpoint alone with "
                "journal.enabled=false, or start over in a new run_dir") from None
        for gid, gen, att in freed:
            if gid not in returned:  # a taken-back step's groups keep their rows
                live.pop(RowId(gid, gen, att), None)
    killed = ledger.capture()
    state = take_back(killed, base.version, returned)
    steps = [base.version + 1, killed.version] if killed.version > base.version else []
    referenced = referenced_set(state)
    final_chains = chains.capture()
    lost = LostWork(frozenset(lost_rows & referenced), frozenset(touched & final_chains.keys()))
    return Replayed(state, {rid: r for rid, r in live.items() if rid in referenced}, final_chains, n, steps,
                    len(returned), lost, records.capture())


def take_back(state: LedgerState, step: int, committed: Mapping[str, GroupRecord]) -> LedgerState:
    """`state` with the steps after `step` taken back (see the module docstring).
    `committed`: each group those steps trained, as it was when claimed."""
    if state.version < step:
        raise ValueError(f"cannot take back to step {step}: the ledger is at step {state.version}")
    groups = dict(state.groups)
    for gid, rec in list(groups.items()):  # the claim of the step in progress is released
        if rec.state == GroupState.CLAIMED:
            groups[gid] = _as_ready(rec)
    trained = {e: BitMap(b) for e, b in state.trained.items()}
    for gid, rec in committed.items():
        if rec.claim_step is None or rec.claim_step <= step:
            continue  # trained before the checkpoint: not in the tail's commits
        groups[gid] = _as_ready(rec)
        trained[rec.epoch].discard(rec.ordinal)
    kept, shortfall = [], dict(state.shortfall)
    for run in state.steps:
        if run.last <= step:
            kept.append(run)
            continue
        if run.first <= step:
            kept.append(StepRun(run.first, step, run.groups, run.shortfall))
        if run.shortfall:
            for s in range(max(run.first, step + 1), run.last + 1):
                shortfall[s] = shortfall.get(s, 0) + run.shortfall
    return msgspec.structs.replace(
        state, version=step, groups=groups, trained={e: b for e, b in trained.items() if b},
        shortfall=shortfall, steps=tuple(kept), max_version=max(state.max_version, state.version))


def _as_ready(rec: GroupRecord) -> GroupRecord:
    out = _copy_record(rec)
    out.state = int(GroupState.READY)
    out.claim_step = None
    return out

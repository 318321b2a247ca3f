"""Restart normalisation (docs/design.md §5) and the `cursor_only` emulation.

A restored ledger is made ready to run: claims and running finalizations are released,
attempts in flight at the cut are abandoned (reason `restart`) and get fresh attempts,
all-or-nothing groups drop their sealed siblings. Under `recovery.mode: cursor_only` --
what a system without a ledger does, for comparison only -- every group still in flight
at the cut is lost: it is recorded as DROPPED (reason `lost ...`) so the trace and
`rollkeep chaos` show the loss instead of hiding it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..checkpoint.cut import gc_paused
from ..custody.events import LOST_VERSION, Abandoned, Event
from ..custody.ledger import PROMPT_GROUP_CODE, AttemptStatus, GroupState, Ledger
from ..journal.replay import LostWork
from ..restore.chain import RestorePlan
from ..rollout.prefixes import PrefixStore


def normalize(ledger: Ledger, apply: Callable[[Event], object]) -> None:
    with gc_paused():  # an event per group in flight at the cut (see `gc_paused`)
        for ev in ledger.normalize_for_restart():
            apply(ev)


def lost_versions(ledger: Ledger, lost: LostWork, mode: str, apply: Callable[[Event], object],
                  prefixes: PrefixStore) -> dict[str, Any]:
    """What a restart does with the work a journal tail generated under lost versions
    (`recovery.lost_versions`, docs/design.md §5.1), after `normalize`: `keep` leaves it
    (the re-done steps train the same groups from the same rows); `regenerate` abandons
    every sealed sibling whose row has a lost version (reason LOST_VERSION; a complete
    group goes back to GENERATING; an all-or-nothing group abandons all its siblings) and
    forgets the partial generations the tail recorded. Returns the `restored` fields."""
    current = {}
    for rid in lost.rows:
        if rid.group_id in ledger:
            rec = ledger.group(rid.group_id)
            if rec.attempts[rid.generation] == rid.attempt and rec.status[rid.generation] == AttemptStatus.SEALED:
                current.setdefault(rid.group_id, set()).add(rid.generation)
    chains = lost.chains & prefixes.capture().keys()
    fields = {"lost_versions": mode, "lost_version_rows": sum(map(len, current.values())),
              "lost_version_chains": len(chains)}
    if mode != "regenerate":
        return fields
    for gid in sorted(current, key=lambda g: ledger.group(g).key):
        rec = ledger.group(gid)
        gens = current[gid] if rec.granularity != PROMPT_GROUP_CODE else {
            g for g, st in enumerate(rec.status) if st != AttemptStatus.RESERVED}
        apply(Abandoned(group_id=gid, generations=tuple(sorted(gens)), reason=LOST_VERSION))
    if chains:
        prefixes.drop(sorted(chains))
    return fields


def lost_in_flight(ledger: Ledger) -> list[str]:
    """cursor_only: the groups a ledger-less system would have lost at the cut, by key."""
    lost = [g for g, r in ledger.groups() if r.state < GroupState.READY]
    return sorted(lost, key=lambda g: ledger.group(g).key)


def restored_fields(plan: RestorePlan, *, lost: int, mode: str) -> dict[str, Any]:
    """The counts of the `restored` trace event (docs/design.md §8). The siblings the run
    dispatches for the restored groups are `siblings_regenerated` (sent out before: in
    flight at the cut, sealed in an all-or-nothing group, or `siblings_resent`, waiting
    after an abandoned, failed or evicted attempt) plus `siblings_pending` (never sent)."""
    if mode == "cursor_only":  # nothing of the lost groups is reused or regenerated
        plan = dataclasses.replace(plan, groups_finalize_again=0, siblings_reused=0, siblings_discarded=0,
                                   siblings_regenerated=0, siblings_resent=0, siblings_pending=0,
                                   groups_readmitted=0)
    return {
        "groups_reused": plan.groups_reused,
        "groups_finalize_again": plan.groups_finalize_again,
        "siblings_reused": plan.siblings_reused,
        "siblings_regenerated": plan.siblings_regenerated + plan.siblings_discarded + plan.siblings_resent,
        "siblings_resent": plan.siblings_resent,
        "siblings_pending": plan.siblings_pending,
        "groups_readmitted": plan.groups_readmitted,
        "spare_prompts": plan.spare_prompts,
        "groups_lost": lost,
        "recovery_mode": mode,
    }

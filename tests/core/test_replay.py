"""Restore = checkpoint + journal tail (`rollkeep.core.journal.replay`): the tail's events are
applied as they were, and the steps committed after the checkpoint are taken back (their
trainer state is gone), so their groups are trained again, never regenerated or lost.

The central property: taking the steps back and then committing them again exactly as the
killed process did (its claims and commits, in order) gives back, byte for byte, the
ledger that process had. So a resumed run that trains the same groups (deterministic
mode) continues exactly where the killed one was."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ledger_driver import Driver

from rollkeep.core.custody import codec
from rollkeep.core.custody.audit import audit
from rollkeep.core.custody.events import DATA, INFRA, Claimed, Sealed, StepCommitted
from rollkeep.core.custody.ledger import AttemptStatus, GroupState, Ledger
from rollkeep.core.errors import IllegalTransition
from rollkeep.core.journal.replay import replay
from rollkeep.core.rollout.rows import Row, RowId

SAMPLERS = ["in_order", "weight_fifo", "windowed"]


def row(n: int = 3) -> Row:
    return Row(prompt_ids=np.arange(2, dtype=np.int32), completion_ids=np.arange(n, dtype=np.int32),
               logprobs=np.zeros(n, np.float32), versions=np.zeros(n, np.int32), reward=1.0, finish_reason="stop")


def sealed_rows(state) -> dict[RowId, Row]:
    return {RowId(gid, g, rec.attempts[g]): row() for gid, rec in state.groups.items()
            for g, s in enumerate(rec.status) if s == AttemptStatus.SEALED}


def with_rows(events):
    return [(ev, row() if isinstance(ev, Sealed) else None) for ev in events]


def act(d: Driver, choice: int, pick: int) -> None:
    """One random move of the rollout or train pump (settling nothing half way: a step
    claims and commits together, as the train pump does between two cuts)."""
    gens = [g for g, r in d.ledger.groups() if r.state == GroupState.GENERATING]
    if choice == 0 or not gens:
        d.take_and_admit()
    elif choice == 1:
        d.complete(gens[pick % len(gens)])
    elif choice == 2:
        gid = gens[pick % len(gens)]
        rec = d.ledger.group(gid)
        if rec.generations_with(AttemptStatus.RESERVED):
            d.dispatch(gid)
        elif rec.generations_with(AttemptStatus.DISPATCHED):
            d.seal(gid, rec.generations_with(AttemptStatus.DISPATCHED)[0])
    elif choice == 3:
        gid = gens[pick % len(gens)]
        dispatched = d.ledger.group(gid).generations_with(AttemptStatus.DISPATCHED)
        if dispatched and d.ledger.group(gid).infra_failures[dispatched[0]] < 2:
            d.fail(gid, dispatched[0], INFRA if pick % 2 else DATA)
    elif choice == 4:
        d.drop(gens[pick % len(gens)], "test", on_dropped_prompt="shrink" if pick % 2 else "replace")
    else:
        d.train_step()


moves = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 1000)), min_size=0, max_size=120)


@settings(max_examples=60, deadline=None)
@given(sampler=st.sampled_from(SAMPLERS), before=moves, after=moves)
def test_taking_the_tail_steps_back_and_committing_them_again_gives_the_killed_ledger(sampler, before, after):
    d = Driver(n_rows=40, sampler=sampler, num_prompts_per_step=3, window=1, group_size=2, epochs=2)
    for choice, pick in before:
        act(d, choice, pick)
    base = d.ledger.capture()
    base_bytes = codec.encode(base)
    mark = len(d.events)
    for choice, pick in after:
        act(d, choice, pick)
    tail = d.events[mark:]
    killed = d.ledger.capture()

    r = replay(codec.decode(base_bytes), sealed_rows(base), with_rows(tail))
    assert audit(r.state).ok, str(audit(r.state))
    assert r.events == len(tail)
    assert r.state.version == base.version and r.state.max_version == killed.version
    assert codec.encode(r.state) == codec.encode(codec.decode(codec.encode(r.state)))  # it persists
    commits = [ev for ev in tail if isinstance(ev, StepCommitted)]
    assert r.steps_taken_back == ([base.version + 1, killed.version] if commits else [])
    assert r.groups_returned == sum(len(c.group_ids) for c in commits)
    assert {k: set(b) for k, b in r.state.trained.items()} == {k: set(b) for k, b in base.trained.items() if b}
    assert set(r.rows) == set(sealed_rows(r.state))  # every row the state references, no other

    again = Ledger.from_state(r.state)
    for ev in tail:
        if isinstance(ev, (Claimed, StepCommitted)):
            again.apply(ev)
    assert codec.encode(again.capture()) == codec.encode(killed)


def test_an_empty_tail_is_the_checkpoint() -> None:
    d = Driver(n_rows=12, num_prompts_per_step=2)
    for _ in range(3):
        d.take_and_admit()
    gid = d.take_and_admit() or next(g for g, _ in d.ledger.groups())
    d.complete(gid)
    base = d.ledger.capture()
    r = replay(base, sealed_rows(base), [])
    assert codec.encode(r.state) == codec.encode(base) and r.events == 0 and r.steps_taken_back == []


def test_a_claim_open_at_the_kill_is_released() -> None:
    d = Driver(n_rows=12, num_prompts_per_step=2)
    base = d.ledger.capture()
    mark = len(d.events)
    gids = [d.take_and_admit(), d.take_and_admit()]
    for gid in gids:
        d.complete(gid)
    d.apply(Claimed(step=1, group_ids=tuple(gids)))  # killed before the commit
    r = replay(base, {}, with_rows(d.events[mark:]))
    assert {GroupState(rec.state) for rec in r.state.groups.values()} == {GroupState.READY}
    assert all(rec.claim_step is None for rec in r.state.groups.values()) and audit(r.state).ok


def test_a_tail_that_does_not_continue_the_checkpoint_is_refused() -> None:
    d = Driver(n_rows=12, num_prompts_per_step=2)
    d.take_and_admit()
    base = d.ledger.capture()
    other = Driver(n_rows=12, num_prompts_per_step=2)  # another lineage: it takes the same key again
    other.take_and_admit()
    with pytest.raises(IllegalTransition, match="journal event 1 after the checkpoint"):
        replay(base, {}, with_rows(other.events))


def test_a_seal_without_its_row_is_refused() -> None:
    d = Driver(n_rows=12, num_prompts_per_step=2)
    base = d.ledger.capture()
    mark = len(d.events)
    gid = d.take_and_admit()
    d.complete(gid)
    tail = [(ev, None) for ev in d.events[mark:]]
    with pytest.raises(ValueError, match="a seal without its row"):
        replay(base, {}, tail)

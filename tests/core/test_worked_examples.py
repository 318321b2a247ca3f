"""The worked examples of reference/000, 001 and 003, reproduced at the ledger level.

Each test builds the state the reference draws at the moment of the checkpoint, sends it
through capture -> codec -> restore -> normalize (`Driver.checkpoint_restore`), checks who
owns each prompt afterwards, and finishes the run to prove every prompt ends with exactly
one owner and no prompt trains twice. Prompt numbers in the references are ordinals here
(group id `e0.<n>`).
"""

from __future__ import annotations

from collections import Counter

import pytest
from ledger_driver import Driver, ordinal

from rollkeep.core.custody.events import (
    INFRA,
    PROMPT_GROUP,
    SIBLING,
    Admitted,
    Dispatched,
    Finalizing,
    Taken,
)
from rollkeep.core.custody.keys import Key
from rollkeep.core.custody.ledger import AttemptStatus, GroupState, Owner
from rollkeep.core.errors import ExternalError
from rollkeep.core.rollout.take import check_step_size


def g(o: int) -> str:
    return f"e0.{o}"


def assert_exactly_once(d: Driver, trained: set[int], dropped: set[int] = frozenset()) -> None:
    """Every prompt of the (one-epoch) dataset ends TRAINED or DROPPED, never both, once."""
    counts = Counter(d.trained_ordinals())
    assert all(c == 1 for c in counts.values()), f"trained twice: {counts.most_common(3)}"
    assert set(counts) == trained
    assert {k.ordinal for k in d.ledger.dropped()} == set(dropped)
    assert len(d.ledger) == 0 and d.ledger.spare == () and d.ledger.exhausted
    for o in range(d.ledger.n_rows):
        assert d.ledger.owner((0, o)) == (Owner.DROPPED if o in dropped else Owner.TRAINED)


# --- reference 000: g20-g23 ------------------------------------------------------------------


def build_000(granularity: str) -> Driver:
    """P=3, so step 7 = {18, 19, 20} and step 8 = {21, 22, 23}; steps 1-6 trained 0-17.

    g21 and g22 are taken at version 5, while steps 6 and 7 are full and the lookahead gate
    is closed. Step 6 commits, the gate opens, and the pump admits g21 for step 8 and
    dispatches it; the checkpoint lands before the pump comes back to admit g22.
    """
    d = Driver(n_rows=30, num_prompts_per_step=3, window=1, group_size=4, granularity=granularity)
    while d.ledger.version < 5:
        gid = d.take_and_admit()
        if gid is not None:
            d.complete(gid)
        else:
            assert d.train_step() is not None
    assert d.trained_ordinals() == list(range(15))
    for gid in [d.take_and_admit() for _ in range(3)]:
        d.complete(gid)
    assert [d.ledger.group(g(o)).target_step for o in range(15, 21)] == [6, 6, 6, 7, 7, 7]
    assert d.take_and_admit() is None
    assert [d.take(), d.take()] == [g(21), g(22)]
    assert d.sampler.admission(d.ledger, new=False) == (False, 8)  # waiting at the gate
    assert d.train_step().step == 6

    assert d.admit(g(21))
    assert d.ledger.group(g(21)).target_step == 8
    d.dispatch(g(21))
    d.seal(g(21), 0)
    d.seal(g(21), 1)
    assert d.state(g(20)) == GroupState.READY and d.ledger.group(g(20)).target_step == 7
    assert d.ledger.cursor == Key(0, 23)
    return d


@pytest.mark.parametrize("granularity", [SIBLING, PROMPT_GROUP])
def test_reference_000_g20_to_g23_each_keep_their_owner(granularity):
    """reference/000: "4 rollouts per prompt group, gate lets generation run 1 step ahead,
    trainer at step 7: g20 (step 7) all 4 rollouts finished -> replay buffer, trained on
    directly, nothing regenerates; g21 (step 8) 2 of 4 rollouts still generating -> ledger,
    ADMITTED, target_step=8, redispatched for step 8; g22 (no step yet) taken from the
    loader, waiting at the gate -> ledger, RESERVED, goes through admission again, then
    dispatches; g23 still in the dataset -> dataloader position, served normally."

    rollkeep differs on g21: at SIBLING granularity its 2 sealed siblings are kept and only
    the other 2 regenerate; at PROMPT_GROUP granularity all 4 regenerate.
    """
    d = build_000(granularity)
    freed_before = len(d.freed)
    d.checkpoint_restore()
    ledger = d.ledger
    restored_at = len(d.events)

    assert ledger.version == 6
    assert all(ledger.owner((0, o)) == Owner.TRAINED for o in range(18))
    assert ledger.owner((0, 20)) == Owner.REPLAY
    r20 = ledger.group(g(20))
    assert (r20.state, r20.target_step, r20.sealed_generations()) == (
        GroupState.READY,
        7,
        [0, 1, 2, 3],
    )
    assert ledger.owner((0, 21)) == Owner.LEDGER
    r21 = ledger.group(g(21))
    assert (r21.state, r21.target_step) == (GroupState.GENERATING, 8)
    assert r21.generations_with(AttemptStatus.DISPATCHED) == []
    assert ledger.owner((0, 22)) == Owner.LEDGER
    r22 = ledger.group(g(22))
    assert (r22.state, r22.target_step, r22.start_version) == (GroupState.RESERVED, None, None)
    assert ledger.owner((0, 23)) == Owner.SOURCE
    assert ledger.cursor == Key(0, 23)

    if granularity == SIBLING:  # sealed siblings survive; the dispatched ones get attempt 1
        assert r21.sealed_generations() == [0, 1]
        assert list(r21.attempts) == [0, 0, 1, 1]
        assert d.freed[freed_before:] == []
    else:  # all-or-nothing: the restart throws the 2 sealed rows away
        assert r21.sealed_generations() == []
        assert list(r21.attempts) == [1, 1, 1, 1]
        assert sorted(d.freed[freed_before:]) == [(g(21), 0, 0), (g(21), 1, 0)]

    step7 = d.train_step()  # g20 trains at once: step 7 needs nothing regenerated
    assert step7 is not None and step7.step == 7
    assert [ordinal(x) for x in step7.group_ids] == [18, 19, 20]
    assert step7.prompts == tuple((0, d.source.idx((0, o))) for o in (18, 19, 20))

    d.run_to_end()
    assert d.dispatched(g(20)) == [0, 1, 2, 3]  # only its original dispatch
    again = [2, 3] if granularity == SIBLING else [0, 1, 2, 3]
    assert d.dispatched(g(21)) == [0, 1, 2, 3] + again
    step8 = d.committed[7]
    assert (step8.step, [ordinal(x) for x in step8.group_ids]) == (8, [21, 22, 23])
    after = d.events[restored_at:]
    order = [
        (type(ev).__name__, ev.group_id if isinstance(ev, Admitted) else g(ev.ordinal))
        for ev in after
        if isinstance(ev, Admitted | Taken)
    ]
    assert order[:3] == [("Admitted", g(22)), ("Taken", g(23)), ("Admitted", g(23))]
    assert_exactly_once(d, trained=set(range(30)))


# --- reference 001: prompts 12-17 around a save after step 4 ---------------------------------


def build_001(sampler: str) -> Driver:
    """Steps 1-4 train 0-11; 12-14 READY (admitted at version 3); 15-17 admitted at 4."""
    d = Driver(n_rows=24, sampler=sampler, num_prompts_per_step=3, window=1, group_size=2)
    for gid in [d.take_and_admit() for _ in range(6)]:
        d.complete(gid)
    for step in range(1, 5):
        ev = d.train_step()
        assert ev is not None and ev.step == step
        assert [ordinal(x) for x in ev.group_ids] == [3 * step - 3, 3 * step - 2, 3 * step - 1]
        if step < 4:
            for gid in [d.take_and_admit() for _ in range(3)]:
                d.complete(gid)
    assert d.ledger.version == 4
    assert sorted(ordinal(x) for x in d.ledger.ready_ids()) == [12, 13, 14]
    assert [d.take_and_admit() for _ in range(3)] == [g(15), g(16), g(17)]
    d.dispatch(g(15))
    d.seal(g(15), 0)  # 1/2
    d.dispatch(g(16))
    d.seal(g(16), 0)
    d.seal(g(16), 1)
    d.apply(Finalizing(group_id=g(16)))  # 2/2, reward computation running
    d.dispatch(g(17))  # 0/2
    assert d.ledger.cursor == Key(0, 18)
    return d


@pytest.mark.parametrize("sampler", ["in_order", "weight_fifo", "windowed"])
def test_reference_001_resume_keeps_the_batch_generated_ahead_and_the_inflight_prompts(sampler):
    """reference/001: "3 prompts per training step, generation runs 1 step ahead. Save fires
    after step 4 ... 12, 13, 14 committed, waiting for step 5; 15, 16, 17 still generating —
    never saved [1/2, 2/2, 0/2]; cursor = 18 ... 16 has even finished both of its
    generations, but has not committed yet ... Every sampler behaves this way."

    Here every sampler resumes losslessly: step 5 trains exactly 12, 13, 14 (stamped for
    step 5 under in_order; the oldest by start version under weight_fifo and windowed),
    their rows are reused, and 15-17 keep their sealed generations and rerun the rest.
    """
    d = build_001(sampler)
    if sampler != "windowed":  # both gated samplers are full: two steps' worth alive
        assert d.sampler.admission(d.ledger)[0] is False
    d.checkpoint_restore()
    ledger = d.ledger
    mark = len(d.events)

    stamps = {o: (5 if o < 15 else 6) if sampler == "in_order" else None for o in range(12, 18)}
    for o in (12, 13, 14):
        assert ledger.owner((0, o)) == Owner.REPLAY
        assert ledger.group(g(o)).target_step == stamps[o]
    states = {o: GroupState(ledger.group(g(o)).state) for o in (15, 16, 17)}
    assert states == {
        15: GroupState.GENERATING,
        16: GroupState.READY_TO_FINALIZE,  # FINALIZING had no effect outside the ledger
        17: GroupState.GENERATING,
    }
    assert [ledger.group(g(o)).target_step for o in (15, 16, 17)] == [stamps[15]] * 3
    assert ledger.group(g(15)).sealed_generations() == [0]
    assert ledger.group(g(17)).sealed_generations() == []
    assert ledger.cursor == Key(0, 18)

    for o in (15, 16, 17):
        d.complete(g(o))
    since = [ev for ev in d.events[mark:] if isinstance(ev, Dispatched)]
    assert {(ev.group_id, ev.generations) for ev in since} == {(g(15), (1,)), (g(17), (0, 1))}

    step5 = d.train_step()
    assert step5 is not None and step5.step == 5
    assert [ordinal(x) for x in step5.group_ids] == [12, 13, 14]
    step6 = d.train_step()
    assert step6 is not None and [ordinal(x) for x in step6.group_ids] == [15, 16, 17]

    d.run_to_end()
    for o in (12, 13, 14, 16):  # finished before the save: never generated again
        assert d.dispatched(g(o)) == [0, 1]
    assert_exactly_once(d, trained=set(range(24)))


# --- reference 003: a refill from later prompts while the next step generates ----------------


def build_003(on_dropped_prompt: str, min_step_batch_fraction: float = 1.0) -> Driver:
    """24 prompts, 8 per step, lookahead 1: steps 1 (0-7) and 2 (8-15) are filled at once."""
    d = Driver(
        n_rows=24,
        num_prompts_per_step=8,
        window=1,
        group_size=2,
        min_step_batch_fraction=min_step_batch_fraction,
    )
    admitted = [d.take_and_admit() for _ in range(16)]
    assert [d.ledger.group(x).target_step for x in admitted] == [1] * 8 + [2] * 8
    assert d.take_and_admit() is None  # two steps at once is all the lookahead allows
    for gid in admitted:
        d.dispatch(gid)
    for o in (0, 1, 2):
        d.complete(g(o))
    for o in (8, 9, 10, 11):  # step 2 still being answered
        d.seal(g(o), 0)
    return d


def spend_budget(d: Driver, o: int, budget: int = 2) -> str:
    """Fail sibling 0 of `o` until its infra budget is spent; return the drop reason."""
    for attempt in range(budget):
        if attempt:
            d.dispatch(g(o), (0,))
        d.fail(g(o), 0, INFRA)
    assert d.ledger.group(g(o)).infra_failures[0] == budget
    return f"infra budget spent ({budget} attempts)"


def test_reference_003_refill_from_later_prompts_loses_nothing_in_flight():
    """reference/003: "24 prompts, handed out 8 at a time. Two training steps are being
    filled at once ... step 0's worker dies after 3 of 8 groups; ... refills it from the
    CURRENT batch: prompts 16..20 → step 0 ... step 0 now holds {0,1,2} + {16..20} → it
    completes and trains ... prompts 8..15 are below 16, so the restart never yields them
    again."

    Steps count from 1 here. Custody is per key, so there is no "trained up to" mark for a
    refill to push past 8-15: they survive the checkpoint and train exactly once.
    """
    d = build_003("replace")
    for i, o in enumerate(range(3, 8)):
        reason = spend_budget(d, o)
        d.drop(g(o), reason, on_dropped_prompt="replace")
        refill = d.ledger.group(g(16 + i))
        assert (refill.state, refill.target_step, refill.start_version) == (
            GroupState.GENERATING,
            1,
            0,
        )
    assert sorted(ordinal(x) for x in d.ledger.stamped(1)) == [0, 1, 2, 16, 17, 18, 19, 20]
    assert d.ledger.cursor == Key(0, 21)

    d.checkpoint_restore()  # while 8-15 are still generating
    ledger = d.ledger
    for o in range(8, 16):
        assert ledger.owner((0, o)) == Owner.LEDGER
        assert ledger.group(g(o)).target_step == 2
    assert [ledger.group(g(o)).sealed_generations() for o in (8, 12)] == [[0], []]
    for o in range(3, 8):
        assert ledger.owner((0, o)) == Owner.DROPPED
        assert ledger.dropped()[Key(0, o)] == ("infra budget spent (2 attempts)", 1)

    d.run_to_end()
    steps = [(ev.step, sorted(ordinal(x) for x in ev.group_ids)) for ev in d.committed]
    assert steps == [
        (1, [0, 1, 2, 16, 17, 18, 19, 20]),
        (2, list(range(8, 16))),
        (3, [21, 22, 23]),  # the final, partial step
    ]
    assert_exactly_once(d, trained=set(range(24)) - set(range(3, 8)), dropped=set(range(3, 8)))


def test_reference_003_shrink_trains_the_short_step_and_keeps_later_prompts():
    """reference/003 with `on_dropped_prompt: shrink`: "the step trains on fewer groups,
    never below ceil(min_step_batch_fraction × num_prompts_per_step)" (DESIGN §6). Nothing
    is refilled, so the cursor stays at 16 and 16-23 make up step 3."""
    d = build_003("shrink", min_step_batch_fraction=3 / 8)
    for o in range(3, 8):
        d.drop(g(o), spend_budget(d, o), on_dropped_prompt="shrink")
        check_step_size(d.ledger, d.limits, 1)
    assert d.ledger.shortfall(1) == 5 and d.ledger.cursor == Key(0, 16)

    d.checkpoint_restore()
    assert d.ledger.shortfall(1) == 5
    d.run_to_end()
    steps = [(ev.step, sorted(ordinal(x) for x in ev.group_ids)) for ev in d.committed]
    assert steps == [(1, [0, 1, 2]), (2, list(range(8, 16))), (3, list(range(16, 24)))]
    assert d.ledger.shortfall(1) == 0  # settled by the commit
    assert_exactly_once(d, trained=set(range(24)) - set(range(3, 8)), dropped=set(range(3, 8)))


def test_reference_003_shrink_below_min_step_batch_fraction_stops_the_run():
    """DESIGN §6: "... never below ceil(min_step_batch_fraction × num_prompts_per_step),
    else the run stops with an error." With 0.5 × 8 = 4, the fifth drop leaves 3."""
    d = build_003("shrink", min_step_batch_fraction=0.5)
    for o in range(3, 7):
        d.drop(g(o), spend_budget(d, o), on_dropped_prompt="shrink")
        check_step_size(d.ledger, d.limits, 1)  # 8 - 4 = 4 is still enough
    d.drop(g(7), spend_budget(d, 7), on_dropped_prompt="shrink")
    with pytest.raises(ExternalError) as err:
        check_step_size(d.ledger, d.limits, 1)
    assert "step 1 lost 5 of 8" in str(err.value)
    assert err.value.expected.startswith("at least 4 groups per step")
    assert err.value.found == "3 left"
    check_step_size(d.ledger, d.limits, 2)  # step 2 lost nothing

"""Samplers (admission gate and step selection), start-up limits, and the take and drop events
that drop, refill and shrink a step. Ledger-level: driven by `ledger_driver.Driver`, which
audits custody after every event."""

from __future__ import annotations

import math
from collections import Counter

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ledger_driver import Driver, ordinal

from rollkeep.core.custody import codec
from rollkeep.core.custody.events import FROM_SOURCE, FROM_SPARE, INFRA, Admitted, Claimed
from rollkeep.core.custody.keys import Key
from rollkeep.core.custody.ledger import AttemptStatus, GroupState, Owner
from rollkeep.core.errors import ConfigError, IllegalTransition, UserInputError
from rollkeep.core.rollout.samplers import Limits, check_limits, make_sampler
from rollkeep.core.rollout.take import drop_event


def g(o: int) -> str:
    return f"e0.{o}"


def admit_all(d: Driver) -> list[str]:
    """Admit until the gate closes (or nothing is left); the admitted group ids."""
    out = []
    while (gid := d.take_and_admit()) is not None:
        out.append(gid)
    return out


def ords(gids) -> list[int]:
    return [ordinal(x) for x in gids]


# --- check_limits ----------------------------------------------------------------------------


def test_check_limits_reports_every_problem_at_once():
    with pytest.raises(ConfigError) as err:
        check_limits(
            "fifo",
            num_prompts_per_step=4,
            window=-1,
            max_inflight_prompts=0,
            max_buffered_rollouts=2,
            min_step_batch_fraction=0.0,
        )
    msg = str(err.value)
    assert isinstance(err.value, UserInputError)
    assert "5 problem(s)" in msg
    for named in (
        "sampler.name is 'fifo'",
        "window) is -1",
        "max_inflight_prompts is 0",
        "max_buffered_rollouts is 2",
        "min_step_batch_fraction is 0.0",
    ):
        assert named in msg and named in err.value.found


def test_check_limits_names_num_prompts_per_step():
    with pytest.raises(ConfigError, match=r"train\.num_prompts_per_step is 0"):
        check_limits(
            "in_order",
            num_prompts_per_step=0,
            window=1,
            max_inflight_prompts=None,
            max_buffered_rollouts=None,
        )


@pytest.mark.parametrize("sampler", ["in_order", "weight_fifo", "windowed"])
def test_check_limits_gated_samplers_never_buffer_past_capacity(sampler):
    with pytest.raises(ConfigError, match=r"max_buffered_rollouts is 5 .* = 4"):
        check_limits(
            sampler,
            num_prompts_per_step=2,
            window=1,
            max_inflight_prompts=None,
            max_buffered_rollouts=5,
        )


def test_check_limits_windowed_must_buffer_a_step():
    limits = check_limits(
        "windowed",
        num_prompts_per_step=2,
        window=1,
        max_inflight_prompts=9,  # above capacity: the gate bounds it (as for weight_fifo)
        max_buffered_rollouts=None,
    )
    assert (limits.capacity, limits.max_inflight_prompts, limits.max_buffered_rollouts) == (4, 9, 4)
    with pytest.raises(ConfigError, match=r"max_buffered_rollouts is 1 but a step needs 2"):
        check_limits(
            "windowed",
            num_prompts_per_step=2,
            window=1,
            max_inflight_prompts=3,
            max_buffered_rollouts=1,
        )


@pytest.mark.parametrize(
    ("p", "window", "fraction", "min_groups"),
    [(3, 0, 1.0, 3), (8, 2, 0.3, 3), (2, 1, 0.1, 1), (8, 1, 0.5, 4)],
)
def test_check_limits_defaults_to_capacity(p, window, fraction, min_groups):
    limits = check_limits(
        "in_order",
        num_prompts_per_step=p,
        window=window,
        max_inflight_prompts=None,
        max_buffered_rollouts=None,
        min_step_batch_fraction=fraction,
    )
    assert limits == Limits(p, window, p * (window + 1), p * (window + 1), fraction)
    assert limits.capacity == p * (window + 1)
    assert limits.min_step_groups == min_groups == max(1, math.ceil(fraction * p))


@pytest.mark.parametrize(
    ("sampler", "key"),
    [("in_order", "max_lookahead_versions"), ("weight_fifo", "max_staleness_versions")],
)
def test_check_limits_names_the_window_key(sampler, key):
    with pytest.raises(ConfigError) as err:
        check_limits(
            sampler,
            num_prompts_per_step=2,
            window=-1,
            max_inflight_prompts=None,
            max_buffered_rollouts=None,
        )
    assert key in str(err.value)


def test_make_sampler_rejects_an_unknown_name():
    limits = check_limits(
        "in_order",
        num_prompts_per_step=1,
        window=0,
        max_inflight_prompts=None,
        max_buffered_rollouts=None,
    )
    with pytest.raises(UserInputError) as err:
        make_sampler("fifo", limits)
    assert err.value.field == "sampler.name"
    assert [make_sampler(n, limits).stamps for n in ("in_order", "weight_fifo", "windowed")] == [
        True,
        False,
        False,
    ]


# --- in_order --------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [0, 1, 2])
def test_in_order_gate_runs_window_steps_ahead_of_the_trainer(window):
    d = Driver(n_rows=60, num_prompts_per_step=3, window=window, max_inflight_prompts=100)
    first = admit_all(d)
    assert [d.ledger.group(x).target_step for x in first] == [
        k for k in range(1, window + 2) for _ in range(3)
    ]
    assert ords(first) == list(range(3 * (window + 1)))
    assert d.sampler.admission(d.ledger) == (False, window + 2)  # closed by the lookahead

    for gid in first:
        d.complete(gid)
    assert d.sampler.admission(d.ledger)[0] is False  # finishing does not open it
    assert d.train_step().step == 1
    more = admit_all(d)  # one commit opens exactly one more step
    assert [d.ledger.group(x).target_step for x in more] == [window + 2] * 3
    assert d.sampler.admission(d.ledger) == (False, window + 3)


def test_in_order_select_waits_for_every_stamped_group_to_be_ready():
    d = Driver(n_rows=10, num_prompts_per_step=2, window=1)
    a, b, c, e = admit_all(d)
    assert d.sampler.select(d.ledger, 1, final=False) is None  # nothing ready
    d.complete(c)
    d.complete(e)
    assert d.sampler.select(d.ledger, 1, final=True) is None  # step 2's groups never train step 1
    d.complete(b)
    for final in (False, True):
        assert d.sampler.select(d.ledger, 1, final=final) is None  # a is still generating
    d.complete(a)
    assert d.sampler.select(d.ledger, 1, final=False) == [a, b]
    assert d.sampler.select(d.ledger, 3, final=True) is None  # no stamps for step 3
    assert ords(d.train_step().group_ids) == [0, 1]
    assert ords(d.train_step().group_ids) == [2, 3]


def test_in_order_select_counts_the_shortfall_and_steps_fill_in_order():
    d = Driver(n_rows=10, num_prompts_per_step=3, window=1)
    step1 = [d.take_and_admit() for _ in range(3)]
    d.drop(step1[1], "data budget spent", on_dropped_prompt="shrink")
    assert d.ledger.shortfall(1) == 1
    assert d.sampler.admission(d.ledger) == (True, 2)  # 2 stamped + 1 short = full
    for gid in (step1[0], step1[2]):
        d.complete(gid)
    assert d.sampler.select(d.ledger, 1, final=False) == [step1[0], step1[2]]
    step2 = admit_all(d)
    assert ords(step2) == [3, 4, 5] and d.ledger.stamped(2) == step2
    assert d.train_step().group_ids == (step1[0], step1[2])
    assert d.ledger.shortfall(1) == 0  # settled by the commit


def test_in_order_trains_a_final_partial_step():
    d = Driver(n_rows=5, num_prompts_per_step=3, window=1)
    d.run_to_end()
    assert [(ev.step, ords(ev.group_ids)) for ev in d.committed] == [(1, [0, 1, 2]), (2, [3, 4])]

    d = Driver(n_rows=5, num_prompts_per_step=3, window=1)
    for gid in admit_all(d):
        d.complete(gid)
    assert d.train_step().step == 1
    assert d.sampler.select(d.ledger, 2, final=False) is None  # 2 of 3: not full
    assert d.nothing_left()
    assert ords(d.sampler.select(d.ledger, 2, final=True)) == [3, 4]


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(1, 4),
    window=st.integers(0, 2),
    group_size=st.integers(1, 3),
    blocks=st.integers(1, 4),
    rest=st.integers(0, 3),
    n_actions=st.integers(0, 150),
    rnd=st.randoms(use_true_random=False),
)
def test_in_order_trains_step_k_on_the_kth_block_of_admitted_keys(
    p, window, group_size, blocks, rest, n_actions, rnd
):
    """For any P, lookahead, group size and interleaving of dispatches, seals, failures,
    finalizations, train steps and checkpoint/restores (then run to the end in order),
    step k trains exactly the k-th block of P admitted keys (the last may be short)."""
    n_rows = p * blocks + rest % p
    d = Driver(n_rows=n_rows, num_prompts_per_step=p, window=window, group_size=group_size)
    for _ in range(n_actions):
        random_action(d, rnd)
    d.run_to_end()
    admitted = [ev.group_id for ev in d.events if isinstance(ev, Admitted)]
    assert ords(admitted) == list(range(n_rows))
    blocks_of_admitted = [tuple(admitted[i : i + p]) for i in range(0, n_rows, p)]
    assert [ev.group_ids for ev in d.committed] == blocks_of_admitted
    assert [ev.step for ev in d.committed] == list(range(1, len(blocks_of_admitted) + 1))
    assert d.ledger.trained_count() == n_rows


def random_action(d: Driver, rnd) -> None:
    """One step of a random controller: admit, dispatch, seal or fail, finalize, evict a
    stale group, train, or (rarely) checkpoint and restore."""
    groups = [(gid, r) for gid, r in d.ledger.groups()]
    choices = ["admit", "train", "evict"]
    generating = [(gid, r) for gid, r in groups if r.state == GroupState.GENERATING]
    if any(r.generations_with(AttemptStatus.RESERVED) for _, r in generating):
        choices.append("dispatch")
    if any(r.generations_with(AttemptStatus.DISPATCHED) for _, r in generating):
        choices += ["seal", "seal", "seal", "fail"]
    if any(r.state == GroupState.READY_TO_FINALIZE for _, r in groups):
        choices.append("finalize")
    if rnd.random() < 0.03:
        choices = ["restore"]
    action = rnd.choice(choices)
    if action == "admit":
        d.take_and_admit()
    elif action == "train":
        d.train_step()
    elif action == "evict":
        for gid in d.sampler.stale(d.ledger):
            d.evict(gid)
    elif action == "restore":
        d.checkpoint_restore()
    elif action == "dispatch":
        gid, r = rnd.choice(
            [(x, r) for x, r in generating if r.generations_with(AttemptStatus.RESERVED)]
        )
        gens = r.generations_with(AttemptStatus.RESERVED)
        d.dispatch(gid, tuple(rnd.sample(gens, rnd.randint(1, len(gens)))))
    elif action in ("seal", "fail"):
        gid, r = rnd.choice(
            [(x, r) for x, r in generating if r.generations_with(AttemptStatus.DISPATCHED)]
        )
        gen = rnd.choice(r.generations_with(AttemptStatus.DISPATCHED))
        d.seal(gid, gen) if action == "seal" else d.fail(gid, gen, INFRA)
    else:
        d.finalize(
            rnd.choice([gid for gid, r in groups if r.state == GroupState.READY_TO_FINALIZE])
        )


@settings(max_examples=40, deadline=None)
@given(
    sampler=st.sampled_from(["weight_fifo", "windowed"]),
    p=st.integers(1, 3),
    window=st.integers(0, 2),
    n_rows=st.integers(1, 12),
    n_actions=st.integers(0, 150),
    rnd=st.randoms(use_true_random=False),
)
def test_unstamped_samplers_train_every_prompt_exactly_once(
    sampler, p, window, n_rows, n_actions, rnd
):
    """Random interleavings with evictions and restores: no prompt lost, none trained twice,
    and no step trains a group older than the window."""
    d = Driver(n_rows=n_rows, sampler=sampler, num_prompts_per_step=p, window=window, group_size=2)
    for _ in range(n_actions):
        random_action(d, rnd)
    d.run_to_end()
    assert sorted(d.trained_ordinals()) == list(range(n_rows))
    claims = {ev.step: ev for ev in d.events if isinstance(ev, Claimed)}
    starts = {
        ev.group_id: ev.version for ev in d.events if isinstance(ev, Admitted)
    }  # the last admission
    for ev in d.committed:
        assert len(ev.group_ids) <= p
        assert all(ev.step - 1 - starts[x] <= window for x in claims[ev.step].group_ids)


# --- weight_fifo -----------------------------------------------------------------------------


def test_weight_fifo_gate_keeps_at_most_capacity_groups_alive():
    d = Driver(n_rows=20, sampler="weight_fifo", num_prompts_per_step=2, window=1)
    first = admit_all(d)
    assert len(first) == 4 and all(d.ledger.group(x).target_step is None for x in first)
    for gid in first:
        d.complete(gid)
    assert d.sampler.admission(d.ledger) == (False, None)  # READY groups are still alive
    gids = d.sampler.select(d.ledger, 1, final=False)
    assert ords(gids) == [0, 1]
    d.apply(Claimed(step=1, group_ids=tuple(gids)))
    # Claimed groups still count until the commit: steps 1 and 2 are full, and a group
    # admitted now (version 0) would be due by step 2.
    assert d.sampler.admission(d.ledger) == (False, None)
    d.apply(d.ledger.commit_event(1))
    assert ords(admit_all(d)) == [4, 5]
    assert d.sampler.admission(d.ledger) == (False, None)


def test_weight_fifo_selects_the_oldest_by_start_version_then_key():
    d = Driver(n_rows=10, sampler="weight_fifo", num_prompts_per_step=1, window=2)
    d.complete(d.take_and_admit())
    assert ords(d.train_step().group_ids) == [0]
    taken = [d.take() for _ in range(3)]  # e0.1, e0.2, e0.3
    for gid, version in zip(taken, (1, 0, 0), strict=True):
        d.apply(Admitted(group_id=gid, target_step=None, version=version))
    for gid in reversed(taken):  # ready order e0.3, e0.2, e0.1
        d.complete(gid)
    assert [ords(d.train_step().group_ids) for _ in range(3)] == [[2], [3], [1]]


def test_weight_fifo_skips_groups_older_than_the_window():
    d = Driver(n_rows=10, sampler="weight_fifo", num_prompts_per_step=1, window=0)
    a, b = [d.take() for _ in range(2)]
    d.apply(Admitted(group_id=a, target_step=None, version=0))
    d.complete(a)
    assert d.train_step().step == 1  # version 1
    d.apply(Admitted(group_id=b, target_step=None, version=0))
    d.complete(b)
    assert d.sampler.stale(d.ledger) == [b]
    assert d.sampler.select(d.ledger, 2, final=True) is None


# --- windowed --------------------------------------------------------------------------------


def test_windowed_gate_keeps_at_most_capacity_groups_alive_and_the_limits_below_it():
    """weight_fifo's gate: claimed and READY groups count until their step commits, so no
    more is generated than the window's steps can train (issue 29: with the gate bounded
    only by the two limits, half the generation aged out of the window)."""
    d = Driver(n_rows=30, sampler="windowed", num_prompts_per_step=2, window=1, max_inflight_prompts=3)
    first = admit_all(d)
    assert len(first) == 3  # max_inflight_prompts closes it below capacity 4
    d.complete(first[0])
    assert len(admit_all(d)) == 1  # 3 in flight + 1 READY = capacity
    for gid, rec in list(d.ledger.groups()):
        if rec.state != GroupState.READY:
            d.complete(gid)
    gids = d.sampler.select(d.ledger, 1, final=False)
    d.apply(Claimed(step=1, group_ids=tuple(gids)))
    assert d.sampler.admission(d.ledger) == (False, None)  # the claimed groups still count
    d.apply(d.ledger.commit_event(1))
    assert len(admit_all(d)) == 2


def test_windowed_overtakes_a_straggler_that_weight_fifo_waits_for():
    """The one way a windowed group goes stale: it is still generating while the W+1 steps
    of its window claim newer groups. weight_fifo, with the same gate, waits for it."""
    for name in ("windowed", "weight_fifo"):
        d = Driver(n_rows=30, sampler=name, num_prompts_per_step=1, window=1)
        straggler, fast = admit_all(d)  # capacity 2, both started at version 0
        d.complete(fast)
        assert ords(d.train_step().group_ids) == [1]
        newer = d.take_and_admit()  # started at version 1
        d.complete(newer)
        step = d.train_step()
        if name == "weight_fifo":  # the straggler is due at step 2: wait for it
            assert step is None and d.sampler.select(d.ledger, 2, final=False) is None
            continue
        assert ords(step.group_ids) == [2]  # overtaken
        d.complete(straggler)
        assert d.sampler.stale(d.ledger) == [straggler]


def test_windowed_stale_lists_groups_outside_the_window_and_eviction_regenerates_them():
    d = Driver(n_rows=10, sampler="windowed", num_prompts_per_step=1, window=1)
    assert admit_all(d) == [g(0), g(1)]  # capacity 2, both started at version 0
    d.complete(g(1))
    assert ords(d.train_step().group_ids) == [1]
    assert d.take_and_admit() == g(2)  # started at version 1
    d.complete(g(2))
    assert ords(d.train_step().group_ids) == [2]  # version 2: g(0) overtaken twice
    d.complete(g(0))
    assert d.sampler.stale(d.ledger) == [g(0)]
    assert d.sampler.select(d.ledger, 3, final=True) is None

    before = d.ledger.group(g(0))
    freed_before = len(d.freed)
    d.evict(g(0))
    rec = d.ledger.group(g(0))
    assert d.ledger.owner((0, 0)) == Owner.LEDGER
    assert (rec.state, rec.target_step, rec.start_version, rec.advantages) == (
        GroupState.RESERVED,
        None,
        None,
        None,
    )
    assert list(rec.status) == [AttemptStatus.RESERVED] * 2
    assert list(rec.attempts) == [a + 1 for a in before.attempts]  # fresh attempts
    assert d.freed[freed_before:] == [(g(0), 0, 0), (g(0), 1, 0)]  # its rows are garbage
    assert d.ledger.ready_ids() == [] and d.sampler.stale(d.ledger) == []
    with pytest.raises(IllegalTransition):
        d.evict(g(0))  # only READY groups are evicted

    assert d.take_and_admit() == g(0)  # RESERVED groups are admitted before new keys
    assert d.ledger.group(g(0)).start_version == 2 and d.ledger.cursor == Key(0, 3)
    d.run_to_end()
    assert sorted(d.trained_ordinals()) == list(range(10))
    assert d.dispatched(g(0)) == [0, 1, 0, 1]  # generated twice, trained once


def test_windowed_readmits_evicted_stragglers_before_new_prompts():
    """Two stragglers overtaken by two steps are evicted together. RESERVED, they count as
    in flight, and the gate for a group already taken must still let them in (a regression:
    counted against themselves, they kept it shut and the run stalled)."""
    d = Driver(n_rows=10, sampler="windowed", num_prompts_per_step=2, window=1, max_inflight_prompts=3)
    assert admit_all(d) == [g(0), g(1), g(2)]  # version 0
    d.complete(g(2))
    assert d.take_and_admit() == g(3)
    d.complete(g(3))
    assert ords(d.train_step().group_ids) == [2, 3]
    assert admit_all(d) == [g(4)]  # in flight: 0, 1, 4
    d.complete(g(4))
    assert admit_all(d) == [g(5)]  # alive: 0, 1, 4, 5 = capacity
    d.complete(g(5))
    assert ords(d.train_step().group_ids) == [4, 5]  # version 2: 0 and 1 overtaken twice
    d.complete(g(0))
    d.complete(g(1))
    assert d.sampler.stale(d.ledger) == [g(0), g(1)]
    for gid in d.sampler.stale(d.ledger):
        d.evict(gid)
    counts = d.ledger.counts()
    assert (counts["reserved"], counts["generating"], counts["ready"]) == (2, 0, 0)
    assert d.sampler.admission(d.ledger, new=False) == (True, None)
    assert admit_all(d) == [g(0), g(1), g(6)]  # the evicted first, then new keys
    d.run_to_end()
    assert sorted(d.trained_ordinals()) == list(range(10))


# --- drops, refills and shrinks --------------------------------------------------------------


def test_drop_of_a_stamped_group_is_refilled_from_the_spare_pool_then_the_source():
    d = Driver(n_rows=10, num_prompts_per_step=2, window=0)
    a, b = admit_all(d)
    d.spare()  # e0.2 set aside, cursor at 3
    assert d.ledger.spare == (Key(0, 2),) and d.ledger.owner((0, 2)) == Owner.SPARE
    d.complete(a)
    freed_before = len(d.freed)

    ev = drop_event(
        d.ledger, d.source, a, "reward error", on_dropped_prompt="replace", group_size=2
    )
    assert (ev.shrink, ev.replacement.origin, ev.replacement.ordinal) == (False, FROM_SPARE, 2)
    d.apply(ev)
    assert d.freed[freed_before:] == [(a, 0, 0), (a, 1, 0)]  # a READY group's rows go too
    assert d.ledger.dropped() == {Key(0, 0): ("reward error", 1)}
    assert d.ledger.spare == () and d.ledger.cursor == Key(0, 3)
    r2 = d.ledger.group(g(2))
    assert (r2.state, r2.target_step, r2.start_version) == (GroupState.GENERATING, 1, 0)

    ev = drop_event(
        d.ledger, d.source, b, "infra budget spent", on_dropped_prompt="replace", group_size=2
    )
    assert (ev.replacement.origin, ev.replacement.ordinal) == (FROM_SOURCE, 3)
    d.apply(ev)
    assert d.ledger.cursor == Key(0, 4) and sorted(d.ledger.stamped(1)) == [g(2), g(3)]
    assert d.ledger.shortfall(1) == 0
    d.run_to_end()
    assert ords(d.committed[0].group_ids) == [2, 3]
    assert sorted(d.trained_ordinals()) == [2, 3, 4, 5, 6, 7, 8, 9]


def test_the_spare_pool_is_taken_before_the_source():
    d = Driver(n_rows=10, sampler="weight_fifo", num_prompts_per_step=2, window=0)
    d.spare()
    d.spare()
    assert d.ledger.cursor == Key(0, 2) and d.ledger.owner((0, 1)) == Owner.SPARE
    assert admit_all(d) == [g(0), g(1)]
    assert d.ledger.spare == () and d.ledger.cursor == Key(0, 2)


def test_drop_of_an_unstamped_group_neither_refills_nor_shrinks():
    d = Driver(n_rows=10, sampler="weight_fifo", num_prompts_per_step=2, window=1)
    a = d.take_and_admit()
    d.dispatch(a)
    d.fail(a, 0, INFRA)
    for mode in ("replace", "shrink"):
        ev = drop_event(
            d.ledger, d.source, a, "infra budget spent", on_dropped_prompt=mode, group_size=2
        )
        assert (ev.group_id, ev.reason, ev.shrink, ev.replacement) == (
            a,
            "infra budget spent",
            False,
            None,
        )
    cursor = d.ledger.cursor
    d.apply(ev)
    assert d.ledger.owner((0, 0)) == Owner.DROPPED
    assert d.ledger.dropped()[Key(0, 0)] == ("infra budget spent", 1)  # the next step
    assert d.ledger.cursor == cursor and d.ledger.shortfall(1) == 0


def test_replace_becomes_shrink_when_nothing_is_left_to_take():
    d = Driver(n_rows=2, num_prompts_per_step=2, window=0, min_step_batch_fraction=0.5)
    a, b = admit_all(d)
    assert d.ledger.exhausted
    ev = drop_event(d.ledger, d.source, a, "filtered", on_dropped_prompt="replace", group_size=2)
    assert (ev.shrink, ev.replacement) == (True, None)
    d.apply(ev)
    assert d.ledger.shortfall(1) == 1
    d.complete(b)
    assert d.sampler.select(d.ledger, 1, final=False) == [b]
    d.run_to_end()
    assert d.trained_ordinals() == [1] and d.ledger.owner((0, 0)) == Owner.DROPPED


def test_drop_rejects_an_unknown_policy_and_an_incomplete_event_changes_nothing():
    d = Driver(n_rows=10, num_prompts_per_step=2, window=0)
    a, _ = admit_all(d)
    with pytest.raises(ValueError, match="on_dropped_prompt"):
        drop_event(d.ledger, d.source, a, "x", on_dropped_prompt="skip", group_size=2)
    ev = drop_event(d.ledger, d.source, a, "x", on_dropped_prompt="shrink", group_size=2)
    before = codec.encode(d.ledger.capture())
    with pytest.raises(IllegalTransition, match="exactly one of shrink=True or a replacement"):
        d.ledger.apply(msgspec.structs.replace(ev, shrink=False))
    assert codec.encode(d.ledger.capture()) == before


def test_exactly_once_with_drops_at_random():
    """Every sampler, every drop policy: each prompt ends TRAINED or DROPPED exactly once."""
    for sampler in ("in_order", "weight_fifo", "windowed"):
        for mode in ("replace", "shrink"):
            d = Driver(
                n_rows=17,
                sampler=sampler,
                num_prompts_per_step=3,
                window=1,
                min_step_batch_fraction=0.3,
            )
            dropped = set()
            for _ in range(200):
                if len(d.ledger) == 0 and d.nothing_left():
                    break
                admit_all(d)
                for gid, rec in d.ledger.groups():
                    if (
                        rec.state == GroupState.GENERATING
                        and ordinal(gid) % 5 == 3
                        and gid not in dropped
                    ):
                        dropped.add(gid)
                        d.drop(gid, "filtered", on_dropped_prompt=mode)
                    elif rec.state != GroupState.RESERVED:
                        d.complete(gid)
                for gid in d.sampler.stale(d.ledger):
                    d.evict(gid)
                d.train_step()
            else:
                pytest.fail(f"{sampler}/{mode}: no end: {d.ledger.counts()}")
            counts = Counter(d.trained_ordinals())
            assert set(counts.values()) <= {1}
            assert set(counts) | {ordinal(x) for x in dropped} == set(range(17))
            assert not set(counts) & {ordinal(x) for x in dropped}

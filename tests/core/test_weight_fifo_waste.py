"""weight_fifo wastes no generation: in a run without injected failures no admitted group
ever goes stale, so nothing is evicted and every completion generated is trained.

Regression for the bug where an uninterrupted weight_fifo run generated 66 completions
for 48 trained: the gate left claimed groups out of its count (so it admitted P groups too
many while a step trained), and selection let newer READY groups overtake an older, slow
one until it fell out of the window. Ledger-level tests drive `ledger_driver.Driver`
(custody audited after every event); the last test runs the real controller.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from ledger_driver import Driver, ordinal
from run_harness import config, run_to_end, trace_lines

from rollkeep.core.custody.events import INFRA, Admitted, Claimed, Evicted
from rollkeep.core.custody.ledger import AttemptStatus, GroupState


def g(o: int) -> str:
    return f"e0.{o}"


def ords(gids) -> list[int]:
    return [ordinal(x) for x in gids]


def overdue(d: Driver) -> list[str]:
    """Live admitted groups whose due step (start version + window + 1) is committed."""
    v, w = d.ledger.version, d.limits.window
    return [
        gid
        for gid, r in d.ledger.groups()
        if r.start_version is not None and v - r.start_version > w
    ]


# --- the two causes, one table test each ----------------------------------------------------


def test_weight_fifo_does_not_admit_for_a_step_that_is_training():
    """Cause 1: while step 1 trains (its groups claimed), steps 1 and 2 are full; a group
    admitted at version 0 would be due by step 2, so the gate must stay shut until the
    commit. It used to leave claimed groups out of its count and admit two more."""
    d = Driver(n_rows=20, sampler="weight_fifo", num_prompts_per_step=2, window=1)
    first = [d.take_and_admit() for _ in range(4)]
    assert d.take_and_admit() is None
    for gid in first:
        d.complete(gid)
    d.apply(Claimed(step=1, group_ids=tuple(d.sampler.select(d.ledger, 1, final=False))))
    assert d.sampler.admission(d.ledger) == (False, None)
    d.apply(d.ledger.commit_event(1))
    assert ords([d.take_and_admit(), d.take_and_admit()]) == [4, 5]  # version 1: due by step 3
    assert d.take_and_admit() is None
    assert ords(d.train_step().group_ids) == [2, 3]
    for gid in (g(4), g(5)):
        d.complete(gid)
    assert d.sampler.stale(d.ledger) == [] and overdue(d) == []
    assert ords(d.train_step().group_ids) == [4, 5]


def test_weight_fifo_waits_for_an_older_slow_group_instead_of_letting_it_go_stale():
    """Cause 2: with P=1 and window 1, a (version 0) is due by step 2. b (version 0)
    trains step 1; c (version 1) finishes before a. Step 2 must wait for a: claiming c
    used to push a to step 3, two versions old, and it was evicted and regenerated."""
    d = Driver(n_rows=10, sampler="weight_fifo", num_prompts_per_step=1, window=1)
    a, b = d.take_and_admit(), d.take_and_admit()
    d.complete(b)
    assert ords(d.train_step().group_ids) == [1]  # a is due by step 2, not 1: b may go first
    c = d.take_and_admit()
    assert d.ledger.group(c).start_version == 1
    d.complete(c)
    assert d.sampler.select(d.ledger, 2, final=False) is None  # a is due and still generating
    d.dispatch(a)
    d.seal(a, 0)
    assert d.sampler.select(d.ledger, 2, final=False) is None  # half done: still waits
    d.complete(a)
    assert ords(d.train_step().group_ids) == [0]
    assert ords(d.train_step().group_ids) == [2]
    assert not any(isinstance(ev, Evicted) for ev in d.events)


def test_weight_fifo_lets_newer_groups_go_first_when_the_older_ones_have_time():
    """Waiting is only for groups that are due: with window 2, a (version 0) is due by
    step 3, so steps 1 and 2 take the groups that finished first."""
    d = Driver(n_rows=10, sampler="weight_fifo", num_prompts_per_step=1, window=2)
    a, b, c = (d.take_and_admit() for _ in range(3))
    d.complete(c)
    assert ords(d.train_step().group_ids) == [2]
    d.complete(b)
    assert ords(d.train_step().group_ids) == [1]
    d.complete(d.take_and_admit())  # e0.3 and e0.4 (version 2) are ready; a is due now
    d.complete(d.take_and_admit())
    assert d.sampler.select(d.ledger, 3, final=False) is None
    d.complete(a)
    assert ords(d.train_step().group_ids) == [0]


# --- the invariant, for any completion order ------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    p=st.integers(1, 4),
    window=st.integers(0, 3),
    group_size=st.integers(1, 3),
    n_rows=st.integers(1, 30),
    n_actions=st.integers(0, 300),
    retries_and_restores=st.booleans(),
    rnd=st.randoms(use_true_random=False),
)
def test_weight_fifo_never_regenerates_in_an_uninterrupted_run(
    p, window, group_size, n_rows, n_actions, retries_and_restores, rnd
):
    """Any P, window and group size; admission whenever the gate opens; siblings
    dispatched, sealed and finalized in any order; train steps whenever the sampler
    offers one. After every event no READY group is stale and no live group is past its
    due step; at the end every prompt is trained exactly once and nothing was evicted.
    The same holds with retried infra failures and checkpoint/restores mixed in: a retry
    delays its group, and the trainer waits for it rather than let it go stale."""
    d = Driver(
        n_rows=n_rows,
        sampler="weight_fifo",
        num_prompts_per_step=p,
        window=window,
        group_size=group_size,
    )
    for _ in range(n_actions):
        random_action(d, rnd, retries_and_restores=retries_and_restores)
        assert d.sampler.stale(d.ledger) == []
        assert overdue(d) == []
    d.run_to_end()
    assert Counter(d.trained_ordinals()) == Counter(range(n_rows))
    assert not any(isinstance(ev, Evicted) for ev in d.events)
    admitted = Counter(ev.group_id for ev in d.events if isinstance(ev, Admitted))
    assert set(admitted.values()) == {1}  # admitted once each: nothing generated twice
    starts = {ev.group_id: ev.version for ev in d.events if isinstance(ev, Admitted)}
    for ev in d.committed:
        assert all(ev.step - 1 - starts[x] <= window for x in ev.group_ids)


def random_action(d: Driver, rnd, *, retries_and_restores: bool) -> None:
    groups = list(d.ledger.groups())
    generating = [(gid, r) for gid, r in groups if r.state == GroupState.GENERATING]
    to_dispatch = [(x, r) for x, r in generating if r.generations_with(AttemptStatus.RESERVED)]
    to_seal = [(x, r) for x, r in generating if r.generations_with(AttemptStatus.DISPATCHED)]
    to_finalize = [x for x, r in groups if r.state == GroupState.READY_TO_FINALIZE]
    choices = ["admit", "train"]
    choices += ["dispatch"] * bool(to_dispatch) + ["seal"] * 3 * bool(to_seal)
    choices += ["finalize"] * bool(to_finalize)
    if retries_and_restores:
        choices += ["fail"] * bool(to_seal) + ["restore"] * (rnd.random() < 0.05)
    action = rnd.choice(choices)
    if action == "admit":
        d.take_and_admit()
    elif action == "train":
        d.train_step()
    elif action == "dispatch":
        gid, r = rnd.choice(to_dispatch)
        gens = r.generations_with(AttemptStatus.RESERVED)
        d.dispatch(gid, tuple(rnd.sample(gens, rnd.randint(1, len(gens)))))
    elif action in ("seal", "fail"):
        gid, r = rnd.choice(to_seal)
        gen = rnd.choice(r.generations_with(AttemptStatus.DISPATCHED))
        d.seal(gid, gen) if action == "seal" else d.fail(gid, gen, INFRA)
    elif action == "finalize":
        d.finalize(rnd.choice(to_finalize))
    else:
        d.checkpoint_restore()


# --- the real controller --------------------------------------------------------------------


def test_weight_fifo_toy_run_with_jittered_latencies_trains_every_completion_it_generates(
    tmp_path,
):
    """The controller, uninterrupted, no injected failures, generation latencies jittered
    10x so groups finish far out of admission order, and a trainer step long enough for
    the gate to be asked while a step trains: no eviction, and completions generated
    (sealed) = completions trained (prompts of committed steps x group size)."""
    cfg = config(
        tmp_path / "run",
        "sampler.name=weight_fifo",
        "sampler.max_staleness_versions=1",
        "engine.latency_ms=1",
        "engine.latency_jitter_ms=10",
        "trainer.step_sleep_ms=5",
    )
    run_to_end(cfg)
    lines = trace_lines(cfg)
    events = Counter(x["event"] for x in lines)
    trained = sum(len(x["prompts"]) for x in lines if x["event"] == "step_committed")
    assert trained == cfg.train.total_steps * cfg.train.num_prompts_per_step
    assert events["evicted"] == 0 and events["failed"] == 0
    assert events["sealed"] == trained * cfg.rollout.group_size

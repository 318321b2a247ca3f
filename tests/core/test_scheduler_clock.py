"""The scheduler's time decisions, on a fake clock (issue 23): deadlines, backoff,
staleness, the signal stop and deterministic pinning, asserted on the commands `poll`
returns and on the ledger, with `Scheduler` driven directly (`sched_harness.Harness`: no
threads, no asyncio, no sleeps). Expected times are derived from the settings.

(These replace tests/controller/test_hostile_inputs.py's
`test_hung_generations_fail_as_infra_at_the_deadline_and_custody_holds`, which ran a whole
controller with rollout.timeout_s=1 and waited for real deadlines.)
"""

from __future__ import annotations

import math

import pytest
from sched_harness import Harness, completion

from rollkeep.core.custody.audit import audit
from rollkeep.core.custody.events import (
    DATA,
    INFRA,
    Abandoned,
    Admitted,
    Dispatched,
    Dropped,
    Evicted,
    Failed,
)
from rollkeep.core.custody.ledger import AttemptStatus, GroupState, Ledger
from rollkeep.core.rollout.rows import RowId
from rollkeep.core.schedule import (
    TRAIN_TABLE,
    Cancel,
    Cut,
    Dispatch,
    Failure,
    Generated,
    Phase,
    Reason,
    Refit,
    RetryPolicy,
    Stop,
    Train,
)


def started(**kw) -> Harness:
    """A harness whose engine holds version 0 (nothing is generated before the first refit)."""
    h = Harness(**kw)
    cmds = h.poll()
    assert [type(c) for c in cmds] == [Refit] and cmds[0].version == 0
    assert h.sched.phase is Phase.REFITTING
    h.refit()
    return h


def before(t: float) -> float:
    """The largest time the clock can read before `t`."""
    return math.nextafter(t, -math.inf)


def sibling_dispatches(cmds, gid: str, g: int) -> list[Dispatch]:
    return [d for d in Harness.of(cmds, Dispatch) if d.key[:2] == (gid, g)]


# -- attempt deadlines (rollout.timeout_s) -------------------------------------------------


def test_an_unanswered_attempt_is_cancelled_and_failed_as_infra_exactly_at_its_deadline() -> None:
    h = started(timeout_s=5.0, group_size=3, num_prompts_per_step=1, window=0)
    t0 = 1.25
    cmds = h.poll(t0)
    sent = h.of(cmds, Dispatch)
    assert len(sent) == h.settings.group_size  # one group (window 0, one prompt a step)
    deadline = t0 + h.settings.timeout_s
    assert h.wake(cmds) == deadline
    hung, *answered = [d.key for d in sent]
    gid, g, attempt = hung
    for k in answered:
        h.answer(k)

    cmds = h.poll(before(deadline))  # not one tick early
    assert not h.of(cmds, Cancel) and not h.events_of(Failed)
    assert h.ledger.is_current(*hung) and h.wake(cmds) == deadline

    cmds = h.poll(deadline)
    assert h.of(cmds, Cancel) == [Cancel((hung,))]
    [failed] = h.events_of(Failed)
    assert (failed.group_id, failed.generation, failed.attempt, failed.kind) == (gid, g, attempt, INFRA)
    assert "deadline" in failed.error and f"rollout.timeout_s={h.settings.timeout_s:g}" in failed.error
    rec = h.ledger.group(gid)
    assert rec.infra_failures[g] == 1 and rec.data_failures[g] == 0
    assert rec.attempts[g] == attempt + 1 and rec.status[g] == AttemptStatus.RESERVED
    # The retry waits for its backoff, and the poll says when that is.
    retry_at = deadline + h.settings.retry.backoff_ms / 1000
    assert not h.of(cmds, Dispatch) and h.wake(cmds) == retry_at
    cmds = h.poll(retry_at)
    [again] = h.of(cmds, Dispatch)
    assert again.key == (gid, g, attempt + 1) and again.request.infra_retries == 1
    assert h.wake(cmds) == retry_at + h.settings.timeout_s  # its own, full deadline

    # The aborted attempt's late answer changes nothing.
    state = h.ledger.capture()
    h.sched.on_result(hung, Generated(completion(0), 1.0), h.now)
    assert h.ledger.capture() == state and RowId(*hung) not in h.rows
    assert audit(h.ledger).ok


def test_a_sibling_that_never_answers_is_dropped_when_its_infra_budget_is_spent_and_replaced() -> None:
    retry = RetryPolicy(max_infra_attempts=3, max_data_attempts=2, backoff_ms=40.0, backoff_max_ms=60.0)
    h = started(timeout_s=2.0, retry=retry, group_size=2, num_prompts_per_step=1, window=0, n_rows=4)
    cmds = h.poll(0.0)
    first = h.of(cmds, Dispatch)
    gid, g = first[0].key[:2]
    for d in first[1:]:
        h.answer(d.key)
    t = 0.0
    for n in range(1, retry.max_infra_attempts + 1):
        deadline = t + h.settings.timeout_s
        cmds = h.poll(before(deadline))
        assert not h.of(cmds, Cancel) and len(h.events_of(Failed)) == n - 1
        cmds = h.poll(deadline)
        assert h.of(cmds, Cancel)[0].attempts == ((gid, g, n - 1),)
        assert len(h.events_of(Failed)) == n
        if n == retry.max_infra_attempts:
            break
        t = deadline + min(retry.backoff_ms * 2 ** (n - 1), retry.backoff_max_ms) / 1000
        assert h.wake(cmds) == t
        cmds = h.poll(t)
        assert [d.key for d in sibling_dispatches(cmds, gid, g)] == [(gid, g, n)]
    [dropped] = h.events_of(Dropped)
    assert dropped.group_id == gid and dropped.reason.startswith("infra budget spent")
    assert gid not in h.ledger and dropped.replacement is not None  # on_dropped_prompt: replace
    # Its sealed sibling's row is freed with it; the replacement is generated for the same step.
    assert not [r for r in h.rows.ids() if r.group_id == gid]
    replacement = [d for d in h.of(cmds, Dispatch) if d.key[0] != gid]
    assert len(replacement) == h.settings.group_size
    assert h.ledger.group(replacement[0].key[0]).target_step == dropped.step
    assert audit(h.ledger).ok


# -- retry backoff -------------------------------------------------------------------------


def test_a_failed_sibling_is_redispatched_only_after_its_backoff_which_doubles_to_the_cap() -> None:
    retry = RetryPolicy(max_infra_attempts=9, max_data_attempts=9, backoff_ms=100.0, backoff_max_ms=300.0)
    h = started(retry=retry, group_size=2, num_prompts_per_step=1, window=0)
    t = 10.0
    cmds = h.poll(t)
    key = h.of(cmds, Dispatch)[0].key
    gid, g, _ = key
    seed = h.in_flight[key].seed
    kinds = [INFRA, DATA, INFRA, DATA, INFRA]
    delays = []
    for n, kind in enumerate(kinds, start=1):
        h.answer(key, Failure(kind, "boom"))
        retry_at = t + min(retry.backoff_ms * 2 ** (n - 1), retry.backoff_max_ms) / 1000
        delays.append(round(retry_at - t, 9))
        cmds = h.poll()
        assert not sibling_dispatches(cmds, gid, g) and h.wake(cmds) == retry_at
        cmds = h.poll(before(retry_at))
        assert not sibling_dispatches(cmds, gid, g) and h.wake(cmds) == retry_at
        assert h.ledger.group(gid).status[g] == AttemptStatus.RESERVED
        cmds = h.poll(retry_at)
        [d] = sibling_dispatches(cmds, gid, g)
        assert d.key == (gid, g, n)
        assert (d.request.infra_retries, d.request.data_retries) == (kinds[:n].count(INFRA), kinds[:n].count(DATA))
        # A data failure samples afresh; an infra failure retries the same sample.
        assert (d.request.seed == seed) == (kind == INFRA)
        key, t, seed = d.key, retry_at, d.request.seed
    assert delays == [0.1, 0.2, 0.3, 0.3, 0.3]  # doubling, then capped at backoff_max_ms
    assert audit(h.ledger).ok


def test_a_retry_waiting_for_its_backoff_does_not_hold_back_other_groups() -> None:
    retry = RetryPolicy(max_infra_attempts=3, max_data_attempts=3, backoff_ms=500.0, backoff_max_ms=500.0)
    h = started(retry=retry, group_size=1, num_prompts_per_step=2, window=0, n_rows=6, total_steps=3)
    cmds = h.poll(0.0)
    a, b = [d.key for d in h.of(cmds, Dispatch)]
    h.answer(a, Failure(INFRA, "boom"))
    h.answer(b)
    cmds = h.poll(0.1)
    assert not h.of(cmds, Dispatch) and not h.of(cmds, Train)  # step 1 waits for a's retry
    assert h.wake(cmds) == retry.backoff_ms / 1000
    cmds = h.poll(retry.backoff_ms / 1000)
    assert [d.key for d in h.of(cmds, Dispatch)] == [(a[0], a[1], 1)]


# -- staleness (windowed: READY groups outside the window) --------------------------------


@pytest.mark.parametrize("on_stale", ["regenerate", "drop"])
def test_ready_groups_outside_the_window_are_evicted_or_dropped_at_the_next_claim(on_stale) -> None:
    # A straggler: the first group is still generating while the two steps of its window
    # (P = 1, W = 1) train the groups admitted next to it and after it.
    h = started(sampler="windowed", num_prompts_per_step=1, window=1, group_size=2, n_rows=10,
                total_steps=4, checkpoint_every=100, on_stale=on_stale)
    window = h.limits.window
    cmds = h.poll(0.0)
    straggler = h.of(cmds, Dispatch)[0].key[0]
    late = [d.key for d in h.of(cmds, Dispatch) if d.key[0] == straggler]
    for version in (1, 2):
        for key in [k for k in h.in_flight if k[0] != straggler]:
            h.answer(key)
        [train] = h.of(h.poll(), Train)
        assert straggler not in {tg.group_id for tg in train.batch.groups}
        h.train()
        [refit] = h.of(h.poll(), Refit)
        assert refit.version == h.ledger.version == version
        if version == 1:
            h.refit()
            h.poll()
    for key in late:
        h.answer(key)
    stale = sorted(gid for gid in h.ledger.ready_ids()
                   if h.ledger.version - h.ledger.group(gid).start_version > window)
    assert stale == [straggler]
    rows_before = {gid: [RowId(gid, g, a) for g, a in enumerate(h.ledger.group(gid).attempts)] for gid in stale}
    assert h.events_of(Evicted) == [] and h.events_of(Dropped) == []
    h.refit()
    cmds = h.poll()
    assert not any(set(stale) & {tg.group_id for tg in t.batch.groups} for t in h.of(cmds, Train))
    for gid in stale:  # their rows are freed either way
        assert not any(r in h.rows for r in rows_before[gid])
    if on_stale == "regenerate":
        assert sorted(e.group_id for e in h.events_of(Evicted)) == stale
        assert all(e.reason == Reason.STALE.value for e in h.events_of(Evicted))
        assert h.events_of(Dropped) == []
        regenerated = {d.key[0] for d in h.of(cmds, Dispatch)}
        for gid in stale:  # admitted again under the current weights, and generated again
            rec = h.ledger.group(gid)
            assert rec.state == GroupState.GENERATING and rec.start_version == h.ledger.version
            assert gid in regenerated
    else:
        assert sorted(e.group_id for e in h.events_of(Dropped)) == stale
        assert all(e.reason == Reason.STALE.value for e in h.events_of(Dropped))
        assert h.events_of(Evicted) == []
        assert all(gid not in h.ledger for gid in stale)
        assert len(h.ledger.dropped()) == len(stale)
    assert audit(h.ledger).ok
    assert h.run_to_stop().reason is Reason.FINISHED
    assert audit(h.ledger).ok


def test_weight_fifo_evicts_nothing_when_nothing_fails() -> None:
    h = started(sampler="weight_fifo", num_prompts_per_step=2, window=1, group_size=2, n_rows=16, total_steps=6)
    assert h.run_to_stop().reason is Reason.FINISHED
    assert h.events_of(Evicted) == [] and h.events_of(Dropped) == []
    assert h.ledger.trained_count() == h.settings.total_steps * h.limits.num_prompts_per_step


# -- the signal stop -----------------------------------------------------------------------


def to_training(**kw) -> Harness:
    """A run training step 1 with step 2's siblings in flight (in_order, window 1)."""
    kw = {"checkpoint_every": 100, **kw}
    h = started(sampler="in_order", num_prompts_per_step=1, window=1, group_size=2, n_rows=8, total_steps=5, **kw)
    cmds = h.poll(0.0)
    step1 = [d.key for d in h.of(cmds, Dispatch) if h.ledger.group(d.key[0]).target_step == 1]
    assert step1 and len(h.in_flight) > len(step1)
    for k in step1:
        h.answer(k)
    [train] = h.of(h.poll(0.5), Train)
    assert train.step == 1 and h.sched.phase is Phase.TRAINING and h.in_flight
    return h


def test_a_signal_finishes_the_step_in_training_then_writes_the_final_cut_then_stops() -> None:
    h = to_training()
    in_flight = set(h.in_flight)
    h.sched.on_signal()
    cmds = h.poll(1.0)
    assert not h.of(cmds, Dispatch) and not h.of(cmds, Cut) and not h.of(cmds, Stop)
    assert h.sched.phase is Phase.TRAINING and h.ledger.version == 0
    assert h.train() == 1 and h.ledger.version == 1  # the step in training commits

    cmds = h.poll(1.5)
    assert set(h.of(cmds, Cancel)[0].attempts) == in_flight and not h.in_flight
    abandoned = h.events_of(Abandoned)
    assert {(e.group_id, g) for e in abandoned for g in e.generations} == {k[:2] for k in in_flight}
    assert all(e.reason == Reason.SHUTDOWN.value for e in abandoned)
    assert h.of(cmds, Cut) == [Cut(1, final=True)]
    assert not h.of(cmds, Stop) and not h.of(cmds, Refit) and not h.of(cmds, Dispatch)
    assert h.sched.phase is Phase.FINAL_CUT
    # The cut holds the committed step and nothing in flight.
    (_, captured), = h.captures
    assert captured.ledger.version == 1 and audit(captured.ledger).ok
    restored = Ledger.from_state(captured.ledger)
    assert all(AttemptStatus.DISPATCHED not in rec.status for _, rec in restored.groups())
    # A late answer of a cancelled attempt changes nothing.
    state = h.ledger.capture()
    h.sched.on_result(next(iter(in_flight)), Generated(completion(0), 1.0), h.now)
    assert h.ledger.capture() == state

    assert not h.of(h.poll(2.0), Stop)  # Stop waits for the final cut to be written
    h.cut_written()
    cmds = h.poll(2.5)
    assert cmds == [Stop(Reason.SIGNAL)] and h.sched.phase is Phase.STOPPED


def test_a_signal_with_checkpoint_on_shutdown_off_stops_after_the_step_without_a_cut() -> None:
    h = to_training(checkpoint_on_shutdown=False)
    h.sched.on_signal()
    h.poll(1.0)
    h.train()
    cmds = h.poll(1.5)
    assert h.of(cmds, Stop) == [Stop(Reason.SIGNAL)] and not h.of(cmds, Cut) and not h.captures
    assert h.ledger.version == 1 and not h.in_flight


def test_a_signal_during_a_periodic_cut_stops_only_once_it_is_written() -> None:
    h = to_training(checkpoint_every=1)
    h.train()
    cmds = h.poll(1.0)
    assert h.of(cmds, Cut) == [Cut(1, final=False)] and h.of(cmds, Refit)
    h.sched.on_signal()
    h.refit()
    cmds = h.poll(1.5)
    assert not h.of(cmds, Stop) and not h.of(cmds, Cut) and not h.in_flight  # abandoned; the write goes on
    h.cut_written()
    cmds = h.poll(2.0)
    # What the stop abandoned changed custody since the periodic cut: a final one is written.
    assert h.of(cmds, Cut) == [Cut(1, final=True)] and not h.of(cmds, Stop)
    h.cut_written()
    assert h.poll(2.5) == [Stop(Reason.SIGNAL)]


def test_a_signal_before_the_first_refit_stops_without_generating() -> None:
    h = Harness()
    h.sched.on_signal()
    cmds = h.poll(0.0)
    # Nothing changed since the start (its limits alone give a checkpoint nothing new): no cut.
    assert cmds == [Stop(Reason.SIGNAL)] and not h.captures and h.sched.phase is Phase.STOPPED


# -- deterministic pinning -----------------------------------------------------------------


@pytest.mark.parametrize("window", [0, 1, 2])
def test_deterministic_mode_generates_each_step_under_its_pinned_version(window) -> None:
    h = started(deterministic=True, sampler="in_order", num_prompts_per_step=2, window=window,
                group_size=2, n_rows=16, total_steps=6, checkpoint_every=2)
    assert h.run_to_stop().reason is Reason.FINISHED
    target = {e.group_id: e.target_step for e in h.events_of(Admitted)}
    dispatched = h.events_of(Dispatched)
    assert len({e.group_id for e in dispatched}) == h.settings.total_steps * h.limits.num_prompts_per_step
    for e in dispatched:
        assert e.version == max(0, target[e.group_id] - 1 - window), e
    assert all(req.pinned_version == max(0, target[req.group_id] - 1 - window) for _, req in h.dispatched)


def test_train_table_phases_are_the_only_ones() -> None:
    """Every phase is reachable from TRAIN_TABLE, and a run passes only through them."""
    phases = {p for p, _ in TRAIN_TABLE} | set(TRAIN_TABLE.values())
    assert phases == set(Phase)

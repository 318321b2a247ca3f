"""The scheduler's fail-fast on user code (issue 28; core/schedule/failfast.py), on a fake
clock: while the run's first attempts all fail with one error, a spent data budget parks
its group instead of dropping it; one error `n` times stops the run (reason `user code`)
with nothing dropped; a success or another error releases the parked drops."""

from __future__ import annotations

import pytest
from sched_harness import Harness

from rollkeep.core.custody.events import DATA, Dropped
from rollkeep.core.errors import ExternalError
from rollkeep.core.schedule import Failure, Reason
from rollkeep.core.schedule.failfast import Watch

BOOM = "reward function m:f raised RuntimeError: boom"


def started(n: int, **kw) -> Harness:
    h = Harness(n_rows=8, num_prompts_per_step=2, group_size=2, fail_fast_attempts=n,
                retry=_retry(max_data_attempts=1), **kw)
    h.poll()
    h.refit()
    h.poll()
    assert h.in_flight
    return h


def _retry(max_data_attempts: int):
    from rollkeep.core.schedule.retry import RetryPolicy

    return RetryPolicy(max_infra_attempts=3, max_data_attempts=max_data_attempts, backoff_ms=0.0, backoff_max_ms=0.0)


def fail_all(h: Harness, error: str, times: int) -> None:
    for _ in range(times):
        key = next(iter(h.in_flight))
        h.answer(key, Failure(DATA, error, 0))
        h.poll()


def test_n_identical_failures_stop_the_run_with_nothing_dropped() -> None:
    h = started(4)
    fail_all(h, BOOM, 4)  # each spends its sibling's budget (max_data_attempts=1): parked, not dropped
    assert h.sched.fail_fast.state is Watch.TRIPPED and h.sched.user_code_failure == BOOM
    assert h.sched.stopping is Reason.USER_CODE
    stop = h.run_to_stop()
    assert stop.reason is Reason.USER_CODE
    assert h.events_of(Dropped) == []


def test_a_success_releases_the_parked_drops_as_data_failures() -> None:
    h = started(8)
    fail_all(h, BOOM, 2)
    assert h.events_of(Dropped) == [] and h.sched.fail_fast.watching
    key = next(iter(h.in_flight))
    h.answer(key)  # a completion: the code works
    assert h.sched.fail_fast.state is Watch.CLEARED
    dropped = h.events_of(Dropped)
    assert len(dropped) >= 1 and all("data budget spent" in d.reason and "boom" in d.reason for d in dropped)
    assert h.sched.stopping is None


def test_a_different_error_clears_the_watch_and_drops_as_before() -> None:
    h = started(8)
    first = next(iter(h.in_flight))
    h.answer(first, Failure(DATA, BOOM, 0))
    h.poll()
    assert h.events_of(Dropped) == []
    other = next(k for k in h.in_flight if k[0] != first[0])  # a sibling of another group
    h.answer(other, Failure(DATA, "reward function m:f raised KeyError: 'x'", 0))
    assert h.sched.fail_fast.state is Watch.CLEARED
    assert {d.group_id for d in h.events_of(Dropped)} == {first[0], other[0]}  # the parked one and this one


def test_off_drops_at_once() -> None:
    h = started(0)
    fail_all(h, BOOM, 1)
    assert len(h.events_of(Dropped)) == 1 and h.sched.stopping is None


def test_another_error_in_a_parked_group_drops_it_once() -> None:
    h = started(8)
    first = next(iter(h.in_flight))
    h.answer(first, Failure(DATA, BOOM, 0))
    h.poll()
    sibling = next(k for k in h.in_flight if k[0] == first[0])
    h.answer(sibling, Failure(DATA, "reward function m:f raised KeyError: 'x'", 0))
    assert [d.group_id for d in h.events_of(Dropped)] == [first[0]]


def test_nothing_left_to_dispatch_while_parked_ends_the_watch() -> None:
    h = Harness(n_rows=1, num_prompts_per_step=1, group_size=1, fail_fast_attempts=8,
                retry=_retry(max_data_attempts=1), on_dropped_prompt="shrink")
    h.poll()
    h.refit()
    h.poll()
    (key,) = h.in_flight
    h.answer(key, Failure(DATA, BOOM, 0))
    # One attempt, parked, and nothing else can run: too few to decide, so it is a data
    # failure after all (and the only prompt of the step is gone: exit 5, as before).
    with pytest.raises(ExternalError, match="step 1 lost 1 of 1 prompts.*boom"):
        h.poll()
    assert h.sched.fail_fast.state is Watch.CLEARED
    assert [d.group_id for d in h.events_of(Dropped)] == [key[0]]

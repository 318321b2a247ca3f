"""The loop↔worker handoff the engines share (engines/inbox.py): its batching and refit
policies, the idle fast path, and closing. Worker threads here are ordered by events and
joins, never by sleeping."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest

from rollkeep.engines.base import InfraError
from rollkeep.engines.inbox import Inbox, Refit, settle, take_batch, take_refits


@dataclass(eq=False)
class Job:
    name: str
    prompt_ids: list[int]
    future: Future = field(default_factory=Future)


def job(name: str, length: int) -> Job:
    return Job(name, [0] * length)


def names(jobs) -> list[str]:
    return [j.name for j in jobs]


def test_take_batch_takes_the_oldest_live_job_and_the_next_of_its_length_up_to_the_limit():
    jobs = deque([job("a3", 3), job("b5", 5), job("c3", 3), job("d3", 3), job("e5", 5), job("f3", 3)])
    assert names(take_batch(jobs, 3)) == ["a3", "c3", "d3"]
    assert names(jobs) == ["b5", "e5", "f3"]  # the rest, in queue order, in the same deque
    assert names(take_batch(jobs, 3)) == ["b5", "e5"]
    assert names(take_batch(jobs, 3)) == ["f3"]
    assert take_batch(jobs, 3) == [] and not jobs


def test_take_batch_drops_jobs_cancelled_while_queued():
    jobs = deque([job("a3", 3), job("b5", 5), job("c5", 5), job("d3", 3)])
    jobs[0].future.cancel()
    jobs[3].future.cancel()
    assert names(take_batch(jobs, 8)) == ["b5", "c5"]  # the oldest *live* job leads
    assert not jobs
    only_cancelled = deque([job("x", 1)])
    only_cancelled[0].future.cancel()
    assert take_batch(only_cancelled, 8) == [] and not only_cancelled


def test_take_refits_empties_the_queue_and_returns_the_awaited_ones_oldest_first():
    refits = deque(Refit({}, v, Future()) for v in (1, 2, 3, 4))
    refits[3].future.cancel()  # the newest was given up: the one before it is the newest now
    refits[1].future.cancel()
    assert [r.version for r in take_refits(refits)] == [1, 3]
    assert not refits and take_refits(refits) == []


def test_settle_drops_a_result_for_a_cancelled_future():
    done, cancelled, failed = Future(), Future(), Future()
    cancelled.cancel()
    settle(done, 7)
    settle(cancelled, 7)
    settle(failed, exception=ValueError("x"))
    settle(done, 8)  # already resolved: the first outcome stands
    assert done.result() == 7 and cancelled.cancelled()
    assert isinstance(failed.exception(), ValueError)


class Worker:
    """A worker thread that blocks in `Inbox.wait` and takes what is queued."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox
        self.queue: deque[str] = deque()
        self.waiting = threading.Event()  # set each time it blocks in `wait`
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            with self.inbox.cv:
                self.waiting.set()
                self.inbox.wait(lambda: self.queue)
                self.waiting.clear()
                if not self.queue:
                    return  # closing, and nothing is left
                self.queue.popleft()


def test_run_if_idle_runs_only_while_the_worker_is_blocked_in_wait():
    inbox = Inbox("test engine")
    assert inbox.run_if_idle(lambda: None) is False  # no worker waits yet
    w = Worker(inbox)
    assert w.waiting.wait(10)
    ran = []
    with inbox.cv:  # the worker is blocked in `wait` (it set `waiting` holding the lock)
        assert inbox.idle
    assert inbox.run_if_idle(lambda: ran.append(inbox.idle)) is True
    assert ran == [True]  # ran here, under the lock, the worker still blocked
    inbox.shut(w.queue)
    w.thread.join(10)
    assert not w.thread.is_alive()
    assert not inbox.idle
    with pytest.raises(InfraError, match="test engine: used after close"):
        inbox.run_if_idle(lambda: ran.append("late"))
    assert ran == [True]


def test_a_busy_worker_is_not_idle_and_the_fast_path_declines():
    inbox = Inbox("test engine")
    queue: deque[str] = deque(["job"])
    with inbox.cv:  # a worker that finds work does not block: it is never idle
        inbox.wait(lambda: queue)
        assert not inbox.idle
        queue.clear()
    ran = []
    assert inbox.run_if_idle(lambda: ran.append(1)) is False and ran == []


def test_shut_returns_what_was_queued_and_refuses_later_puts():
    inbox = Inbox("test engine")
    jobs, refits = deque(), deque()
    inbox.put(jobs, "j1")
    inbox.put(refits, "r1")
    inbox.put(jobs, "j2")
    assert inbox.shut(jobs, refits) == ["j1", "j2", "r1"]
    assert not jobs and not refits and inbox.closing
    with pytest.raises(InfraError, match="test engine: used after close"):
        inbox.put(jobs, "j3")
    assert not jobs
    with inbox.cv:  # a worker arriving after close does not block
        inbox.wait(lambda: jobs)

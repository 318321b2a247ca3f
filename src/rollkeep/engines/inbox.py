"""Handing work from the event loop to an engine's worker thread (torch, hf and vllm).

The loop side puts requests and weight refits into queues (`put`) and awaits their
`concurrent.futures.Future`s with `asyncio.wrap_future`; the worker thread blocks in
`wait` until there is work, takes it with `cv` held, and answers with `settle`.
Cancelling the awaiting task cancels its future: the worker drops a queued item whose
future is cancelled, and `settle` ignores a result that comes too late. `shut` marks the
inbox closed and returns what was still queued so the engine can fail it; a put after
that raises InfraError. `run_if_idle` lets the loop side do quick work itself while the
worker is blocked in `wait` (the torch engine loads its small refits so, rather than wait
for the worker to get the GIL back from the trainer's thread).

Two policies of the batching engines (torch, hf), each called with `cv` held:
  - `take_batch`: the oldest live request and the next ones of its prompt length (or of
    its batching key: the hf engine's also holds the sampling settings, which a batch shares);
  - `take_refits` (torch): every refit still awaited, oldest first; the engine loads the
    newest and settles them all with its outcome (a newer update supersedes a queued one).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .base import InfraError


@dataclass(eq=False)
class Refit:
    """New weights for the worker to load between batches (or steps)."""

    weights: Any  # a state dict: name -> tensor
    version: int
    future: Future  # of None


class _Queued(Protocol):
    prompt_ids: list[int]
    future: Future  # cancelled when the awaiting task is


J = TypeVar("J", bound=_Queued)


def settle(future: Future, result: Any = None, *, exception: BaseException | None = None) -> None:
    """Resolve a future unless its awaiting task cancelled it meanwhile (the result is dropped)."""
    with contextlib.suppress(InvalidStateError):
        if exception is None:
            future.set_result(result)
        else:
            future.set_exception(exception)


def take_batch(jobs: deque[J], limit: int, key: Callable[[J], Any] | None = None) -> list[J]:
    """Remove and return the oldest live job and the next ones of its prompt length (queue
    order, at most `limit`); jobs cancelled while queued are dropped. `key(job)`, when
    given, replaces the prompt length as what a batch's jobs share. `cv` held."""
    live = [j for j in jobs if not j.future.cancelled()]
    jobs.clear()
    if not live:
        return []
    key = key or (lambda j: len(j.prompt_ids))
    n = key(live[0])
    batch: list[J] = []
    rest: list[J] = []
    for j in live:
        (batch if key(j) == n and len(batch) < limit else rest).append(j)
    jobs.extend(rest)
    return batch


def take_refits(refits: deque[Refit]) -> list[Refit]:
    """Remove every queued refit; return those still awaited, oldest first. The caller loads
    the last one's weights and settles all of them with the outcome. `cv` held."""
    live = [r for r in refits if not r.future.cancelled()]
    refits.clear()
    return live


class Inbox:
    def __init__(self, owner: str) -> None:
        self.owner = owner  # "hf engine": names the engine in errors
        self.cv = threading.Condition()
        self.closing = False
        self.idle = False  # the worker is blocked in `wait`, running nothing

    def put(self, queue: deque, item: Any) -> None:
        with self.cv:
            self._check_open()
            queue.append(item)
            self.cv.notify()

    def wait(self, ready: Callable[[], Any]) -> None:
        """Worker, `cv` held: block until `ready()` (work is queued) or closing."""
        self.idle = True
        try:
            self.cv.wait_for(lambda: ready() or self.closing)
        finally:
            self.idle = False

    def run_if_idle(self, fn: Callable[[], None]) -> bool:
        """Loop side: run `fn()` on this thread, at once, if the worker is blocked in `wait`
        (it cannot wake while `fn` runs: `fn` runs under `cv`), and return True; return
        False, having run nothing, while the worker is busy. Saves a thread hop for quick
        work such as a small refit; the worker may have been notified of queued work, which
        then runs after `fn`."""
        with self.cv:
            self._check_open()
            if not self.idle:
                return False
            fn()
            return True

    def _check_open(self) -> None:
        if self.closing:
            raise InfraError(f"{self.owner}: used after close()")

    def shut(self, *queues: deque) -> list[Any]:
        """Close: no more puts; returns (and empties) what the queues still held."""
        with self.cv:
            self.closing = True
            left = [item for q in queues for item in q]
            for q in queues:
                q.clear()
            self.cv.notify()
        return left

"""Handing work from the event loop to an engine's worker thread (the hf and vllm engines).

The loop side puts requests and weight refits into queues and awaits their futures; the
worker thread waits on the condition for work. `shut` marks the inbox closed and returns
what was still queued so the engine can fail it; a put after that raises InfraError.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

from .base import InfraError


@dataclass(eq=False)
class Refit:
    """New weights for the worker to load between batches (or steps)."""

    weights: Any  # a state dict: name -> tensor
    version: int
    future: Future  # of None


def settle(future: Future, result: Any = None, *, exception: BaseException | None = None) -> None:
    """Resolve a future unless its awaiting task cancelled it meanwhile (the result is dropped)."""
    with contextlib.suppress(InvalidStateError):
        if exception is None:
            future.set_result(result)
        else:
            future.set_exception(exception)


class Inbox:
    def __init__(self, owner: str) -> None:
        self.owner = owner  # "hf engine": names the engine in errors
        self.cv = threading.Condition()
        self.closing = False

    def put(self, queue: deque, item: Any) -> None:
        with self.cv:
            if self.closing:
                raise InfraError(f"{self.owner}: used after close()")
            queue.append(item)
            self.cv.notify()

    def shut(self, *queues: deque) -> list[Any]:
        """Close: no more puts; returns (and empties) what the queues still held."""
        with self.cv:
            self.closing = True
            left = [item for q in queues for item in q]
            for q in queues:
                q.clear()
            self.cv.notify()
        return left

"""Fail fast on a bug in user code (docs/design.md §6): when the run's first attempts all
fail as data with the same error, the fault is the user's code (a reward function or an
environment that raises on every row), not the data, and dropping prompts for it would
spend the dataset on a bug.

    FailFast(n)     watches the outcomes of the run's first `n` attempts (n = 0: off)
    .sealed()       an attempt succeeded: the code works; the watch is over (CLEARED)
    .failed(error)  an attempt failed as data with `error`; TRIPPED once the first `n`
                    outcomes are all this same error, CLEARED on a different error

While it is WATCHING, the scheduler drops nothing: a group whose data budget is spent is
parked (no retry, no drop) until the watch ends. CLEARED releases the parked drops (a data
failure stays a data failure); TRIPPED stops the run with nothing dropped, its custody
intact, so the same command resumes once the code is fixed. Transitions are plain
assignments; nothing here does IO.
"""

from __future__ import annotations

import enum

__all__ = ["FailFast", "Watch"]


class Watch(enum.Enum):
    WATCHING = "watching"
    CLEARED = "cleared"  # an attempt succeeded, or two attempts failed differently
    TRIPPED = "tripped"  # the first n attempts failed with one error


class FailFast:
    def __init__(self, n: int) -> None:
        self.n = n
        self.state = Watch.WATCHING if n > 0 else Watch.CLEARED
        self.error: str | None = None  # the one error of every failure so far
        self.failures = 0

    @property
    def watching(self) -> bool:
        return self.state is Watch.WATCHING

    def sealed(self) -> Watch:
        if self.state is Watch.WATCHING:
            self.state = Watch.CLEARED
        return self.state

    def failed(self, error: str) -> Watch:
        if self.state is not Watch.WATCHING:
            return self.state
        if self.error is not None and error != self.error:
            self.state = Watch.CLEARED
            return self.state
        self.error, self.failures = error, self.failures + 1
        if self.failures >= self.n:
            self.state = Watch.TRIPPED
        return self.state

    def give_up(self) -> Watch:
        """Nothing can run while drops are parked (every attempt failed, too few to decide):
        the failures are data failures after all."""
        if self.state is Watch.WATCHING:
            self.state = Watch.CLEARED
        return self.state

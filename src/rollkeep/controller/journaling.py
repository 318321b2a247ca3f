"""The journal thread: the group commit of `rollkeep.core.journal.groupcommit` on a thread of its
own, so the loop never waits on the disk (docs/design.md §5.1). It runs a cycle every
`journal.flush_ms`, or at once when `flush_events` records were released; everything else
(the sinks, the checkpoint's covering sync, the faults) is the core's, which `rollkeep
simulate` drives on its fake clock without a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import Any

from ..core.journal.groupcommit import GroupCommit, check_writable

__all__ = ["JournalThread", "check_writable"]


class JournalThread(GroupCommit):
    def __init__(self, run_dir: Path, **kwargs: Any) -> None:
        self._wakeup = threading.Event()
        self._waiters_lock = threading.Lock()
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future]] = []
        super().__init__(run_dir, **kwargs)
        self._thread = threading.Thread(target=self._run, name="rollkeep-journal", daemon=True)
        self._thread.start()

    def _kick(self) -> None:
        super()._kick()
        self._wakeup.set()

    def _join(self) -> None:
        self._wakeup.set()
        self._thread.join()

    def kick(self) -> None:
        """Run the next cycle now, not at its tick (what was released is durable sooner)."""
        self._kick()

    def durable(self) -> asyncio.Future:
        """On the loop: a future done once every record released so far is durable (an
        effect's intent, before its call is made; `GroupCommit.release` first), or failed
        with the journal's error. Kicks the next cycle, so it waits for one fsync."""
        seq, loop = self._released, asyncio.get_running_loop()
        fut = loop.create_future()
        with self._waiters_lock:
            if self._error is not None:
                fut.set_exception(self._error)
            elif self.journal.durable_seq >= seq:
                fut.set_result(None)
            else:
                self._waiters.append((seq, loop, fut))
        if not fut.done():
            self._kick()
        return fut

    def _wake_waiters(self, error: BaseException | None) -> None:
        durable = self.journal.durable_seq
        with self._waiters_lock:
            done = [w for w in self._waiters if error is not None or w[0] <= durable]
            self._waiters = [w for w in self._waiters if w not in done]
        for _, loop, fut in done:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, fut, error)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._wakeup.wait(self.flush_s)
                self._wakeup.clear()
                try:
                    self.cycle()
                except BaseException as e:  # the loop raises it (check); nothing more is written
                    self.fail(e)
                    self._wake_waiters(self._error)
                    return
                self._wake_waiters(None)
        finally:
            if self._waiters:  # stopped: what is still waited for is not made durable by this thread
                self._wake_waiters(self._error or RuntimeError("the journal was closed"))


def _settle(fut: asyncio.Future, error: BaseException | None) -> None:
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(None)

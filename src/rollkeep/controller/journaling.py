"""The journal thread: the group commit of `rollkeep.core.journal.groupcommit` on a thread of its
own, so the loop never waits on the disk (docs/design.md §5.1). It runs a cycle every
`journal.flush_ms`, or at once when `flush_events` records were released; everything else
(the sinks, the checkpoint's covering sync, the faults) is the core's, which `rollkeep
simulate` drives on its fake clock without a thread.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ..core.journal.groupcommit import GroupCommit, check_writable

__all__ = ["JournalThread", "check_writable"]


class JournalThread(GroupCommit):
    def __init__(self, run_dir: Path, **kwargs: Any) -> None:
        self._wakeup = threading.Event()
        super().__init__(run_dir, **kwargs)
        self._thread = threading.Thread(target=self._run, name="rollkeep-journal", daemon=True)
        self._thread.start()

    def _kick(self) -> None:
        super()._kick()
        self._wakeup.set()

    def _join(self) -> None:
        self._wakeup.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop:
            self._wakeup.wait(self.flush_s)
            self._wakeup.clear()
            try:
                self.cycle()
            except BaseException as e:  # the loop raises it (check); nothing more is written
                self.fail(e)
                return

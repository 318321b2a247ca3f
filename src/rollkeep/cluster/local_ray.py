"""The run's own local Ray (`cluster.backend: ray` without `cluster.address`): the run
starts it, stops it when it ends, and it does not outlive the run when the run is killed.

What Ray does by itself (Ray 2.60, Linux): `ray.init` starts gcs_server, the raylet, the
dashboard and the monitors as children of the calling thread with PR_SET_PDEATHSIG
(SIGKILL), so the kernel kills them when the controller dies; the raylet starts its two
agents (dashboard, runtime env) and the workers (the replicas), and the workers exit with
their raylet. `ray.shutdown` stops them all. But the agents, when they see their raylet
die, first try to report it to the GCS, which died with it, and wait for the GCS's
reconnect timeout: they outlived a SIGKILLed controller by about 60 s.

So before `ray.init` the run starts a watchdog (`reaper.py`), marks the environment that
`ray.init` hands to the Ray processes (the watchdog holds the marked ones and their
descendants while the run lives), and `stop` (the pool's close, and at exit) runs
`ray.shutdown` and then has the watchdog kill whatever of that Ray is left and waits for
it. When the controller dies instead, the watchdog sees its pipe close and does the same
on its own. A cluster at `cluster.address` is only connected to, never stopped.

`ray.init` must run on the thread that lives as long as the run (the main thread): a
child's PR_SET_PDEATHSIG fires when the thread that started it exits.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from .reaper import VAR

REAPER = str(Path(__file__).with_name("reaper.py"))


class LocalRay:
    """A local Ray this process started, and the watchdog that ends it."""

    def __init__(self, ray: Any, **init: Any) -> None:
        self._ray = ray
        mark = uuid.uuid4().hex
        # Started before the mark is set (it must not sweep itself), in a session of its own.
        self._watchdog: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-I", REAPER, mark], stdin=subprocess.PIPE, start_new_session=True)
        before = os.environ.get(VAR)
        os.environ[VAR] = mark
        try:
            # "local": a new Ray, even with RAY_ADDRESS set or a `ray start` cluster on this machine.
            ray.init(address="local", **init)
        except BaseException:
            self.stop()
            raise
        finally:
            if before is None:
                os.environ.pop(VAR, None)  # later children of the controller are not Ray's
            else:
                os.environ[VAR] = before
        atexit.register(self.stop)  # (a run that fails before the pool is opened)

    def stop(self) -> None:
        """Stop the Ray and return once none of its processes is left (idempotent)."""
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is None:
            return
        try:
            self._ray.shutdown()
        finally:
            watchdog.stdin.close()
            try:
                watchdog.wait(timeout=60)
            except subprocess.TimeoutExpired:  # (its own deadline is 30 s)
                watchdog.kill()
                watchdog.wait()

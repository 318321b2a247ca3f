"""The watchdog of a run's own local Ray (`local_ray.py` starts it): standard library only,
run as a file (`python -I reaper.py MARK`), so it needs nothing of the run's imports.

Which processes are the run's Ray: those whose environment holds `ROLLKEEP_RAY_SESSION=MARK`
(the controller set it only while `ray.init` started the run's Ray: gcs_server, the raylet
and the monitors carry it, nothing else does), and every descendant of one of them. The
environment alone is not enough: the raylet's agents (dashboard, runtime env) and its
workers set their process title with setproctitle, which overwrites most of the memory
`/proc/PID/environ` reads, and the raylet hands them their environment in no fixed order,
so the mark survives in one start and not in the next (found by a flaky test: two agents
outlived a SIGKILLed controller). Their parent is a marked raylet, though, while it lives.

So while the run lives the watchdog looks every `SCAN_S` for the run's processes and keeps
a pidfd of each (a pidfd names one process: a signal sent through it cannot reach another
that reused the pid). It reads its stdin until the end: the controller closes it after
`ray.shutdown`, and the kernel closes it when the controller dies, however it dies
(SIGKILL included; the raylet dies with it and its agents are orphaned, but the watchdog
already holds them). Then it kills them all, and exits once none is left or after
`DEADLINE_S`. It runs in a session of its own: a Ctrl-C or a hangup sent to the
controller's terminal is not for it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time

VAR = "ROLLKEEP_RAY_SESSION"
DEADLINE_S = 30.0  # a process SIGKILL cannot end in this long is not ours to wait for
SCAN_S = 0.25  # a Ray process that starts and is orphaned within this is missed


def _open(pid: int) -> int | None:
    return os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None


def _alive(pid: int, fd: int | None) -> bool:
    """Whether the process is still running (a zombie has ended: its pidfd is readable)."""
    if fd is None:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    return not select.select([fd], [], [], 0)[0]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])  # (the name may hold spaces and ')')


class Tracker:
    """The run's Ray processes found so far, each with its pidfd (or None where the kernel
    has no pidfds)."""

    def __init__(self, entry: bytes) -> None:
        self.entry = entry
        self.procs: dict[int, int | None] = {}

    def scan(self) -> None:
        """Forget the processes that ended, then add every marked process and every child
        of a process held (over and over, so a grandchild found before its parent counts)."""
        for pid, fd in list(self.procs.items()):
            if not _alive(pid, fd):
                self._forget(pid)
        seen: dict[int, tuple[int, int | None]] = {}  # pid -> (parent, pidfd), not yet held
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in self.procs or int(name) == os.getpid():
                continue
            pid, fd = int(name), None
            try:
                fd = _open(pid)  # before the reads: what they say is about this process
                with open(f"/proc/{pid}/environ", "rb") as f:  # (a zombie's reads as empty)
                    marked = self.entry in f.read().split(b"\0")
                parent = _parent(pid)
            except (OSError, ValueError, IndexError):  # gone meanwhile, or another user's
                if fd is not None:
                    os.close(fd)
                continue
            if marked:
                self.procs[pid] = fd
            else:
                seen[pid] = (parent, fd)
        grew = True
        while grew:
            grew = False
            for pid, (parent, fd) in list(seen.items()):
                if parent in self.procs:
                    self.procs[pid] = fd
                    del seen[pid]
                    grew = True
        for _, fd in seen.values():
            if fd is not None:
                os.close(fd)

    def kill(self) -> None:
        for pid, fd in self.procs.items():
            with contextlib.suppress(OSError):
                if fd is None:
                    os.kill(pid, signal.SIGKILL)
                else:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)

    def _forget(self, pid: int) -> None:
        fd = self.procs.pop(pid)
        if fd is not None:
            os.close(fd)


def sweep(tracker: Tracker, deadline_s: float = DEADLINE_S) -> list[int]:
    """SIGKILL the run's processes until none is left; returns those still there at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        tracker.scan()
        if not tracker.procs or time.monotonic() > end:
            return sorted(tracker.procs)
        tracker.kill()
        time.sleep(0.02)  # (a killed process leaves /proc once its parent, or init, reaps it)


def watch(stdin: int, tracker: Tracker) -> None:
    """Track the run's processes until `stdin` reaches its end (nothing is ever written to it)."""
    while True:
        tracker.scan()
        if select.select([stdin], [], [], SCAN_S)[0] and not os.read(stdin, 1 << 16):
            return


def main(mark: str) -> int:
    tracker = Tracker(f"{VAR}={mark}".encode())
    watch(sys.stdin.fileno(), tracker)
    left = sweep(tracker)
    if left:
        print(f"rollkeep: processes of the run's Ray still alive after {DEADLINE_S:g} s: {left}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

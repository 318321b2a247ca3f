"""The watchdog of a run's own local Ray (`local_ray.py` starts it): standard library only,
run as a file (`python -I reaper.py MARK`), so it needs nothing of the run's imports.

It reads its stdin until the end: the controller closes it after `ray.shutdown`, and the
kernel closes it when the controller dies, however it dies (SIGKILL included). Then it
kills every process whose environment holds `ROLLKEEP_RAY_SESSION=MARK` (the controller
set it only while `ray.init` started the run's Ray, so the processes of that Ray, and the
agents and workers their raylet starts, carry it; nothing else does) and exits once none
is left, or after `DEADLINE_S`. It runs in a session of its own: a Ctrl-C or a hangup sent
to the controller's terminal is not for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

VAR = "ROLLKEEP_RAY_SESSION"
DEADLINE_S = 30.0  # a process SIGKILL cannot end in this long is not ours to wait for


def marked(entry: bytes) -> list[tuple[int, int | None]]:
    """(pid, pidfd or None) of every other process whose environment holds `entry`. The
    pidfd is opened before the environment is read, so a signal sent through it cannot
    reach another process that reused the pid."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        pid, fd = int(name), None
        try:
            if hasattr(os, "pidfd_open"):
                fd = os.pidfd_open(pid)
            with open(f"/proc/{pid}/environ", "rb") as f:  # (a zombie's reads as empty)
                if entry in f.read().split(b"\0"):
                    out.append((pid, fd))
                    continue
        except OSError:
            pass  # gone meanwhile, or another user's
        if fd is not None:
            os.close(fd)
    return out


def sweep(entry: bytes, deadline_s: float = DEADLINE_S) -> list[int]:
    """SIGKILL the marked processes until none is left; returns those still there at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        found = marked(entry)
        for pid, fd in found:
            with contextlib.suppress(OSError):
                if fd is None:
                    os.kill(pid, signal.SIGKILL)
                else:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            if fd is not None:
                os.close(fd)
        if not found or time.monotonic() > end:
            return [pid for pid, _ in found]
        time.sleep(0.02)  # (a killed process leaves /proc once its parent, or init, reaps it)


def main(mark: str) -> int:
    sys.stdin.buffer.read()  # until the controller closes it or dies
    left = sweep(f"{VAR}={mark}".encode())
    if left:
        print(f"rollkeep: processes of the run's Ray still alive after {DEADLINE_S:g} s: {left}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""Named crash points: kill this process, deterministically, at a chosen instant.

Tests and `rollkeep chaos` set the environment variable

    ROLLKEEP_CRASH_AT=<name>        die at the first `hit(<name>)` in this process
    ROLLKEEP_CRASH_AT=<name>:<n>    die at the n-th `hit(<name>)` (n counts from 1)

and the process is killed with SIGKILL at that call: nothing is flushed, no `finally` runs,
no atexit handler runs, exactly as if the machine had been preempted there. (A SIGKILL keeps
what the kernel already holds in its page cache; power loss does not. The store's
docstring argues the fsyncs that cover that difference.)

`ROLLKEEP_CRASH_SIGNAL=TERM` (or INT) sends that signal instead of SIGKILL: the same
deterministic instant, used to test graceful shutdown.

The variable is read once, at import, into a module global, so `hit` costs one global
lookup and one comparison when it is unset. Tests that change the variable in-process call
`_reload_from_env()`.

Every point is registered by name in `POINTS` so tests can enumerate them and crash at
each one; `hit` of an unregistered name is allowed (ad-hoc points in tests), but the points
of the checkpoint publication protocol are registered here, at import.
"""

from __future__ import annotations

import os
import signal

ENV_VAR = "ROLLKEEP_CRASH_AT"
SIGNAL_VAR = "ROLLKEEP_CRASH_SIGNAL"

POINTS: set[str] = set()

# The target, parsed from ENV_VAR: (name, n) or None. Read once at import.
_target: tuple[str, int] | None = None
# How many times the target name has been hit in this process.
_count = 0
_signal = signal.SIGKILL


def register(name: str) -> str:
    """Record a crash point name so tests can enumerate it; returns the name."""
    if not name or ":" in name:
        raise ValueError(f"crash point name {name!r} must be non-empty and contain no ':'")
    POINTS.add(name)
    return name


def _parse(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    name, sep, n = value.rpartition(":")
    if not sep:
        return value, 1
    if not name or not n.isdigit() or int(n) < 1:
        raise ValueError(
            f"{ENV_VAR}={value!r} is not of the form NAME or NAME:N with N >= 1 "
            f"(e.g. 'publish.dir_renamed' or 'publish.file_written:2')"
        )
    return name, int(n)


def _reload_from_env() -> None:
    """Re-read ENV_VAR and reset the hit counter (for tests that change the variable)."""
    global _target, _count, _signal
    _target = _parse(os.environ.get(ENV_VAR))
    _count = 0
    _signal = getattr(signal, "SIG" + os.environ.get(SIGNAL_VAR, "KILL").upper())


# A function called at every hit instead of the environment's target (`rollkeep simulate`
# raises its simulated crash from it); None = the environment decides.
_handler = None


def set_handler(handler) -> None:
    """Route every `hit(name)` to `handler(name)` (None restores the environment's rule)."""
    global _handler
    _handler = handler


def hit(name: str) -> None:
    """Kill this process with SIGKILL if `name` is the configured crash point and this is
    its n-th hit; otherwise do nothing."""
    global _count
    if _handler is not None:
        _handler(name)
        return
    if _target is None or name != _target[0]:
        return
    _count += 1
    if _count == _target[1]:
        os.kill(os.getpid(), _signal)


# The checkpoint publication protocol (rollkeep.core.checkpoint.store), in the order they are hit.
PUBLISH_FILE_WRITTEN = register("publish.file_written")
PUBLISH_MANIFEST_WRITTEN = register("publish.manifest_written")
PUBLISH_DIR_RENAMED = register("publish.dir_renamed")
PUBLISH_LATEST_WRITTEN = register("publish.latest_written")
PUBLISH_LATEST_REPLACED = register("publish.latest_replaced")
PUBLISH_RETENTION = register("publish.retention")

PUBLISH_POINTS: tuple[str, ...] = (
    PUBLISH_FILE_WRITTEN,
    PUBLISH_MANIFEST_WRITTEN,
    PUBLISH_DIR_RENAMED,
    PUBLISH_LATEST_WRITTEN,
    PUBLISH_LATEST_REPLACED,
    PUBLISH_RETENTION,
)

_reload_from_env()

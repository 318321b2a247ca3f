"""The run directory: one writer at a time, and where a run starts.

`RunDir` takes the directory's lock before anything is written (the warm start included)
and releases it however the run ends. `start_point` decides which checkpoint a run
restores, and refuses to start over durable work:

    --resume-from NAME given   that checkpoint (it must exist; the restore chain checks it)
    LATEST names a checkpoint  that one
    no LATEST, step_* present  refused: a missing LATEST is never a fresh start (unless the
                               trace shows none was ever published: a crash inside the
                               first publication, before its commit point)
    no checkpoint at all, but
      the trace records one    refused: checkpoints were published and are gone
    otherwise                  a fresh run
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Callable
from pathlib import Path

from ..core.errors import CheckpointNotFound, FilesystemError, UserInputError
from ..core.fs import FS
from ..core.store import CheckpointStore
from ..core.trace_schema import CHECKPOINT_PUBLISHED
from ..trace import scan_trace

_PUBLISHED = b'"event":"%s"' % CHECKPOINT_PUBLISHED.encode()


class RunDir:
    """Context manager: create `path` if needed and hold an exclusive flock on the
    directory itself (no file is created; the kernel drops the lock when the process dies,
    however it dies)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd = -1

    def __enter__(self) -> RunDir:
        path = self.path
        if path.exists() and not path.is_dir():
            raise UserInputError(
                f"run_dir {path} is not a directory",
                path=str(path),
                field="run_dir",
                expected="a directory (or a path that does not exist yet)",
                found="a file" if path.is_file() else "something that is not a directory",
                remedy="point run_dir at a directory, e.g. run_dir=runs/my-run",
            )
        try:
            path.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            _fsync_dir(path.resolve().parent)  # the run directory's name is durable too
        except NotADirectoryError as e:  # a parent is a file
            raise UserInputError(
                f"run_dir {path} cannot be created: a parent is not a directory",
                path=str(path),
                field="run_dir",
                expected="a path whose parents are directories",
                found=str(e),
                remedy="point run_dir somewhere else",
            ) from None
        except OSError as e:
            raise FilesystemError.of(e, "creating the run directory", path) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._fd)
            self._fd = -1
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise FilesystemError.of(e, "locking the run directory", path) from None
            raise UserInputError(
                f"another process is running in {path}",
                path=str(path),
                expected="one `rollkeep train` per run_dir",
                found="the run directory is locked",
                remedy="wait for it to finish or stop it (Ctrl-C, or kill: a killed run resumes "
                "losslessly), or use another run_dir",
            ) from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the flock
            self._fd = -1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def start_point(
    store: CheckpointStore, resume_from: str | None, *, published: Callable[[], int | None]
) -> str | None:
    """The checkpoint a run restores, or None for a fresh run (see the module docstring).
    `published()` counts the publications the run's trace records (None: there is no
    trace); it is called only when LATEST is missing. Reads only; raises UserInputError
    (an unknown `resume_from`) or CheckpointNotFound."""
    names = store.list()
    if resume_from is not None:
        if resume_from not in names:
            raise UserInputError(
                f"--resume-from {resume_from}: no such checkpoint in {store.root}",
                path=str(store.root / resume_from),
                expected="the name of a checkpoint directory of this run",
                found="checkpoints present: " + (", ".join(names) or "none"),
                remedy="pick one of the names listed (`rollkeep inspect RUN_DIR` shows what each holds)",
            )
        return resume_from
    latest = store.latest()  # a malformed LATEST raises CheckpointNotFound
    if latest is not None:
        return latest
    traced = published()
    # A crash between the first publication's rename and its LATEST (store steps P6-P8)
    # leaves a complete step_* directory that was never published: the trace then records
    # no publication, and the run starts fresh (the store sets the leftover aside when it
    # publishes that step again). Anything else without LATEST means something was removed.
    if names and (traced is None or traced > 0):
        raise CheckpointNotFound(
            "LATEST is missing while checkpoint directories exist: starting over would "
            "retrain over their work, so the run is refused",
            path=str(store.root / "LATEST"),
            expected="a LATEST file naming the newest checkpoint",
            found=f"no LATEST; checkpoint directories present: {', '.join(names)}",
            remedy=f"resume from one on purpose with `rollkeep train ... --resume-from {names[-1]}` "
            "(the restore chain checks it first), or start over in a new run_dir",
        )
    if traced and not names:
        raise CheckpointNotFound(
            "the trace records published checkpoints, but none is left: starting over "
            "would retrain over durable work, so the run is refused",
            path=str(store.root),
            expected="the checkpoints the trace records",
            found=f"{traced} checkpoint_published event(s) in the trace; no checkpoint directory",
            remedy="put the checkpoints directory back, or start over in a new run_dir",
        )
    return None


def published_in_trace(trace_path: Path, *, fs: FS | None = None) -> int | None:
    """How many `checkpoint_published` lines the trace holds (None without a trace). A byte
    search, not a parse: only a run directory without LATEST pays for it. `fs`: read
    through that filesystem seam (the simulation's disk) instead of the real one."""

    def count(m: mmap.mmap | bytes | None) -> int:
        n, at = 0, -1 if m is None else m.find(_PUBLISHED)
        while at >= 0:
            n += 1
            at = m.find(_PUBLISHED, at + 1)
        return n

    return scan_trace(trace_path, count, fs=fs)

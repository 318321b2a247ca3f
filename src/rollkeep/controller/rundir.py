"""The run directory: one writer at a time.

`RunDir` takes the directory's lock before anything is written (the warm start included)
and releases it however the run ends. Which checkpoint a run restores is the core's
(`rollkeep.core.restore.start.start_point`).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from ..core.errors import FilesystemError, UserInputError


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

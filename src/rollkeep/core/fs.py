"""The filesystem seam: every call the checkpoint store makes, reading and writing.

`FS` does the real system calls. Tests substitute a subclass that fails the n-th call of a
kind, and `rollkeep simulate` substitutes an in-memory filesystem (`rollkeep.simulate.memfs`)
that can fail or tear any write, fsync or rename and forgets what was never fsynced when
the simulated machine loses power. Reads go through the same seam so a simulated restore
sees exactly the simulated disk.

Reading never blocks and never follows a symlink where a file is expected (see
`rollkeep.core.untrusted`): a FIFO or a device is refused with OSError.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from .untrusted import hash_regular, read_prefix, read_regular

# What `kind_of` reports for a path.
FILE, DIR, SYMLINK, OTHER = "file", "dir", "symlink", "other"


class FS:
    # -- writing ---------------------------------------------------------------------

    def mkdir(self, path: Path) -> None:
        os.mkdir(path, 0o755)

    def write(self, path: Path, data: bytes | bytearray | memoryview) -> None:
        """Create `path` (it must not exist) and write all of `data`; no fsync."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def fsync(self, path: Path) -> None:
        """fsync a file or a directory by path."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def rmtree(self, path: Path) -> None:
        shutil.rmtree(path)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    # -- reading ---------------------------------------------------------------------

    def kind_of(self, path: Path) -> str | None:
        """FILE, DIR, SYMLINK or OTHER for what is at `path` (not following a symlink),
        None if nothing is."""
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(mode):
            return SYMLINK
        if stat.S_ISDIR(mode):
            return DIR
        return FILE if stat.S_ISREG(mode) else OTHER

    def describe(self, path: Path) -> str:
        """What is at `path`, for an error message (e.g. "drwxr-xr-x")."""
        try:
            return stat.filemode(os.lstat(path).st_mode)
        except OSError as e:
            return e.strerror or str(e)

    def listdir(self, path: Path) -> list[tuple[str, str]]:
        """(name, kind) of each entry of the directory `path`, sorted by name; OSError if
        it cannot be listed (FileNotFoundError if it does not exist)."""
        out = []
        with os.scandir(path) as it:
            for e in it:
                if e.is_symlink():
                    kind = SYMLINK
                elif e.is_dir(follow_symlinks=False):
                    kind = DIR
                else:
                    kind = FILE if e.is_file(follow_symlinks=False) else OTHER
                out.append((e.name, kind))
        return sorted(out)

    def read(self, path: Path) -> bytes:
        """The bytes of the regular file at `path` (OSError for anything else)."""
        return read_regular(path)

    def read_prefix(self, path: Path, n: int) -> bytes:
        """At most the first `n` bytes of the regular file at `path`."""
        return read_prefix(path, n)

    def hash(self, path: Path) -> tuple[int, str]:
        """(size, sha256 hex) of the regular file at `path`, streaming."""
        return hash_regular(path)


DEFAULT_FS = FS()

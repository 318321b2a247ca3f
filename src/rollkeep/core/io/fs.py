"""The filesystem seam: every call the checkpoint store and the trace make, reading and
writing.

`FS` does the real system calls. Tests substitute a subclass that fails the n-th call of a
kind, and `rollkeep simulate` substitutes an in-memory filesystem (`rollkeep.simulate.memfs`)
that can fail or tear any write, fsync or rename and forgets what was never fsynced when
the simulated machine loses power. Reads go through the same seam so a simulated restore
sees exactly the simulated disk.

Files written whole (the store's) are `write` + `fsync` by path; a file that only grows
(the trace, later the journal) is an `AppendFile` from `open_append`, kept open by its
writer. The handle has no buffer of its own: `write` hands the bytes to the OS (its page
cache, which survives the death of the process), `fsync` makes them durable (they survive
the machine's). A writer that batches its records keeps its own buffer (`rollkeep.trace`).

Reading never blocks and never follows a symlink where a file is expected (see
`rollkeep.core.io.untrusted`): a FIFO or a device is refused with OSError; so is opening one
to append to.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Protocol

from .untrusted import hash_regular, open_append_fd, open_regular, read_prefix, read_regular

# What `kind_of` reports for a path.
FILE, DIR, SYMLINK, OTHER = "file", "dir", "symlink", "other"


class AppendFile(Protocol):
    """An open file that only grows, from `FS.open_append`. Every call raises OSError on
    failure (ENOSPC, EIO, ...); a failed `write` may have appended a prefix of its bytes."""

    def write(self, data: bytes) -> None:
        """Append all of `data` (to the OS: it survives a killed process, not a power cut)."""

    def fsync(self) -> None:
        """Make every byte written so far durable. Touches nothing but the open file, so it
        may run on another thread than the writes (those that returned before it count)."""

    def tail(self, n: int) -> bytes:
        """The last `n` bytes of the file (fewer if it is shorter)."""

    def still_at(self, path: Path) -> bool:
        """The open file is still the one named `path`: it was not unlinked, renamed or
        replaced, nor its directory removed (writes to an unlinked file succeed and are
        lost with the descriptor, so a writer that must stay readable asks)."""

    def close(self) -> None:
        """Close the file (again: nothing)."""


class OSAppendFile:
    """`AppendFile` over a descriptor opened O_APPEND (`untrusted.open_append_fd`)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def fsync(self) -> None:
        os.fsync(self._fd)

    def tail(self, n: int) -> bytes:
        size = os.fstat(self._fd).st_size
        n = min(n, size)
        return os.pread(self._fd, n, size - n) if n > 0 else b""

    def still_at(self, path: Path) -> bool:
        st = os.fstat(self._fd)
        try:
            named = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return st.st_nlink > 0 and (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino)

    def close(self) -> None:
        fd, self._fd = self._fd, -1  # a later call fails with EBADF, never on a reused number's file
        if fd >= 0:
            os.close(fd)


class FS:
    # -- writing ---------------------------------------------------------------------

    def mkdir(self, path: Path) -> None:
        os.mkdir(path, 0o755)

    def makedirs(self, path: Path) -> None:
        """Create the directory `path` and any missing parents; nothing if it exists (a
        symlink to a directory counts). Built on `kind_of` and `mkdir`, so a subclass gets
        it right for free."""
        path = Path(path)
        if self.kind_of(path) is None:
            if path.parent != path:
                self.makedirs(path.parent)
            with contextlib.suppress(FileExistsError):  # made meanwhile by someone else
                self.mkdir(path)

    def open_append(self, path: Path) -> AppendFile:
        """The regular file at `path`, created if missing, open for appending. A FIFO is
        refused at once (never waited on), and so is a symlink (a planted link cannot
        redirect the writes) and anything else that is not a regular file: OSError."""
        return OSAppendFile(open_append_fd(path))

    def write(self, path: Path, data: bytes | bytearray | memoryview) -> None:
        """Create `path` (it must not exist) and write all of `data`; no fsync."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def check_writable(self, path: Path) -> None:
        """OSError unless a file can be created in the directory `path` now (a read-only
        mount, missing permissions, an immutable directory). Creates an unnamed file
        (O_TMPFILE), so nothing is left behind even if the process dies here; where the
        filesystem has no unnamed files, asks access(2), which also sees a read-only
        mount (root included) but not every refusal a server may make."""
        try:
            fd = os.open(path, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            if not os.access(path, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
                raise OSError(errno.EACCES, "Permission denied (no write access)", str(path)) from None
        else:
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

    def read_range(self, path: Path, offset: int, n: int) -> bytes:
        """The `n` bytes of the regular file at `path` from `offset` (fewer only at the end
        of the file). Like `read`: no symlink, never blocks on a FIFO."""
        if offset < 0 or n < 0:
            raise ValueError(f"read_range needs offset >= 0 and n >= 0, got {offset}, {n}")
        fd = open_regular(path)
        try:
            chunks, pos, left = [], offset, n
            while left > 0 and (chunk := os.pread(fd, left, pos)):
                chunks.append(chunk)
                pos += len(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def hash(self, path: Path) -> tuple[int, str]:
        """(size, sha256 hex) of the regular file at `path`, streaming."""
        return hash_regular(path)


DEFAULT_FS = FS()

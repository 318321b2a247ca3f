"""An in-memory filesystem for the simulation: what the store sees, what survives a crash.

It implements the store's filesystem seam (`rollkeep.core.io.fs.FS`) over inodes, keeping
for each file the bytes last made durable by an fsync and for each directory the entries
last made durable by an fsync of it, beside what the page cache holds now:

- `kill()` (SIGKILL, preemption): the page cache survives; nothing changes.
- `power_cut(rng)`: what was never fsynced is lost. Every directory goes back to its
  durable entries (a rename is in the old name or the new one, never both, never neither,
  as assumption A1 of the store says); every file goes back to its durable bytes plus a
  random prefix of what was written after them (a torn write; for a file appended to, such
  as the trace, a torn last line).
- faults: with `fault_rate`, a write, fsync or rename raises OSError (ENOSPC or EIO), and
  so does an append or an fsync through an open file (`open_append`); a failed write may
  have written a prefix first.
- `freeze()`: the simulated process is dead. Every later call raises `SimCrash`, so the
  `except BaseException` clean-up paths of the store cannot run, exactly as under SIGKILL.
"""

from __future__ import annotations

import errno
import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path

from ..core.io.fs import DIR, FILE, FS, AppendFile


class SimCrash(BaseException):
    """The simulated process dies here (a BaseException: no `except Exception` catches it)."""


@dataclass
class _Inode:
    kind: str  # FILE or DIR
    data: bytearray = field(default_factory=bytearray)
    synced: bytes | None = None  # file bytes as of the last fsync (None: never)
    entries: dict[str, int] = field(default_factory=dict)  # dir: name -> inode
    synced_entries: dict[str, int] = field(default_factory=dict)


class MemFS(FS):
    def __init__(self, rng: random.Random, *, fault_rate: float = 0.0, max_faults: int = 0) -> None:
        self.rng = rng
        self.fault_rate, self.faults_left = fault_rate, max_faults
        self.faults = 0  # injected so far
        self.frozen: SimCrash | None = None  # the crash that killed the simulated process
        self._inodes: dict[int, _Inode] = {1: _Inode(DIR)}
        self._next = 2

    # -- the simulated machine ------------------------------------------------------

    def freeze(self, crash: SimCrash) -> None:
        """The process dies of `crash`: every later call raises it again."""
        self.frozen = crash

    def kill(self) -> None:
        """The process died; the kernel (and its page cache) lives on."""
        self.frozen = None

    def power_cut(self) -> None:
        """The machine lost power: only what was fsynced survives."""
        self.frozen = None
        for node in self._inodes.values():
            if node.kind == DIR:
                node.entries = dict(node.synced_entries)
                continue
            durable = node.synced or b""
            if len(node.data) > len(durable) and node.data.startswith(durable):
                # what came after the durable bytes is torn to a random prefix, possibly empty
                node.data = node.data[: self.rng.randint(len(durable), len(node.data))]
            else:
                node.data = bytearray(durable)

    def makedirs_durable(self, path: Path) -> None:
        """Create `path` and its parents, durably (what existed before the simulation)."""
        node = self._inodes[1]
        for part in Path(path).parts[1:]:
            if part not in node.entries:
                node.entries[part] = self._new(DIR)
                node.synced_entries = dict(node.entries)
            node = self._inodes[node.entries[part]]

    def _fault(self, what: str, path: Path) -> None:
        if self.faults_left > 0 and self.rng.random() < self.fault_rate:
            self.faults_left -= 1
            self.faults += 1
            code = errno.ENOSPC if what == "write" else errno.EIO
            raise OSError(code, f"simulated {what} failure", str(path))

    # -- paths ----------------------------------------------------------------------

    def _alive(self) -> None:
        if self.frozen is not None:
            raise self.frozen

    def _lookup(self, path: Path) -> _Inode | None:
        node = self._inodes[1]
        for part in Path(path).parts[1:]:
            if node.kind != DIR or part not in node.entries:
                return None
            node = self._inodes[node.entries[part]]
        return node

    def _parent(self, path: Path) -> tuple[_Inode, str]:
        path = Path(path)
        parent = self._lookup(path.parent)
        if parent is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path.parent))
        if parent.kind != DIR:
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(path.parent))
        return parent, path.name

    def _new(self, kind: str) -> int:
        ino, self._next = self._next, self._next + 1
        self._inodes[ino] = _Inode(kind)
        return ino

    def _get(self, path: Path, kind: str | None = None) -> _Inode:
        node = self._lookup(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        if kind == FILE and node.kind != FILE:
            raise OSError(errno.EISDIR, "is a directory, not a regular file", str(path))
        if kind == DIR and node.kind != DIR:
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(path))
        return node

    # -- writing --------------------------------------------------------------------

    def mkdir(self, path: Path) -> None:
        self._alive()
        parent, name = self._parent(path)
        if name in parent.entries:
            raise FileExistsError(errno.EEXIST, "File exists", str(path))
        parent.entries[name] = self._new(DIR)

    def write(self, path: Path, data: bytes | bytearray | memoryview) -> None:
        self._alive()
        parent, name = self._parent(path)
        if name in parent.entries:
            raise FileExistsError(errno.EEXIST, "File exists", str(path))
        ino = parent.entries[name] = self._new(FILE)
        data = bytes(memoryview(data).cast("B"))
        try:
            self._fault("write", path)
        except OSError:
            self._inodes[ino].data = bytearray(data[: self.rng.randint(0, len(data))])
            raise
        self._inodes[ino].data = bytearray(data)

    def fsync(self, path: Path) -> None:
        self._alive()
        node = self._get(path)
        self._fault("fsync", path)  # fsyncgate: the data may or may not be durable now
        if node.kind == DIR:
            node.synced_entries = dict(node.entries)
        else:
            node.synced = bytes(node.data)

    def open_append(self, path: Path) -> AppendFile:
        self._alive()
        parent, name = self._parent(path)
        if name not in parent.entries:
            parent.entries[name] = self._new(FILE)
        node = self._inodes[parent.entries[name]]
        if node.kind != FILE:
            raise OSError(errno.EISDIR, "is a directory, not a regular file", str(path))
        return _MemAppendFile(self, node, Path(path))

    def rename(self, src: Path, dst: Path) -> None:
        self._alive()
        sp, sname = self._parent(src)
        if sname not in sp.entries:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(src))
        dp, dname = self._parent(dst)
        self._fault("rename", src)
        moving = self._inodes[sp.entries[sname]]
        if dname in dp.entries:
            target = self._inodes[dp.entries[dname]]
            if target.kind == DIR and (moving.kind != DIR or target.entries):
                raise OSError(errno.ENOTEMPTY, "Directory not empty", str(dst))
        dp.entries[dname] = sp.entries.pop(sname)

    def rmtree(self, path: Path) -> None:
        self._alive()
        parent, name = self._parent(path)
        if name not in parent.entries:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        del parent.entries[name]

    def unlink(self, path: Path) -> None:
        self._alive()
        parent, name = self._parent(path)
        if name not in parent.entries:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        if self._inodes[parent.entries[name]].kind == DIR:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        del parent.entries[name]

    # -- reading --------------------------------------------------------------------

    def check_writable(self, path: Path) -> None:
        self._alive()
        self._get(path, DIR)  # the simulated disk has no permissions or read-only mounts

    def kind_of(self, path: Path) -> str | None:
        self._alive()
        node = self._lookup(path)
        return None if node is None else node.kind

    def describe(self, path: Path) -> str:
        return self.kind_of(path) or "No such file or directory"

    def listdir(self, path: Path) -> list[tuple[str, str]]:
        self._alive()
        node = self._get(path, DIR)
        return sorted((name, self._inodes[ino].kind) for name, ino in node.entries.items())

    def read(self, path: Path) -> bytes:
        self._alive()
        return bytes(self._get(path, FILE).data)

    def read_prefix(self, path: Path, n: int) -> bytes:
        return self.read(path)[:n]

    def read_range(self, path: Path, offset: int, n: int) -> bytes:
        self._alive()
        if offset < 0 or n < 0:
            raise ValueError(f"read_range needs offset >= 0 and n >= 0, got {offset}, {n}")
        return bytes(self._get(path, FILE).data[offset : offset + n])

    def hash(self, path: Path) -> tuple[int, str]:
        data = self.read(path)
        return len(data), hashlib.sha256(data).hexdigest()


class _MemAppendFile:
    """`AppendFile` over an inode (like a descriptor: a rename or unlink does not move it).
    A write lands in the page cache (it survives `kill`), an fsync makes it durable."""

    def __init__(self, fs: MemFS, node: _Inode, path: Path) -> None:
        self._fs, self._node, self._path = fs, node, path
        self._closed = False

    def _open(self) -> None:
        self._fs._alive()
        if self._closed:
            raise OSError(errno.EBADF, "Bad file descriptor", str(self._path))

    def write(self, data: bytes) -> None:
        self._open()
        try:
            self._fs._fault("write", self._path)
        except OSError:
            self._node.data += data[: self._fs.rng.randint(0, len(data))]
            raise
        self._node.data += data

    def fsync(self) -> None:
        self._open()
        self._fs._fault("fsync", self._path)  # as `MemFS.fsync`: nothing more is durable
        self._node.synced = bytes(self._node.data)

    def tail(self, n: int) -> bytes:
        self._open()
        return bytes(self._node.data[-n:]) if n > 0 else b""

    def still_at(self, path: Path) -> bool:
        self._open()
        return self._fs._lookup(path) is self._node

    def close(self) -> None:
        self._fs._alive()
        self._closed = True

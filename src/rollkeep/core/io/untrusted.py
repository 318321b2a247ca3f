"""Reading what the disk hands us, without trusting it.

Every file rollkeep reads back (checkpoint files, LATEST, datasets, the trace) may have been
replaced by something hostile or broken. Two classes of input used to hang or crash:

- **Special files.** Opening a FIFO for reading blocks until a writer appears, so a FIFO at
  LATEST hung `train`, `audit` and `inspect` forever; a device never ends. `open_regular`
  opens with O_NONBLOCK (a FIFO opens at once, with no writer) and checks the type with
  fstat on the open descriptor, so nothing blocks and there is no window between the check
  and the use. Symlinks are refused unless the caller follows them on purpose.
- **Deep nesting.** JSON nested 100,000 levels deep makes Python's parser (and msgspec's)
  raise RecursionError. `loads_json` turns that, like every other parse problem, into a
  ValueError the caller reports as a refused input.

Errors are plain OSError / ValueError: each caller knows which error class and remedy fit
its file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20

__all__ = [
    "hash_regular",
    "loads_json",
    "end_torn_line",
    "open_append",
    "open_append_fd",
    "open_regular",
    "read_prefix",
    "read_regular",
    "safetensors_header",
]


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symlink"
    return f"not a regular file ({stat.filemode(mode)})"


def _open_checked(path: str | Path, flags: int) -> int:
    """A descriptor of the regular file at `path`, opened with `flags` plus O_NONBLOCK (so
    opening a FIFO returns at once), its type checked on the descriptor itself."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP and flags & os.O_NOFOLLOW:
            raise OSError(errno.ELOOP, "is a symlink (only regular files are used)", str(path)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"is {_kind(mode)}, not a regular file", str(path))
        os.set_blocking(fd, True)  # regular files ignore O_NONBLOCK; clear it for tidiness
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | Path, *, follow_symlinks: bool = False) -> int:
    """A read-only descriptor of the regular file at `path`; OSError for anything else.
    Never blocks; without `follow_symlinks` a symlink is refused (ELOOP)."""
    return _open_checked(path, os.O_RDONLY | (0 if follow_symlinks else os.O_NOFOLLOW))


def read_regular(path: str | Path, *, follow_symlinks: bool = False) -> bytes:
    """The bytes of a regular file (see `open_regular`)."""
    fd = open_regular(path, follow_symlinks=follow_symlinks)
    try:
        chunks = []
        while chunk := os.read(fd, _CHUNK):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_prefix(path: str | Path, n: int) -> bytes:
    """At most the first `n` bytes of a regular file (no symlinks)."""
    fd = open_regular(path)
    try:
        chunks, left = [], n
        while left > 0 and (chunk := os.read(fd, min(left, _CHUNK))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def hash_regular(path: str | Path) -> tuple[int, str]:
    """(size, sha256 hex) of a regular file, streaming (no symlinks)."""
    fd = open_regular(path)
    try:
        h = hashlib.sha256()
        size = 0
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
            size += len(chunk)
        return size, h.hexdigest()
    finally:
        os.close(fd)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads_json(raw: bytes | str, *, strict: bool = True) -> Any:
    """JSON with bounded nesting; `strict` also refuses duplicate keys and NaN/Infinity
    (for files we wrote ourselves in bulk, like the trace, `strict=False` is 2-3x faster).

    Raises ValueError for every problem (UnicodeDecodeError and JSONDecodeError are
    ValueErrors; too deep a nesting becomes one too)."""
    text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
    try:
        if not strict:
            return json.loads(text)
        return json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None


SAFETENSORS_MAX_HEADER = 100 << 20  # the safetensors format's own limit on its header


def safetensors_header(data: bytes | memoryview, size: int | None = None) -> dict[str, Any]:
    """The JSON header of a safetensors file from its first bytes `data` (the whole file,
    or at least 8 + header length of it); `size` is the file's size if `data` is a prefix.
    ValueError if there is no well-formed header."""
    size = len(data) if size is None else size
    if len(data) < 8:
        raise ValueError(f"{size} bytes: too short for a safetensors header length")
    n = int.from_bytes(bytes(data[:8]), "little")
    if n < 2 or n > SAFETENSORS_MAX_HEADER or 8 + n > size:
        raise ValueError(f"a header length of {n} in a file of {size} bytes")
    if 8 + n > len(data):
        raise ValueError(f"the header ({n} bytes) was not read whole")
    header = loads_json(data[8 : 8 + n])
    if not isinstance(header, dict):
        raise ValueError(f"a JSON header of type {type(header).__name__}")
    return header


def end_torn_line(f: Any) -> None:
    """If the file (open for appending, from `open_append`) ends in the middle of a line --
    a writer killed mid-write -- end that line, so the next one starts on its own."""
    size = os.fstat(f.fileno()).st_size
    if size > 0 and os.pread(f.fileno(), 1, size - 1) != b"\n":
        f.write(b"\n")


def open_append_fd(path: str | Path) -> int:
    """A descriptor of the regular file at `path` (created if missing) open for appending,
    also readable with `os.pread` (to check for a torn last line). Never blocks on a FIFO
    and refuses a symlink, so a planted link cannot redirect our writes."""
    return _open_checked(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW)


def open_append(path: str | Path) -> Any:
    """A binary append-mode file object over `open_append_fd(path)`."""
    fd = open_append_fd(path)
    try:
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise

"""Durable row segments: sealed rows in fsynced, checksummed, immutable files (design §9).

A sealed row is appended here no later than the journal flush that makes its `sealed` event
durable, and the journal's record of the seal carries the row's `RowLocation`. Checkpoints
then stop copying rows: they name the segments their rows live in, and a restore reads back
only the rows it needs, one frame each, by location.

Format
------
`RUN_DIR/rows/<n:08d>.rows`, segment numbers counting up from 0. A segment is a sequence of
frames, all integers little-endian:

    frame    = u32 payload length | u64 xxh3_64(payload) | payload
    frame 0  = the header: msgpack [b"rollkeep-rows", 1 (format version), n (segment number)]
    frame i  = one row: msgpack [group_id, generation, attempt, reward (f64), finish_reason,
               prompt_ids, completion_ids, logprobs, versions]  (arrays as raw LE bytes:
               int32, int32, float32, int32)

One small msgpack array per row, not the rows.safetensors codec: that codec is built for
many rows at once (a JSON header, offset arrays), so a one-row file would be a ~500-byte
JSON header parsed per read; a row here costs 12 + ~40 bytes beyond its arrays and decodes
in one msgspec call plus four zero-copy `np.frombuffer` views. Decoding is as strict as the
rows codec: exact field count and types, non-empty group id, ids in [0, 2**31), a known
finish reason, array byte lengths a multiple of 4, and then `Row.__post_init__` itself
(dtypes, one logprob and one version per completion token, non-negative ids, versions >= ENV_VERSION).

A `RowLocation(segment, offset, length, checksum)` names one frame: it occupies bytes
[offset, offset + length) of the segment and its payload hashes to `checksum`.

The writer, `RowLogWriter`, and its durability contract are `rollkeep.core.rowlog.writer`.

What a read proves
------------------
`RowLogReader.read(row_id, loc)` returns a row only if the segment has a valid header naming
itself, the frame at `loc` has the recorded length and checksum, its payload hashes to that
checksum, decodes strictly, and names `row_id`. So the row's bytes are exactly the bytes
that were appended under that id (up to xxh3_64 collisions, which are not a defence against
someone forging a frame; the manifest's sha256 is). Every failure is a `RowSegmentCorrupt`
(a `RowsMismatch`, restore step 6: exit 3) naming the file, the offset and what was found;
nothing is repaired and no other frame is consulted.

A restore proves nothing about rows it does not read beyond the existence of the segment
files that hold them (and, if checked, their header). A flipped byte in an unread row is
found when that row is read, or by `verify_segment` (`rollkeep audit`), which walks every
frame of a segment.
"""

from __future__ import annotations

import errno
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import numpy as np
import xxhash

from .. import crashpoints
from ..errors import FilesystemError, RowsMismatch
from ..io.fs import DEFAULT_FS, DIR, FILE, FS
from ..rollout.rows import FINISH_REASONS, Row, RowId, check_row_id

# Crash points of a flush (`RowLogWriter.flush`; `rollkeep simulate` kills and power-cuts
# there), registered with the format so they are known wherever the row log is: the rows
# written but not yet fsynced, and fsynced with their segment's name.
ROWLOG_BEFORE_FSYNC = crashpoints.register("rowlog.before_fsync")
ROWLOG_AFTER_FSYNC = crashpoints.register("rowlog.after_fsync")

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "ROWS_DIR",
    "RowLocation",
    "RowLogReader",
    "RowSegmentCorrupt",
    "SegmentCheck",
    "delete_unreferenced",
    "segment_path",
    "segments",
    "verify_segment",
]

ROWS_DIR = "rows"  # RUN_DIR/rows
MAGIC = b"rollkeep-rows"
FORMAT_VERSION = 1
FRAME_HEADER = struct.Struct("<IQ")  # payload length, xxh3_64(payload)
_FH = FRAME_HEADER.size  # 12
_MAX_PAYLOAD = 2**32 - 1
_MAX_HEADER_FRAME = 64  # a header frame is ~30 bytes; read this much to find it
_INT32_MAX = 2**31 - 1
_NAME = re.compile(r"^([0-9]{8,})\.rows$")
_REMEDY = (
    "a row segment is corrupt, truncated or was replaced since it was written; restore "
    "from an older checkpoint (`rollkeep audit` checks every segment), or start the run fresh."
)

_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 - 1
# No writer's segment comes near 2**48 bytes (256 TiB); a larger offset is damage, and
# offset + length then stays far from the uint64 wrap-around and from C longs.
MAX_OFFSET = 2**48


class RowLocation(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, gc=False):
    """Where one row's frame is: bytes [offset, offset + length) of segment `segment`,
    payload hashing to `checksum` (xxh3_64). Encodes as a 4-element msgpack array; decoding
    (inside a journal record or a manifest) refuses negative or out-of-range values.
    Four ints, so never in a reference cycle: untracked by the cyclic collector (`gc=False`),
    which a restore at 100 k groups would otherwise walk 800 k of once more."""

    segment: Annotated[int, msgspec.Meta(ge=0, le=_INT32_MAX)]
    offset: Annotated[int, msgspec.Meta(ge=0, le=MAX_OFFSET)]
    length: Annotated[int, msgspec.Meta(ge=_FH, le=_FH + _MAX_PAYLOAD)]
    checksum: _U64


class _Header(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    magic: bytes
    version: int
    segment: int


class _RowWire(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    group_id: Annotated[str, msgspec.Meta(min_length=1)]
    generation: Annotated[int, msgspec.Meta(ge=0, le=_INT32_MAX)]
    attempt: Annotated[int, msgspec.Meta(ge=0, le=_INT32_MAX)]
    reward: float
    finish_reason: Literal[FINISH_REASONS]  # type: ignore[valid-type]
    prompt_ids: bytes
    completion_ids: bytes
    logprobs: bytes
    versions: bytes


_encode = msgspec.msgpack.Encoder().encode
_decode_row = msgspec.msgpack.Decoder(_RowWire).decode
_decode_header = msgspec.msgpack.Decoder(_Header).decode
_I32, _F32 = np.dtype("<i4"), np.dtype("<f4")


class RowSegmentCorrupt(RowsMismatch):
    """A row segment or one of its frames cannot be trusted (restore step 6, exit 3).
    `segment` and `offset` say where; `path` names the file."""

    def __init__(self, what: str, *, segment: int | None, offset: int | None, **kw) -> None:
        self.segment = segment  # None: the row log's directory itself
        self.offset = offset
        kw.setdefault("remedy", _REMEDY)
        super().__init__(what, **kw)


def segment_path(directory: Path, n: int) -> Path:
    return Path(directory) / f"{n:08d}.rows"


def _frame(payload: bytes) -> tuple[bytes, int]:
    checksum = xxhash.xxh3_64_intdigest(payload)
    return FRAME_HEADER.pack(len(payload), checksum) + payload, checksum


def _header_frame(n: int) -> bytes:
    return _frame(_encode(_Header(MAGIC, FORMAT_VERSION, n)))[0]


def _encode_row(row_id: RowId, row: Row) -> bytes:
    # `.data` is a zero-copy view; astype is a no-op on little-endian machines.
    return _encode(
        _RowWire(
            row_id.group_id,
            row_id.generation,
            row_id.attempt,
            row.reward,
            row.finish_reason,
            row.prompt_ids.astype(_I32, copy=False).data,
            row.completion_ids.astype(_I32, copy=False).data,
            row.logprobs.astype(_F32, copy=False).data,
            row.versions.astype(_I32, copy=False).data,
        )
    )


def _row_of(payload: bytes | memoryview) -> tuple[RowId, Row]:
    """Decode one row payload strictly; ValueError (msgspec.ValidationError is one) says
    what is wrong."""
    try:
        w = _decode_row(payload)
    except msgspec.ValidationError as e:  # "... - at `$[4]`": name the field
        m = re.search(r"`\$\[(\d+)\]", str(e))
        fields = _RowWire.__struct_fields__
        if m and int(m.group(1)) < len(fields):
            raise ValueError(f"{fields[int(m.group(1))]}: {e}") from None
        raise
    arrays = []
    for name, dtype in (
        ("prompt_ids", _I32),
        ("completion_ids", _I32),
        ("logprobs", _F32),
        ("versions", _I32),
    ):
        raw = getattr(w, name)
        if len(raw) % 4:
            raise ValueError(f"{name} has {len(raw)} bytes, not a multiple of 4")
        # A read-only view of immutable bytes: Row keeps it without copying.
        arrays.append(np.frombuffer(raw, dtype).astype(dtype.newbyteorder("="), copy=False))
    row = Row(*arrays, reward=w.reward, finish_reason=w.finish_reason)
    return RowId(w.group_id, w.generation, w.attempt), row


def _check_header(payload: bytes | memoryview, n: int) -> str | None:
    """None if `payload` is the header of segment `n`, else what is wrong with it."""
    try:
        h = _decode_header(payload)
    except msgspec.DecodeError as e:
        return f"a header that does not decode ({e})"
    if h.magic != MAGIC:
        return f"magic {h.magic[:32]!r}, expected {MAGIC!r}"
    if h.version != FORMAT_VERSION:
        return f"format version {h.version}, expected {FORMAT_VERSION} (newer rollkeep?)"
    if h.segment != n:
        return f"a header naming segment {h.segment} (the file was renamed or copied)"
    return None


def _numbers(directory: Path, fs: FS) -> dict[int, str]:
    """Segment number -> kind of entry, for every entry named like a segment."""
    try:
        entries = fs.listdir(Path(directory))
    except FileNotFoundError:
        return {}
    out = {}
    for name, kind in entries:
        m = _NAME.match(name)
        if m and name == f"{int(m.group(1)):08d}.rows":
            out[int(m.group(1))] = kind
    return out


# ---------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------


def _refused_open(e: OSError, seg: int, path: Path, doing: str) -> Exception:
    """The error for an OSError opening or reading a segment."""
    if isinstance(e, FileNotFoundError):
        return RowSegmentCorrupt(
            f"Row segment {seg} is missing",
            segment=seg,
            offset=None,
            path=str(path),
            expected=f"the segment file, {doing}",
            found="no such file",
        )
    if e.errno in (errno.ELOOP, errno.EINVAL, errno.EISDIR):
        return RowSegmentCorrupt(
            f"Row segment {seg} is not a regular file",
            segment=seg,
            offset=None,
            path=str(path),
            expected="a regular file (symlinks and special files are refused)",
            found=e.strerror or str(e),
        )
    return FilesystemError.of(e, f"reading row segment {seg}", path)


class RowLogReader:
    """Reads single rows by location, verifying each (see "What a read proves")."""

    def __init__(self, directory: Path, *, fs: FS = DEFAULT_FS) -> None:
        self.directory = Path(directory)
        self._fs = fs
        self._headers_ok: set[int] = set()

    def _read(self, seg: int, path: Path, offset: int, n: int, doing: str) -> bytes:
        try:
            return self._fs.read_range(path, offset, n)
        except OSError as e:
            raise _refused_open(e, seg, path, doing) from None

    def _check_directory(self) -> None:
        """RUN_DIR/rows is a real directory: a file, a FIFO or a symlink (even to an
        identical directory) there is not the row log a checkpoint names (exit 3)."""
        try:
            kind = self._fs.kind_of(self.directory)
        except OSError as e:
            raise FilesystemError.of(e, "reading the row log", self.directory) from None
        if kind not in (None, DIR):  # (absent: each segment is then missing, and says so)
            raise RowSegmentCorrupt(
                f"{ROWS_DIR}/ is not a directory", segment=None, offset=None, path=str(self.directory),
                expected="the directory of row segments the run wrote (not a symlink)",
                found=self._fs.describe(self.directory),
                remedy="put the run's row log back in place (a checkpoint names rows in it), or restore "
                "from a checkpoint that copies its rows")

    def _check_segment(self, seg: int, path: Path) -> None:
        if seg in self._headers_ok:
            return
        if not self._headers_ok:
            self._check_directory()
        data = self._read(seg, path, 0, _MAX_HEADER_FRAME, "its header")
        problem = None
        if len(data) < _FH:
            problem = f"{len(data)} bytes, too short for a header frame"
        else:
            n, checksum = FRAME_HEADER.unpack_from(data)
            payload = data[_FH : _FH + n]
            if len(payload) != n:
                problem = f"a header frame of {n} bytes in {len(data)} bytes read"
            elif xxhash.xxh3_64_intdigest(payload) != checksum:
                problem = "a header frame whose checksum does not match"
            else:
                problem = _check_header(payload, seg)
        if problem is not None:
            raise RowSegmentCorrupt(
                f"Row segment {seg} has no valid header",
                segment=seg,
                offset=0,
                path=str(path),
                expected=f"a header frame [{MAGIC!r}, {FORMAT_VERSION}, {seg}]",
                found=problem,
            )
        self._headers_ok.add(seg)

    def check_extent(self, seg: int, end: int) -> None:
        """Segment `seg` is a regular file with a valid header naming itself and holds at
        least `end` bytes (the frames someone names there fit in it); else
        RowSegmentCorrupt. Two small reads; the frames themselves are checked when read."""
        path = segment_path(self.directory, seg)
        self._check_segment(seg, path)
        if end > 0 and not self._read(seg, path, end - 1, 1, f"holding frames up to byte {end}"):
            try:
                size = _size(self._fs, path)
            except OSError as e:
                raise _refused_open(e, seg, path, "to size it") from None
            raise RowSegmentCorrupt(
                f"Row segment {seg} is cut short",
                segment=seg,
                offset=size,
                path=str(path),
                expected=f"at least {end} bytes (the end of the last row named in it)",
                found=f"{size} bytes",
            )

    def read(self, row_id: RowId, loc: RowLocation) -> Row:
        """The row appended under `row_id` at `loc`, or RowSegmentCorrupt."""
        rid = check_row_id(row_id)
        if not isinstance(loc, RowLocation):
            raise ValueError(f"RowLogReader.read needs a RowLocation, got {type(loc).__name__}")
        seg, off = loc.segment, loc.offset
        path = segment_path(self.directory, seg)

        def bad(what: str, expected: str, found: str) -> RowSegmentCorrupt:
            return RowSegmentCorrupt(
                f"{what} (row {tuple(rid)}, segment {seg}, offset {off})",
                segment=seg,
                offset=off,
                path=str(path),
                expected=expected,
                found=found,
            )

        self._check_segment(seg, path)
        data = self._read(seg, path, off, loc.length, f"holding row {tuple(rid)}")
        if len(data) < loc.length:
            raise bad(
                "The row frame is cut short",
                f"{loc.length} bytes at offset {off}",
                f"the file ends at byte {off + len(data)}",
            )
        n, checksum = FRAME_HEADER.unpack_from(data)
        if n != loc.length - _FH:
            raise bad(
                "The row frame has the wrong length",
                f"a payload of {loc.length - _FH} bytes",
                f"a frame header saying {n} bytes",
            )
        if checksum != loc.checksum:
            raise bad(
                "The row frame is not the one recorded",
                f"checksum {loc.checksum:#018x}",
                f"a frame with checksum {checksum:#018x}",
            )
        payload = memoryview(data)[_FH:]
        actual = xxhash.xxh3_64_intdigest(payload)
        if actual != checksum:
            raise bad(
                "The row frame's bytes do not match its checksum",
                f"xxh3_64 {checksum:#018x}",
                f"xxh3_64 {actual:#018x} (a changed byte)",
            )
        try:
            found_id, row = _row_of(payload)
        except ValueError as e:
            raise bad("The row frame does not decode", "a well-formed row", str(e)) from None
        if found_id != rid:
            raise bad(
                "The row frame holds another row",
                f"row {tuple(rid)}",
                f"row {tuple(found_id)}",
            )
        return row


# ---------------------------------------------------------------------------------------
# Inspection, audit, retention
# ---------------------------------------------------------------------------------------


def _size(fs: FS, path: Path) -> int:
    """The size of the regular file at `path`. `FS` has no stat, so: one read of 64 KiB,
    then ~2 log2(size) one-byte probes (a file still growing gives some size it had)."""
    first = fs.read_range(path, 0, 1 << 16)
    if len(first) < 1 << 16:
        return len(first)
    lo, hi = 1 << 16, 1 << 17  # size >= lo; find hi with nothing at hi - 1
    while fs.read_range(path, hi - 1, 1):
        lo, hi = hi, hi * 2
    while lo < hi:  # invariant: size >= lo, size < hi
        mid = (lo + hi) // 2
        if fs.read_range(path, mid, 1):
            lo = mid + 1
        else:
            hi = mid
    return lo


def segments(directory: Path, fs: FS = DEFAULT_FS) -> list[tuple[int, int]]:
    """(segment number, size in bytes) of every segment in `directory`, in order. A
    non-regular file (FIFO, symlink, directory) named like a segment is refused."""
    directory = Path(directory)
    try:
        numbers = _numbers(directory, fs)
    except OSError as e:
        raise FilesystemError.of(e, "listing the row segments", directory) from None
    out = []
    for n, kind in sorted(numbers.items()):
        path = segment_path(directory, n)
        try:
            if kind != FILE:
                raise OSError(errno.EINVAL, f"is a {kind}", str(path))
            out.append((n, _size(fs, path)))
        except OSError as e:
            raise _refused_open(e, n, path, "listed in the directory") from None
    return out


@dataclass(frozen=True)
class SegmentCheck:
    """What `verify_segment` found in a segment with no corruption before its end.

    rows        row frames that verified and decoded
    valid_end   offset just past the last good frame (the header counts)
    size        the file's size
    torn_bytes  size - valid_end: a torn tail, bytes a crashed writer never fsynced (never
                referenced by a durable journal record, whose rows were flushed first)
    """

    segment: int
    rows: int
    valid_end: int
    size: int

    @property
    def torn_bytes(self) -> int:
        return self.size - self.valid_end


def verify_segment(directory: Path, n: int, fs: FS = DEFAULT_FS) -> SegmentCheck:
    """Walk every frame of segment `n`, checking each checksum and decoding each row.

    A bad frame with no valid frame anywhere after it is a torn tail (reported in the
    result); a bad frame followed by a valid one is corruption: RowSegmentCorrupt naming
    the bad frame's offset. So is a header that verifies but names another segment or
    format. Reads the segment whole: O(segment bytes) time and memory."""
    directory = Path(directory)
    path = segment_path(directory, n)
    try:
        size = _size(fs, path)
        data = memoryview(fs.read_range(path, 0, size))
    except OSError as e:
        raise _refused_open(e, n, path, "to verify") from None

    def frame_at(p: int) -> memoryview | None:
        """The payload of a whole frame at `p` whose checksum matches, else None."""
        if size - p < _FH:
            return None
        length, checksum = FRAME_HEADER.unpack_from(data, p)
        if p + _FH + length > size:
            return None
        payload = data[p + _FH : p + _FH + length]
        return payload if xxhash.xxh3_64_intdigest(payload) == checksum else None

    def corrupt(off: int, expected: str, found: str) -> RowSegmentCorrupt:
        return RowSegmentCorrupt(
            f"Row segment {n} is corrupt at offset {off}",
            segment=n,
            offset=off,
            path=str(path),
            expected=expected,
            found=found,
        )

    off, rows = 0, 0
    while off < size:
        payload = frame_at(off)
        if payload is None:
            break
        if off == 0:
            problem = _check_header(payload, n)
            if problem is not None:
                raise corrupt(0, f"a header frame [{MAGIC!r}, {FORMAT_VERSION}, {n}]", problem)
        else:
            try:
                _row_of(payload)
            except ValueError as e:
                raise corrupt(off, "a well-formed row frame", str(e)) from None
            rows += 1
        off += _FH + len(payload)
    if off < size:
        # Torn or corrupt? A valid frame after the bad one means bytes in the middle changed.
        length = FRAME_HEADER.unpack_from(data, off)[0] if size - off >= _FH else None
        candidates = [off + _FH + length] if length is not None else []
        for p in [*candidates, *range(off + 1, size - _FH + 1)]:
            if p < size and frame_at(p) is not None:
                raise corrupt(
                    off,
                    "a frame whose bytes match its checksum",
                    f"a bad frame, followed by a valid frame at offset {p} (not a torn tail)",
                )
    return SegmentCheck(n, rows, off, size)


def delete_unreferenced(
    directory: Path, referenced: set[int], *, keep_from: int, fs: FS = DEFAULT_FS
) -> list[int]:
    """Delete every segment older than `keep_from` that is not in `referenced`; return the
    numbers deleted, in order.

    `referenced`: the segments any retained checkpoint names. `keep_from`: the writer's
    `segment` as read at the newest retained checkpoint's cut, so the segments holding rows
    sealed after it (referenced only by the journal tail) and the open one are kept."""
    directory = Path(directory)
    try:
        doomed = sorted(n for n in _numbers(directory, fs) if n < keep_from and n not in referenced)
        for n in doomed:
            fs.unlink(segment_path(directory, n))
        if doomed:
            fs.fsync(directory)  # not needed for safety: a lost delete is redone next time
    except OSError as e:
        raise FilesystemError.of(e, "deleting unreferenced row segments", directory) from None
    return doomed

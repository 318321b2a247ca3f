"""The custody journal on disk: records appended to segment files, fsynced by group commit,
read back up to a torn tail (docs/design.md §5.1).

The journal stores opaque byte payloads (the caller puts one msgpack-encoded ledger event
in each) under a sequence number `seq`: 1, 2, 3, ... over the whole run directory, never
reused. This module is pure core: no asyncio, no threads of its own, no torch, and every
file operation goes through the filesystem seam (`rollkeep.core.io.fs`), so the simulation's
in-memory disk can fail, tear and forget any of them.

## Format (all integers little-endian)

    RUN_DIR/journal/<first_seq:020d>.journal     one segment, named by its first record's seq

    segment  = header frame*
    header   = b"rollkeep-journal" (16)  u32 version (=1)  u64 first_seq  u64 xxh3_64(previous 28 bytes)
    frame    = b"\\xc1RKJ" (4)  u64 xxh3_64(rest of frame)  u32 len  u64 seq  payload (len bytes)

The checksum of a frame covers its length, its seq and its payload, so a record is checked
whole and its place in the sequence with it. `len` is at most `MAX_RECORD_BYTES` (64 MiB);
a larger one is damage, never an allocation. The 4-byte frame marker (0xc1 is the one byte
msgpack never uses as a type) lets the reader look for a valid frame after a bad one
without trying every byte offset.

## Writing (`JournalWriter`)

A writer **never appends to a segment that holds a record**: its first flush creates a new
segment whose first_seq is the caller's `next_seq` (the restore knows it:
`summary.last_seq + 1`). A segment left by a crashed writer under that very name that
holds no complete record (an empty file, a torn header, a header with a torn frame) is
replaced; one that holds a record means `next_seq` is wrong and is refused. A writer that
starts past seq 1 with no older segment to show it (a journal set aside, §5.1 of
docs/design.md) puts a segment of just a header at `next_seq` in place before it returns,
atomically (written beside the directory, renamed in), and appends to it: an empty
journal directory under a checkpoint's position is then always damage, never a writer
killed before its first flush. A segment is rotated when the next frame
would take it past `segment_bytes` (a segment holds at least one record, so one larger
record gets a segment of its own).

`append(payload)` assigns the seq and buffers the frame in memory (no IO). `flush()` is the
group commit: for each segment it touches, one `write` of every buffered frame, one `fsync`
of the file, and for a segment it created one `fsync` of the journal directory (so the new
file's name is durable) -- the commit point of those records. A record is durable once a
`flush()` that included it has returned.

**Durability contract.** After a crash (SIGKILL or power cut) the journal holds every
record of every completed flush, in order, and possibly more records of a flush under way,
ending in a torn tail. A failed write or fsync raises OSError and the writer is unusable
from then on (fsync failures leave it unknown what reached the disk: the caller stops and a
restore reads what is there).

**Threads.** `append` runs on the event-loop thread, `flush` on a writer thread. A lock
guards the in-memory buffer and is held only to append a frame or to swap the buffer out,
never across IO; a second lock serializes `flush` and `close` against each other.

## Reading (`JournalReader`, `read_journal`)

The reader yields `(seq, payload)` for every record with seq > `after`, in order, one
segment in memory at a time (a segment is at most `segment_bytes` or one record). Segments
whose records all precede `after` (the next segment starts at or before `after + 1`) are
not read; their headers are checked.

- A **torn tail** -- a partial frame, or a frame that fails its checks, with no valid frame
  after it in that segment -- ends the segment and is not an error: those bytes were never
  durable. The next segment, if any, must start right after the last complete record.
- **Corruption** is refused with `JournalError` (a `CheckpointError`: exit 3), naming the
  file, the byte offset, what was expected and found, and the remedy: a bad frame with a
  valid frame after it in the same segment (a bad record in the middle), a record out of
  sequence, a wrong or (but in the last segment) torn header, a segment that does not
  start right after the one before it, a journal that does not reach back to `after + 1`
  (segments deleted) or that ends before `after`, and any entry of the directory that is
  not a regular file named like a segment (a FIFO or a symlink is refused by its kind from
  the listing, never opened). The writer creates no temporary files, so there are no
  leftovers to tolerate: anything else in the directory was put there by someone else.

Limit of the torn/corrupt rule: the file does not record where its durable part ends, so
a disk that persists the unsynced tail out of order (a hole, then later frames) reads as
corruption, never as silent loss.

**What a read proves.** Every record yielded has the checksum it was written with and the
seq it was given, the records from `after + 1` to `summary.last_seq` are all there and in
order, and whatever follows them in the files is a torn tail. It cannot prove that the tail
is all that was flushed. A directory with no segment is an empty tail only for `after` 0
(retention never deletes the newest segment, so a checkpoint's position always has one to
reach); an absent directory is the caller's to judge (`durable.read_tail` refuses it when
the checkpoint's position is past 0).

A new writer fsyncs the segments before `next_seq` first: what the read before it found
may have been in the page cache only (a killed writer's unsynced tail), and the records it
writes next count on them.

Caller contracts: `next_seq` of a new writer is `summary.last_seq + 1` of the read that
preceded it; a checkpoint whose journal position is P is published only after a flush
returned `>= P` (so the journal always reaches `after`); `delete_covered(P)` is called only
once a published checkpoint covers P.
"""

from __future__ import annotations

import errno
import re
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from .. import crashpoints
from ..errors import CheckpointError, CustodyError
from ..io.fs import DEFAULT_FS, DIR, FILE, FS, SYMLINK, AppendFile

# Crash points of a flush (`rollkeep simulate` kills and power-cuts there; ROLLKEEP_CRASH_AT
# may name them): the records written but not yet fsynced, and fsynced with their name.
JOURNAL_BEFORE_FSYNC = crashpoints.register("journal.before_fsync")
JOURNAL_AFTER_FSYNC = crashpoints.register("journal.after_fsync")

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "MAX_RECORD_BYTES",
    "JournalError",
    "JournalReader",
    "JournalSummary",
    "JournalTail",
    "JournalWriter",
    "TornTail",
    "delete_covered",
    "read_journal",
    "segment_name",
]

MAGIC = b"rollkeep-journal"
FORMAT_VERSION = 1
FRAME_MARKER = b"\xc1RKJ"
_HEAD = struct.Struct("<16sIQ")  # magic, version, first_seq (then the u64 checksum)
HEADER_SIZE = _HEAD.size + 8  # 36
_FRAME = struct.Struct("<4sQIQ")  # marker, checksum, len, seq
_LEN_SEQ = struct.Struct("<IQ")
_U64 = struct.Struct("<Q")
FRAME_OVERHEAD = _FRAME.size  # 24; the checksum covers bytes [12, 24 + len) of the frame
MAX_RECORD_BYTES = 64 << 20
DEFAULT_SEGMENT_BYTES = 64 << 20
MAX_SEGMENT_BYTES = 256 << 20
_MAX_FILE = MAX_SEGMENT_BYTES + HEADER_SIZE + FRAME_OVERHEAD + MAX_RECORD_BYTES
_NAME = re.compile(r"(\d{20})\.journal")

_REMEDY = (
    "restore the journal file from a backup if there is one; otherwise move RUN_DIR/journal "
    "aside and resume from the newest checkpoint alone with journal.enabled=false (what was "
    "generated after that checkpoint is generated again)"
)


class JournalError(CheckpointError):
    """The journal is damaged or does not extend the checkpoint it must extend. `path` is
    the file (or directory), `offset` the byte offset in it (None if not about one place)."""

    def __init__(self, what: str, *, offset: int | None = None, **kw) -> None:
        self.offset = offset
        kw.setdefault("remedy", _REMEDY)
        super().__init__(what, **kw)

    def _paragraph(self) -> str:
        text = super()._paragraph()
        if self.offset is not None and self.path is not None:
            text = text.replace(f"File: {self.path}.", f"File: {self.path}, at byte {self.offset}.", 1)
        return text


def segment_name(first_seq: int) -> str:
    return f"{first_seq:020d}.journal"


def encode_header(first_seq: int) -> bytes:
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, first_seq)
    return head + _U64.pack(xxhash.xxh3_64_intdigest(head))


def encode_frame(seq: int, payload: bytes) -> bytes:
    len_seq = _LEN_SEQ.pack(len(payload), seq)
    h = xxhash.xxh3_64(len_seq)
    h.update(payload)
    return b"".join((FRAME_MARKER, _U64.pack(h.intdigest()), len_seq, payload))


# -- the directory --------------------------------------------------------------------


@dataclass(frozen=True)
class _Segment:
    first_seq: int
    path: Path


def _list_segments(directory: Path, fs: FS, *, strict: bool) -> list[_Segment]:
    """The segments in `directory`, oldest first ([] if it does not exist). `strict`: any
    other entry is refused; otherwise it is ignored (the writer's and deletion's view)."""
    kind = fs.kind_of(directory)
    if kind is None:
        return []
    if kind != DIR:
        raise JournalError(
            "the journal directory is not a directory", path=str(directory),
            expected="a directory (not a symlink)", found=fs.describe(directory),
            remedy="move it aside and run again",
        )
    out = []
    for name, k in fs.listdir(directory):
        m = _NAME.fullmatch(name)
        if m and k == FILE and int(m[1]) >= 1:
            out.append(_Segment(int(m[1]), directory / name))
        elif strict:
            what = {FILE: "a file", DIR: "a directory", SYMLINK: "a symlink"}.get(k, "a special file (FIFO, socket or device)")
            raise JournalError(
                f"the journal directory holds {what} that is not a journal segment",
                path=str(directory / name),
                expected="only regular files named <first seq, 20 digits>.journal",
                found=f"{name!r} ({fs.describe(directory / name)})",
                remedy="move it out of the journal directory (the journal writer creates "
                "nothing else there) and run again",
            )
    return out


# -- reading ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TornTail:
    """The end of a segment that was never durable: `dropped` bytes from `offset`."""

    path: str
    offset: int
    dropped: int


@dataclass
class JournalSummary:
    """What a read found. `last_seq` is the last seq the journal and `after` account for
    (the last complete record, or `after` if the journal holds none after it): a new
    writer starts at `last_seq + 1`. Complete once the records are exhausted."""

    after: int
    last_seq: int
    records: int = 0  # yielded (seq > after)
    segments_read: int = 0
    segments_skipped: int = 0  # all their records precede `after`: only the header checked
    bytes_read: int = 0
    torn: list[TornTail] = field(default_factory=list)
    complete: bool = False

    @property
    def torn_tail(self) -> bool:
        return bool(self.torn)


def _describe_header(raw: bytes) -> str:
    if len(raw) < HEADER_SIZE:
        return f"{len(raw)} bytes, too short for a header ({HEADER_SIZE} bytes)"
    magic, version, first = _HEAD.unpack_from(raw)
    (chk,) = _U64.unpack_from(raw, _HEAD.size)
    ok = chk == xxhash.xxh3_64_intdigest(raw[: _HEAD.size])
    return f"magic {magic!r}, version {version}, first_seq {first}, checksum {'ok' if ok else 'wrong'}"


def _check_header(raw: bytes, seg: _Segment, *, last: bool) -> bool:
    """True if `raw` (the segment's first bytes) starts with the header its name promises;
    False if it is a torn header of the last segment; else JournalError."""
    want = encode_header(seg.first_seq)
    if raw[:HEADER_SIZE] == want:
        return True
    if last and len(raw) < HEADER_SIZE and want.startswith(raw):
        return False
    raise JournalError(
        "a journal segment header is wrong"
        + ("" if last or len(raw) >= HEADER_SIZE else " (torn, and segments follow it)"),
        path=str(seg.path), offset=0,
        expected=f"magic {MAGIC!r}, version {FORMAT_VERSION}, first_seq {seg.first_seq} "
        "(from the file name), a matching checksum",
        found=_describe_header(raw),
    )


def _frame_at(data: bytes, off: int) -> tuple[str | None, int, int]:
    """(problem or None, len, seq) of the frame at `off`; a problem "partial: ..." means
    the file ends inside the frame."""
    size = len(data)
    if size - off < FRAME_OVERHEAD:
        return f"partial: {size - off} bytes, less than a frame header", 0, 0
    marker, chk, n, seq = _FRAME.unpack_from(data, off)
    if marker != FRAME_MARKER:
        return f"a frame marker {marker!r}, not {FRAME_MARKER!r}", n, seq
    if n > MAX_RECORD_BYTES:
        return f"a record length of {n}, above the limit of {MAX_RECORD_BYTES}", n, seq
    if off + FRAME_OVERHEAD + n > size:
        return f"partial: a {n}-byte record with {size - off - FRAME_OVERHEAD} bytes of it present", n, seq
    if xxhash.xxh3_64_intdigest(memoryview(data)[off + 12 : off + FRAME_OVERHEAD + n]) != chk:
        return "a checksum mismatch", n, seq
    return None, n, seq


def _scan(data: bytes, seg: _Segment, *, last: bool) -> tuple[list[tuple[int, int, int]], TornTail | None]:
    """The records of one segment's bytes as (seq, start, end) of their payloads, and its
    torn tail if any. Refuses corruption (JournalError)."""
    if not _check_header(data, seg, last=last):
        return [], TornTail(str(seg.path), 0, len(data))
    out: list[tuple[int, int, int]] = []
    off, expected = HEADER_SIZE, seg.first_seq
    while off < len(data):
        problem, n, seq = _frame_at(data, off)
        if problem is None:
            if seq != expected:
                raise JournalError(
                    "a journal record is out of sequence", path=str(seg.path), offset=off,
                    expected=f"seq {expected}",
                    found=f"seq {seq} ({'a gap' if seq > expected else 'a repeated seq'})",
                )
            out.append((seq, off + FRAME_OVERHEAD, off + FRAME_OVERHEAD + n))
            off += FRAME_OVERHEAD + n
            expected += 1
            continue
        # A bad frame: the torn tail, unless a valid frame follows it in this segment.
        j = data.find(FRAME_MARKER, off + 1)
        while j != -1:
            later_problem, _, later = _frame_at(data, j)
            if later_problem is None:
                raise JournalError(
                    f"a damaged journal record in the middle of a segment, not a torn tail: a valid "
                    f"record (seq {later}) follows it at byte {j}",
                    path=str(seg.path), offset=off,
                    expected=f"record seq {expected} with a matching xxh3 checksum", found=problem,
                )
            j = data.find(FRAME_MARKER, j + 1)
        return out, TornTail(str(seg.path), off, len(data) - off)
    return out, None


class JournalReader:
    """The records of the journal in `directory` with seq > `after`, in order: iterate it
    once for `(seq, payload)` pairs; `summary` says what was found (complete once the
    iteration ends). The segment list is checked when it is made, every segment as it is
    reached; problems raise JournalError (OSError if the disk fails)."""

    def __init__(self, directory: Path | str, *, after: int, fs: FS = DEFAULT_FS) -> None:
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        self.directory, self.after, self._fs = Path(directory), after, fs
        self._segments = _list_segments(self.directory, fs, strict=True)
        self.summary = JournalSummary(after=after, last_seq=after)
        self._started = False

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        if self._started:
            raise RuntimeError("a JournalReader is iterated once")
        self._started = True
        return self._records()

    def _records(self) -> Iterator[tuple[int, bytes]]:
        segs, after, s, fs = self._segments, self.after, self.summary, self._fs
        if not segs:
            if after:  # retention never deletes the newest segment: every one was removed
                raise JournalError(
                    "the journal directory holds no segment, but the checkpoint counts on its records",
                    path=str(self.directory), offset=0,
                    expected=f"segments holding the records through seq {after} (the checkpoint's journal "
                    "position) and any after it", found="an empty journal directory",
                    remedy="the journal's segments were deleted: the work they recorded since the checkpoint "
                    "is lost. Resume from the checkpoint alone with journal.enabled=false (that work is "
                    "generated again), or restore the segments")
            s.complete = True
            return
        start = max((i for i, seg in enumerate(segs) if seg.first_seq <= after + 1), default=None)
        if start is None:
            raise JournalError(
                "the journal does not reach back to the first record it must replay "
                "(older segments were deleted or lost)",
                path=str(segs[0].path), offset=0,
                expected=f"a segment holding seq {after + 1} (the first record after the "
                f"checkpoint's position {after})",
                found=f"the oldest segment starts at seq {segs[0].first_seq}",
            )
        for seg in segs[:start]:
            _check_header(fs.read_prefix(seg.path, HEADER_SIZE), seg, last=False)
            s.segments_skipped += 1
        prev_last: int | None = None
        for i in range(start, len(segs)):
            seg = segs[i]
            if prev_last is not None and seg.first_seq != prev_last + 1:
                raise JournalError(
                    "a journal segment does not start right after the one before it",
                    path=str(seg.path), offset=0,
                    expected=f"first_seq {prev_last + 1} (the previous segment ends at seq {prev_last})",
                    found=f"first_seq {seg.first_seq} "
                    f"({'a gap' if seg.first_seq > prev_last + 1 else 'an overlap'})",
                )
            data = fs.read_prefix(seg.path, _MAX_FILE + 1)
            if len(data) > _MAX_FILE:
                raise JournalError(
                    "a journal segment is larger than any writer writes", path=str(seg.path),
                    expected=f"at most {_MAX_FILE} bytes", found=f"more than {_MAX_FILE} bytes",
                )
            frames, torn = _scan(data, seg, last=i == len(segs) - 1)
            s.segments_read += 1
            s.bytes_read += len(data)
            if torn is not None:
                s.torn.append(torn)
            for seq, a, b in frames:
                if seq > after:
                    s.records += 1
                    s.last_seq = seq
                    yield seq, data[a:b]
            prev_last = seg.first_seq + len(frames) - 1
            del data, frames
        assert prev_last is not None
        if prev_last < after:
            raise JournalError(
                "the journal ends before the position it must extend (records the checkpoint "
                "counts on were never flushed, or were lost)",
                path=str(segs[-1].path),
                expected=f"records through at least seq {after} (the checkpoint's journal position)",
                found=f"the last complete record is seq {prev_last}",
            )
        s.complete = True


@dataclass(frozen=True)
class JournalTail:
    records: list[tuple[int, bytes]]
    summary: JournalSummary


def read_journal(directory: Path | str, *, after: int, fs: FS = DEFAULT_FS) -> JournalTail:
    """Every record with seq > `after`, in memory (see `JournalReader` to stream them)."""
    reader = JournalReader(directory, after=after, fs=fs)
    records = list(reader)
    return JournalTail(records, reader.summary)


# -- retention ---------------------------------------------------------------------------


def delete_covered(directory: Path | str, seq: int, *, fs: FS = DEFAULT_FS) -> list[Path]:
    """Delete every segment all of whose records have seq <= `seq` (the next segment starts
    at or before `seq + 1`), oldest first, then fsync the directory; returns the deleted
    paths. The newest segment is never deleted (a writer's open segment is always the
    newest). Entries that are not segments are left alone (a read refuses them)."""
    directory = Path(directory)
    segs = _list_segments(directory, fs, strict=False)
    deleted = []
    for seg, nxt in zip(segs, segs[1:], strict=False):
        if nxt.first_seq > seq + 1:
            break
        fs.unlink(seg.path)
        deleted.append(seg.path)
    if deleted:
        fs.fsync(directory)
    return deleted


# -- writing -----------------------------------------------------------------------------


class JournalWriter:
    """Appends records to a new segment of the journal in `directory`, starting at seq
    `next_seq` (see the module docstring for the protocol and the threads).

    `append` on one thread (the loop), `flush` on another (the writer's); `close` flushes
    what is buffered and closes the segment. After a failed flush every later call raises
    OSError: the writer is unusable and the caller restores from what is on disk.
    """

    def __init__(self, directory: Path | str, next_seq: int, *, fs: FS = DEFAULT_FS,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        if next_seq < 1:
            raise ValueError(f"next_seq must be >= 1, got {next_seq}")
        if not HEADER_SIZE + FRAME_OVERHEAD < segment_bytes <= MAX_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes must be in ({HEADER_SIZE + FRAME_OVERHEAD}, "
                             f"{MAX_SEGMENT_BYTES}], got {segment_bytes}")
        self.directory, self.segment_bytes, self._fs = Path(directory), segment_bytes, fs
        self._lock = threading.Lock()  # guards _pending, _next_seq, _failed, _closed; never held over IO
        self._io_lock = threading.Lock()  # one flush (or close) at a time
        self._pending: list[bytes] = []  # encoded frames of seqs _next_seq - len(_pending) ..
        self._next_seq = next_seq
        self._durable_seq = next_seq - 1
        self._failed: BaseException | None = None
        self._closed = False
        self._file: AppendFile | None = None
        self._size = self._records = 0  # of the open segment
        self.segment_path: Path | None = None  # the open segment
        self._created: list[tuple[int, Path]] = []  # (first_seq, path) of every segment this writer made
        self._prepare(next_seq)

    def _prepare(self, next_seq: int) -> None:
        fs = self._fs
        if fs.kind_of(self.directory) is None:
            fs.makedirs(self.directory)
        fs.fsync(self.directory.parent)  # even if not new: an earlier process may have died before it
        older = False  # a segment before next_seq shows where the journal goes on
        for seg in _list_segments(self.directory, fs, strict=False):
            if seg.first_seq < next_seq:
                # A killed writer's last records may be in the page cache only, and the
                # restore that chose `next_seq` read (and replayed) them: make them durable
                # before records that follow them are, or a power cut opens a gap.
                fs.fsync(seg.path)
                older = True
                continue
            if seg.first_seq == next_seq:
                frames, _ = _scan(fs.read_prefix(seg.path, _MAX_FILE + 1), seg, last=True)
                if not frames:  # left by a writer that crashed before its first record was durable
                    if older or next_seq == 1:
                        fs.unlink(seg.path)  # made durable by the directory fsync of our first flush
                    continue  # else replaced by `_start_segment`, never unlinked first
            raise CustodyError(
                "a journal writer would reuse sequence numbers", path=str(seg.path),
                expected=f"no journal record at or after seq {next_seq} (the writer's next_seq)",
                found=f"a segment starting at seq {seg.first_seq}",
                remedy="start the writer at summary.last_seq + 1 of a read of the journal",
            )
        if older:  # and the names of those segments: one created by a flush killed before its fsyncs
            fs.fsync(self.directory)  # was read by the restore, and a power cut would lose it
        if not older and next_seq > 1:
            self.segment_path = self._start_segment(next_seq)
            self._file = fs.open_append(self.segment_path)
            self._created.append((next_seq, self.segment_path))
            self._size, self._records = HEADER_SIZE, 0

    def _start_segment(self, next_seq: int) -> Path:
        """The durable segment of just a header at `next_seq` (see the module docstring):
        kept if a killed writer left it, else written beside the directory and renamed in
        over whatever frameless file is there, so no instant has neither."""
        fs, path, header = self._fs, self.directory / segment_name(next_seq), encode_header(next_seq)
        if fs.kind_of(path) == FILE and fs.read_prefix(path, HEADER_SIZE + 1) == header:
            return path
        tmp = self.directory.parent / f".{self.directory.name}-start.tmp"
        if fs.kind_of(tmp) is not None:
            fs.unlink(tmp)  # a writer killed before its rename
        fs.write(tmp, header)
        fs.fsync(tmp)
        fs.rename(tmp, path)
        fs.fsync(self.directory)
        fs.fsync(self.directory.parent)
        return path

    @property
    def durable_seq(self) -> int:
        """The last seq a completed flush made durable (next_seq - 1 before any)."""
        return self._durable_seq

    def _usable(self) -> None:
        if self._failed is not None:
            raise OSError(errno.EIO, f"the journal writer failed earlier and is unusable: {self._failed!r}")
        if self._closed:
            raise ValueError("the journal writer is closed")

    def append(self, payload: bytes) -> int:
        """Buffer one record; returns its seq. No IO: it is durable once a flush returns."""
        if len(payload) > MAX_RECORD_BYTES:
            raise ValueError(f"a journal record of {len(payload)} bytes is above the limit "
                             f"of {MAX_RECORD_BYTES}")
        with self._lock:
            self._usable()
            seq = self._next_seq
            self._pending.append(encode_frame(seq, payload))
            self._next_seq = seq + 1
        return seq

    def flush(self, upto: int | None = None) -> int:
        """Write every buffered record (with `upto`, those with seq <= upto: records that
        depend on something the caller made durable first) and fsync; returns the last
        durable seq."""
        with self._io_lock:
            return self._flush(upto)

    def _flush(self, upto: int | None = None) -> int:
        with self._lock:
            self._usable()
            first = self._next_seq - len(self._pending)
            n = len(self._pending) if upto is None else max(0, min(len(self._pending), upto - first + 1))
            frames, self._pending = self._pending[:n], self._pending[n:]
        if frames:
            try:
                self._write(frames, first)
            except BaseException as e:
                with self._lock:
                    self._failed = e
                raise
        return self._durable_seq

    def _write(self, frames: list[bytes], first: int) -> None:
        i = 0
        while i < len(frames):
            created = self._file is None
            chunk: list[bytes] = []
            if created:
                self.segment_path = self.directory / segment_name(first + i)
                self._file = self._fs.open_append(self.segment_path)
                self._created.append((first + i, self.segment_path))
                chunk.append(encode_header(first + i))
                self._size, self._records = HEADER_SIZE, 0
            assert self._file is not None
            start = i
            # a frame goes in if the segment is empty or it still fits
            while i < len(frames) and (
                self._records == 0 or self._size + len(frames[i]) <= self.segment_bytes
            ):
                chunk.append(frames[i])
                self._size += len(frames[i])
                self._records += 1
                i += 1
            if i > start:
                self._file.write(b"".join(chunk))
                crashpoints.hit(JOURNAL_BEFORE_FSYNC)  # written, in the page cache only
                self._file.fsync()
                if created:
                    self._fs.fsync(self.directory)  # the new segment's name: the commit point
                crashpoints.hit(JOURNAL_AFTER_FSYNC)
                self._durable_seq = first + i - 1
            if i < len(frames):  # full: rotate
                self._file.close()
                self._file = None

    def delete_covered(self, seq: int) -> list[Path]:
        """`delete_covered` for a checkpoint that covers the journal through `seq`, safe
        while this writer's thread may be starting a segment: a segment goes only once
        the one after it holds a durable record. A new segment's file exists before its
        first record is written, so deleting every segment before it and a kill there
        would leave a journal that no longer reaches back to `seq` (the next writer
        removes the empty segment as a crashed writer's). `durable_seq` is read before the
        directory is listed: a segment made after it starts past it."""
        return delete_covered(self.directory, min(seq, self.durable_seq - 1), fs=self._fs)

    def missing(self, after: int) -> Path | None:
        """The first segment this writer made that holds a record after seq `after` and is
        no longer in the journal directory (removed under the live writer, whose writes
        to it then still succeed), or None. Only this writer's segments can hold such a
        record when `after` is a position cut in its process (at or after `next_seq`).
        Stats the open segment through its descriptor (the same file, still linked), the
        others by name."""
        with self._io_lock:
            for i, (_, path) in enumerate(self._created):
                nxt = self._created[i + 1][0] if i + 1 < len(self._created) else None
                if nxt is not None and nxt <= after + 1:
                    continue  # every record of it is at or before `after`
                if path == self.segment_path and self._file is not None:
                    if not self._file.still_at(path):
                        return path
                elif self._fs.kind_of(path) != FILE:
                    return path
            return None

    def close(self, *, flush: bool = True) -> None:
        """Flush what is buffered (unless the writer failed, or with `flush=False`: records
        that depend on something not durable are dropped) and close; again: nothing."""
        with self._io_lock:
            try:
                if flush and not self._closed and self._failed is None:
                    self._flush()
            finally:
                with self._lock:
                    self._closed = True
                if self._file is not None:
                    f, self._file = self._file, None
                    f.close()

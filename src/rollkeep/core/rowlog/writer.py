"""The row log's writer: sealed rows appended to new, fsynced segments (design §9).

The format of a segment, and what reading a row proves, are `rollkeep.core.rowlog.segments`.

Durability contract
-------------------
1. `RowLogWriter.append` encodes the row, fixes its location and buffers the frame; no IO.
2. `flush` writes the buffered frames and fsyncs each segment it wrote to; a segment it
   created has its directory entry fsynced too (after its bytes). When `flush` returns,
   every row appended before it began is durable at its location. That return is the
   commit point: a journal record carrying a location may be flushed only after it.
3. A writer never appends to an existing segment: it starts at max(existing) + 1, and
   creates that file only at its first flush (a run that seals nothing creates none). So
   the bytes a crashed writer left unsynced (a torn tail) are never followed by new rows.
4. A failed `flush` (OSError) leaves the writer unusable: after a failed fsync the kernel
   may have dropped the dirty pages, so nothing written since the previous flush is
   trusted, and nothing is retried on that file. The run stops; the next one starts a new
   segment.
5. Segments are immutable once written and deleted only by `delete_unreferenced`, which
   never touches the writer's open segment or newer ones.

Threading
---------
`append` runs on the event-loop thread and `flush` on a writer thread. They share only the
list of pending frames, swapped under `_lock`; the lock is held for a list append or a swap,
never across encoding or IO, so the loop never waits on the disk. Locations are computed
from counters only `append` touches. `flush` and `close` serialise on a second lock that
`append` never takes.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path

from .. import crashpoints
from ..errors import FilesystemError
from ..io.fs import DEFAULT_FS, FILE, FS, AppendFile
from ..rollout.rows import Row, RowId, check_row_id
from .segments import (
    _MAX_PAYLOAD,
    ROWLOG_AFTER_FSYNC,
    ROWLOG_BEFORE_FSYNC,
    RowLocation,
    _encode_row,
    _frame,
    _header_frame,
    _numbers,
    segment_path,
)

__all__ = ["DEFAULT_SEGMENT_BYTES", "RowLogWriter"]

DEFAULT_SEGMENT_BYTES = 256 << 20


class RowLogWriter:
    """Appends rows to new segments of `directory` (see the module docstring).

    `append` on the loop thread; `flush` on one writer thread (or the same thread);
    `close` once nothing else runs.
    """

    def __init__(
        self, directory: Path, *, fs: FS = DEFAULT_FS, segment_bytes: int = DEFAULT_SEGMENT_BYTES
    ) -> None:
        if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < 1:
            raise ValueError(f"segment_bytes must be a positive int, got {segment_bytes!r}")
        self.directory = Path(directory)
        self._fs = fs
        self._segment_bytes = segment_bytes
        try:
            if fs.kind_of(self.directory) is None:
                fs.makedirs(self.directory)
            # The directory's entry is durable, even if it is not new: an earlier process may
            # have made it and died (or failed this fsync) before its entry was durable, and
            # a power cut would then take it, and every row in it, from under the journal.
            fs.fsync(self.directory.parent)
            existing = _numbers(self.directory, fs)
            # A killed writer's last rows may be in the page cache only, and a restore may
            # have read them (a replayed seal's row): durable before anything that follows.
            for n, kind in sorted(existing.items()):
                if kind == FILE:  # anything else is refused when read, never opened here
                    fs.fsync(segment_path(self.directory, n))
        except OSError as e:
            raise FilesystemError.of(e, "opening the row segments", self.directory) from None
        # -- touched only by append (loop thread) --
        self._segment = max(existing, default=-1) + 1  # where the next row goes
        self._started = False  # has `_segment` had its header buffered?
        self._size = 0  # logical size of `_segment`, buffered bytes included
        self._rows_in_segment = 0
        # -- shared: append adds, flush swaps (under _lock) --
        self._lock = threading.Lock()
        self._pending: list[tuple[int, bytes]] = []  # (segment, frame bytes), in order
        # -- touched only by flush / close (under _io_lock) --
        self._io_lock = threading.Lock()
        self._file: AppendFile | None = None
        self._file_segment = -1
        self._failed: BaseException | None = None
        self._closed = False
        # The segments on disk that checkpoints or the journal may name: those found at
        # open and those made since, less the ones retention deleted (`forget`).
        self._known = {n for n, kind in existing.items() if kind == FILE}

    @property
    def segment(self) -> int:
        """The segment the next row goes to (or a newer one). Read it at a checkpoint's cut:
        rows sealed after the cut live in it or later, so it is `keep_from` for retention."""
        return self._segment

    def append(self, row_id: RowId, row: Row) -> RowLocation:
        """Encode `row` and buffer its frame; O(row bytes), no IO. The location is final,
        but the row is durable only once a later `flush` returns."""
        self._usable()
        rid = check_row_id(row_id)
        if not isinstance(row, Row):
            raise ValueError(f"RowLogWriter.append needs a Row, got {type(row).__name__}")
        payload = _encode_row(rid, row)
        if len(payload) > _MAX_PAYLOAD:
            raise ValueError(f"row {tuple(rid)} encodes to {len(payload)} bytes; a frame holds < 4 GiB")
        frame, checksum = _frame(payload)
        new: list[tuple[int, bytes]] = []
        if not self._started or (
            self._rows_in_segment and self._size + len(frame) > self._segment_bytes
        ):
            if self._started:
                self._segment += 1
            header = _header_frame(self._segment)
            new.append((self._segment, header))
            self._started, self._size, self._rows_in_segment = True, len(header), 0
        loc = RowLocation(self._segment, self._size, len(frame), checksum)
        self._size += len(frame)
        self._rows_in_segment += 1
        new.append((self._segment, frame))
        with self._lock:
            self._pending.extend(new)
        return loc

    def flush(self) -> None:
        """Write every frame appended before this call and fsync: on return those rows are
        durable. OSError on failure, after which the writer is unusable."""
        with self._io_lock:
            self._usable()
            with self._lock:
                pending, self._pending = self._pending, []
            if not pending:
                return
            try:
                created = False
                i = 0
                while i < len(pending):
                    seg = pending[i][0]
                    j = i
                    while j < len(pending) and pending[j][0] == seg:
                        j += 1
                    if seg != self._file_segment:
                        self._open(seg)
                        created = True
                    assert self._file is not None
                    self._file.write(b"".join(frame for _, frame in pending[i:j]))
                    crashpoints.hit(ROWLOG_BEFORE_FSYNC)  # written, in the page cache only
                    self._file.fsync()
                    i = j
                if created:
                    self._fs.fsync(self.directory)
                crashpoints.hit(ROWLOG_AFTER_FSYNC)
            except BaseException as e:
                self._failed = e
                raise

    def _open(self, seg: int) -> None:
        if self._file is not None:  # already fsynced by the flush that wrote to it
            self._file.close()
            self._file = None
        path = segment_path(self.directory, seg)
        if self._fs.kind_of(path) is not None:
            raise FileExistsError(errno.EEXIST, "a row segment is never appended to", str(path))
        f = self._fs.open_append(path)
        if f.tail(1):  # created meanwhile by someone else: never append to it
            f.close()
            raise FileExistsError(errno.EEXIST, "a row segment is never appended to", str(path))
        self._file, self._file_segment = f, seg
        self._known.add(seg)

    def forget(self, numbers: list[int]) -> None:
        """Retention deleted these segments (`delete_unreferenced`): nothing names them now."""
        with self._io_lock:
            self._known.difference_update(numbers)

    def missing(self) -> Path | None:
        """The first segment a checkpoint or the journal may name (see `_known`) that is no
        longer in the row log's directory (removed under the live writer, whose writes to
        its open segment then still succeed), or None. One listing of the directory, and
        the open segment checked through its descriptor (the same file, still linked)."""
        with self._io_lock:
            if self._file is not None and not self._file.still_at(segment_path(self.directory, self._file_segment)):
                return segment_path(self.directory, self._file_segment)
            try:
                on_disk = _numbers(self.directory, self._fs)
            except NotADirectoryError:
                on_disk = {}
            gone = sorted(n for n in self._known if on_disk.get(n) != FILE)
            return segment_path(self.directory, gone[0]) if gone else None

    def _usable(self) -> None:
        if self._closed:
            raise ValueError("the RowLogWriter is closed")
        if self._failed is not None:
            raise OSError(
                errno.EIO, f"the row log is unusable after an earlier failure: {self._failed!r}"
            ) from self._failed

    def close(self, *, flush: bool = True) -> None:
        """Flush what is buffered (if the writer is still usable, and unless `flush=False`:
        rows no durable record will name) and close. Idempotent."""
        if self._closed:
            return
        try:
            if flush and self._failed is None:
                self.flush()
        finally:
            with self._io_lock:
                self._closed = True
                if self._file is not None:
                    f, self._file = self._file, None
                    f.close()

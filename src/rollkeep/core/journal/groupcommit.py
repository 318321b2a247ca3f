"""Group commit: every ledger event of the run goes to the journal, every sealed row to the
row log, and they are made durable together, so the loop never waits on the disk
(docs/design.md §5.1). No thread here: the caller runs `cycle()` (the runner's journal
thread, `controller.journaling.JournalThread`, every `journal.flush_ms` or once `kicked`;
`rollkeep simulate` on its fake clock), so every driver runs the same protocol.

    on the loop   `sink(event)`, subscribed to the scheduler: a seal's row (or a progress's
                  chunk) to the row log's buffer, then the encoded record to ours (no IO);
                  `release()`, after each flush of the trace, hands them to the journal's
                  buffer, so the journal is never ahead of the trace (which then witnesses
                  every row a restore keeps: its seal line is in the trace) and ends between
                  two whole transitions
    a cycle       note the last seq released, fsync the row log (every row those records
                  name was buffered before them), then fsync the journal up to that seq: a
                  durable seal always has a durable row
    a checkpoint  `position()` at the cut; `covering(position, store)` around its
                  publication on the writer's thread: the journal reaches what the checkpoint
                  covers, and the rows it names are durable, before the commit point; what it
                  makes redundant is deleted after

Faults (docs/design.md §5.1, "Durability errors"). A failed write or fsync of the journal or
of the row log is never retried and never ignored: the first one is kept (`_error`, a
FilesystemError naming RUN_DIR/journal or RUN_DIR/rows), every later `sync` raises it again
without touching the disk (after a failed fsync the kernel may have dropped the dirty
pages: nothing since the last good flush is trusted), and the run stops with exit 5 --
the loop at its next `check()` (every turn of the runner's loop), a checkpoint before its
commit point, the run's end at `close()`, which the runner calls before `run_finished`,
so a failed last flush is never reported as a finished run. A journal segment or row
segment removed under the live run (writes to an unlinked file succeed) is found the same
way before a checkpoint is published and at the end (`_check_linked`), and stops the run.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..checkpoint.rowindex import referenced_segments
from ..checkpoint.store import CheckpointStore
from ..custody.events import Event, Progressed, Sealed, TurnSealed
from ..errors import FilesystemError
from ..io.fs import DEFAULT_FS, DIR, FS
from ..rollout.prefixes import PrefixStore, chunk_row
from ..rollout.rows import RowId
from ..rollout.rowstore import RowStore
from ..rollout.source import DatasetId
from ..rowlog.segments import delete_unreferenced
from ..rowlog.writer import RowLogWriter
from .durable import JOURNAL_DIR, ROWS_DIR, encode_entry, encode_restart
from .segments import JournalWriter


def check_writable(run_dir: Path, *, fs: FS = DEFAULT_FS) -> None:
    """Before a journaled run writes anything: RUN_DIR/journal and RUN_DIR/rows take new
    files (or RUN_DIR does, where one is still to be made), so that a read-only mount or a
    missing permission stops the run with nothing changed (exit 5), not at the first flush
    after the run has written its trace and claimed its next step (D10). Each probe
    creates an unnamed file (`FS.check_writable`): no leftover even if killed here."""
    for name in (JOURNAL_DIR, ROWS_DIR):
        path = Path(run_dir) / name
        target = path if fs.kind_of(path) == DIR else Path(run_dir)
        if fs.kind_of(target) is None:
            continue  # a run directory still to be made (by `open_run`'s direct callers)
        try:
            fs.check_writable(target)
        except OSError as e:
            raise FilesystemError(
                f"RUN_DIR/{name} is not writable; nothing was changed", path=str(target),
                expected=f"a directory the run can create its {'journal' if name == JOURNAL_DIR else 'row'} "
                "segments in", found=f"{e.strerror or e} (errno {e.errno})",
                remedy="make it writable (a read-only mount, the permissions) and run the same command "
                "again: the run resumes from its last published checkpoint, which is intact") from None


class GroupCommit:
    def __init__(self, run_dir: Path, *, next_seq: int, rows: RowStore, flush_ms: float, flush_events: int,
                 prefixes: PrefixStore | None = None, fs: FS = DEFAULT_FS) -> None:
        self.run_dir = Path(run_dir)
        self._rows, self._prefixes, self._fs = rows, prefixes, fs
        self._flush_s, self._flush_events = flush_ms / 1000, flush_events
        self.journal = JournalWriter(self.run_dir / JOURNAL_DIR, next_seq, fs=fs)
        self.rowlog = RowLogWriter(self.run_dir / ROWS_DIR, fs=fs)
        self._seq = next_seq - 1  # the seq of the last record queued (the journal numbers them in order)
        self._staged: list[bytes] = []  # records the trace has not flushed yet (loop thread only)
        self._released = next_seq - 1  # the last seq handed to the journal's buffer
        self._waiting = 0  # released since the thread was last kicked
        self._sync_lock = threading.Lock()  # one sync at a time (this thread, the checkpoint writer)
        self._kicked = False  # `flush_events` records are waiting: the next cycle is due now
        self._stop = self._closed = False
        self._error: BaseException | None = None  # the first failure: the journal writes nothing more
        self._reported = False  # `_error` was raised to the run (by `check`, `sync` or `close`)
        self._covered = next_seq - 1  # the position of the last checkpoint published: a restore replays after it
        self.flush_seconds: deque[float] = deque(maxlen=1 << 16)  # the latest flushes that wrote

    # -- the loop's side

    def restart(self, step: int, dataset: DatasetId | None = None) -> None:
        """The first record of the process: its ledger starts at `step` (see `replay`), on
        `dataset` (what a resume from the journal alone checks the dataset against)."""
        self._queue(encode_restart(step, dataset))

    def sink(self, ev: Event) -> None:
        self.check()  # the thread stopped on a disk error: stop the run (exit 5)
        loc = None
        try:
            if type(ev) is Sealed:
                rid = RowId(ev.group_id, ev.generation, ev.attempt)
                loc = self.rowlog.append(rid, self._rows.get(rid))
                self._rows.locate(rid, loc)  # checkpoints from now on name it instead of copying it
            elif isinstance(ev, (Progressed, TurnSealed)):  # the chunk the prefix store just added
                chunk = self._prefixes.last(ev.group_id, ev.generation)
                loc = self.rowlog.append(RowId(ev.group_id, ev.generation, ev.attempt), chunk_row(chunk.tokens))
                self._prefixes.locate(ev.group_id, ev.generation, loc)
        except OSError as e:  # the row log failed on the thread a moment ago (it is unusable now)
            self.check()
            raise FilesystemError.of(e, "writing the row log", self.run_dir / ROWS_DIR) from None
        self._queue(encode_entry(ev, loc))

    def _queue(self, record: bytes) -> None:
        self._staged.append(record)
        self._seq += 1

    def release(self) -> None:
        """The trace has flushed (between two whole transitions): the records staged so far
        go to the journal's buffer, to be made durable by the next flush."""
        if not self._staged or self._stop:  # closed: the trace's own closing flush comes after
            return
        for record in self._staged:
            self.journal.append(record)
        waiting, self._staged = len(self._staged), []
        self._released = self._seq
        self._waiting += waiting
        if self._waiting >= self._flush_events:
            self._waiting = 0
            self._kick()

    def position(self) -> tuple[int, int]:
        """(the last seq queued, the row segment open now): what a cut now covers."""
        return self._seq, self.rowlog.segment

    def check(self) -> None:
        """Raise the journal's disk error, if it had one, on the loop (the run stops: exit 5)."""
        if self._error is not None:
            self._reported = True
            raise self._error

    # -- the checkpoint writer's side (its own thread)

    def sync(self) -> None:
        """Every record released before the call is durable on return, its row first.
        A disk error is a FilesystemError naming the row log or the journal (exit 5); after
        one, every call raises it again and writes nothing."""
        try:
            self._sync()
        except BaseException:
            self._reported = self._error is not None
            raise

    def _sync(self, *, linked: bool = False) -> None:
        """`sync`, without marking its error reported (the thread's cycle); `linked`: then
        check that what a restore after `_covered` reads is still on disk."""
        with self._sync_lock:
            if self._error is not None:  # never retry: what the failed fsync covered is unknown
                raise self._error
            released = self._released  # the rows these name were buffered before them
            try:
                try:
                    self.rowlog.flush()
                except OSError as e:
                    raise FilesystemError.of(e, "writing the row log", self.run_dir / ROWS_DIR) from None
                try:
                    self.journal.flush(upto=released)
                except OSError as e:
                    raise FilesystemError.of(e, "writing the journal", self.run_dir / JOURNAL_DIR) from None
                if linked:
                    self._check_linked()
            except BaseException as e:
                self._error = self._error or e
                raise

    def _check_linked(self) -> None:
        """FilesystemError if a journal segment holding records after the last checkpoint,
        or a row segment that a checkpoint or the journal may name, was removed under the
        live run (D4): a checkpoint published now would name what no restore can read."""
        for name, path in ((JOURNAL_DIR, self._journal_missing()), (ROWS_DIR, self._rows_missing())):
            if path is None:
                continue
            directory = self.run_dir / name
            whole = self._fs.kind_of(directory) is None
            gone = f"RUN_DIR/{name}" if whole else f"{name}/{path.name}"
            raise FilesystemError(
                f"{gone} was removed under the live run", path=str(directory if whole else path),
                expected=f"the {'journal' if name == JOURNAL_DIR else 'row log'} this run writes, in place until "
                "the run ends (checkpoints and the journal name what is in it)",
                found=f"no {path.name} in {directory}" if not whole else f"no {directory}",
                remedy=(f"nothing was published after it; `rollkeep audit {self.run_dir}` says whether the "
                        "last checkpoint still restores: "
                        + ("if it does not, resume from it with journal.enabled=false (what was generated "
                           "after it is generated again)" if name == JOURNAL_DIR else
                           "if it does not, resume from an older checkpoint that `rollkeep audit --all` "
                           "accepts, or restore the row segments from a backup, or start the run fresh")))

    def _journal_missing(self) -> Path | None:
        try:
            return self.journal.missing(after=self._covered)
        except OSError as e:
            raise FilesystemError.of(e, "checking the journal", self.run_dir / JOURNAL_DIR) from None

    def _rows_missing(self) -> Path | None:
        try:
            return self.rowlog.missing()
        except OSError as e:
            raise FilesystemError.of(e, "checking the row log", self.run_dir / ROWS_DIR) from None

    @contextlib.contextmanager
    def covering(self, position: tuple[int, int], store: CheckpointStore) -> Iterator[None]:
        """Around the publication in `store` of a checkpoint cut at `position`: before it,
        the journal reaches what the checkpoint covers and every row it names is durable
        (`sync`); once it is published (it covers the journal through `seq`), the journal
        segments it made redundant are deleted, and so are the row segments older than its
        cut that no checkpoint of the store names (docs/design.md §5.2). Before it, too:
        what the checkpoint will name is still on disk (`_check_linked`)."""
        seq, rows_segment = position
        try:
            self._sync(linked=True)
        except BaseException:
            self._reported = self._error is not None
            raise
        yield
        self._covered = max(self._covered, seq)
        self.journal.delete_covered(seq)
        referenced = referenced_segments(store)
        if referenced is not None:  # a manifest that cannot be read keeps every segment
            self.rowlog.forget(delete_unreferenced(self.run_dir / ROWS_DIR, referenced, keep_from=rows_segment,
                                                   fs=self._fs))

    # -- the cycles

    @property
    def flush_s(self) -> float:
        """How often a cycle is due (`journal.flush_ms`)."""
        return self._flush_s

    @property
    def kicked(self) -> bool:
        """`flush_events` records are waiting: the next cycle runs now, not at its next tick."""
        return self._kicked

    def _kick(self) -> None:
        self._kicked = True

    def _join(self) -> None:
        """Wait for whatever runs the cycles (a thread) to stop; nothing here."""

    def cycle(self) -> None:
        """One group commit: `sync`, timed when it wrote. Raises what `sync` raises (the
        caller then stops cycling: `fail`)."""
        self._kicked = False
        t0 = time.perf_counter()
        before = self.journal.durable_seq
        self._sync()
        if self.journal.durable_seq != before:
            self.flush_seconds.append(time.perf_counter() - t0)

    def fail(self, e: BaseException) -> None:
        """The thread stopped on `e`: the loop raises it at its next event (`check`)."""
        if self._error is None:
            self._error = e if not isinstance(e, OSError) else \
                FilesystemError.of(e, "writing the journal", self.run_dir / JOURNAL_DIR)

    def close(self, *, report: bool = True) -> None:
        """Stop the cycles after a last `sync` of what was released, check that what a
        restore reads is still on disk, and close; again: nothing. Raises the journal's
        failure (FilesystemError, exit 5) unless it was raised to the run already: a failed
        thread whose error no `check` saw, or the last sync's. `report=False` (the run is
        already failing of something else) keeps that error from replacing the run's own.

        Records still staged are dropped, not released: the trace never flushed them, and
        on an error (a disk fault raised inside a sink) they may end in the middle of a
        scheduler transition, which a restore must never replay (found by `rollkeep
        simulate`: a budget-spending failure replayed without its drop gave the group an
        attempt past its budget). A graceful end flushed the trace at Stop, so it keeps
        everything."""
        if self._closed:
            return
        self._closed = self._stop = True
        self._join()
        try:
            self._sync(linked=True)
        except BaseException:
            if report and not self._reported:
                self._reported = True
                raise
        finally:
            # Only `sync` may make records durable: it fsyncs their rows first. After a failed
            # one (or a failed thread) the records still buffered may name rows that never
            # reached the disk (found by `rollkeep simulate`: one failed row-log write, then
            # the close flushed the seals naming it, and no restore could read their rows).
            # Rows still buffered belong to the dropped records: no record names them.
            self.journal.close(flush=False)
            self.rowlog.close(flush=False)

    def stats(self) -> dict[str, Any]:
        """The `run_finished` fields: the flushes that wrote, and their p50 / p99 seconds."""
        s = sorted(self.flush_seconds)
        pick = (lambda q: s[min(len(s) - 1, int(q * len(s)))]) if s else (lambda q: None)
        return {"journal_flushes": len(s), "journal_flush_p50_s": pick(0.5), "journal_flush_p99_s": pick(0.99)}

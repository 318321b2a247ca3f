"""The journal thread: every ledger event of the run goes to the journal, every sealed row to
the row log, and a thread of its own makes them durable by group commit, so the loop never
waits on the disk (docs/design.md §5.1).

    on the loop   `sink(event)`, subscribed to the scheduler: a seal's row (or a progress's
                  chunk) to the row log's buffer, then the encoded record to ours (no IO); `release()`, after each
                  flush of the trace, hands them to the journal's buffer, so the journal is
                  never ahead of the trace (which then witnesses every row a restore keeps:
                  its seal line is in the trace) and ends between two whole transitions
    the thread    every `journal.flush_ms`, or once `journal.flush_events` were released:
                  note the last seq released, fsync the row log (every row those records
                  name was buffered before them), then fsync the journal up to that seq: a
                  durable seal always has a durable row
    a checkpoint  `position()` at the cut; `covering(position, store)` around its
                  publication on the writer's thread: the journal reaches what the checkpoint
                  covers, and the rows it names are durable, before the commit point; what it
                  makes redundant is deleted after

`threaded=False` (`rollkeep simulate`, on its fake clock) starts no thread: the caller runs
the thread's cycle itself (`cycle()`, when `kicked` or every `flush_ms` of its time), and
everything else is the same code.

A failed write or fsync stops the thread; the loop sees it at its next `check()` and the run
stops as on any disk error (exit 5): what was flushed before stays durable.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..core.durable import JOURNAL_DIR, ROWS_DIR, encode_entry, encode_restart
from ..core.errors import FilesystemError
from ..core.events import Event, Progressed, Sealed, TurnSealed
from ..core.fs import DEFAULT_FS, FS
from ..core.journal import JournalWriter, delete_covered
from ..core.prefixes import PrefixStore, chunk_row
from ..core.rowindex import referenced_segments
from ..core.rowlog import RowLogWriter, delete_unreferenced
from ..core.rows import RowId, RowStore
from ..core.source import DatasetId
from ..core.store import CheckpointStore


class JournalThread:
    def __init__(self, run_dir: Path, *, next_seq: int, rows: RowStore, flush_ms: float, flush_events: int,
                 prefixes: PrefixStore | None = None, fs: FS = DEFAULT_FS, threaded: bool = True) -> None:
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
        self._kick = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self.flush_seconds: deque[float] = deque(maxlen=1 << 16)  # the latest flushes that wrote
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="rollkeep-journal", daemon=True)
            self._thread.start()

    # -- the loop's side

    def restart(self, step: int, dataset: DatasetId | None = None) -> None:
        """The first record of the process: its ledger starts at `step` (see `replay`), on
        `dataset` (what a resume from the journal alone checks the dataset against)."""
        self._queue(encode_restart(step, dataset))

    def sink(self, ev: Event) -> None:
        if self._error is not None:  # the thread stopped on a disk error: stop the run (exit 5)
            self.check()
        loc = None
        if isinstance(ev, Sealed):
            rid = RowId(ev.group_id, ev.generation, ev.attempt)
            loc = self.rowlog.append(rid, self._rows.get(rid))
            self._rows.locate(rid, loc)  # checkpoints from now on name it instead of copying it
        elif isinstance(ev, Progressed | TurnSealed):  # the chunk the prefix store just added
            chunk = self._prefixes.last(ev.group_id, ev.generation)
            loc = self.rowlog.append(RowId(ev.group_id, ev.generation, ev.attempt), chunk_row(chunk.tokens))
            self._prefixes.locate(ev.group_id, ev.generation, loc)
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
            self._kick.set()

    def position(self) -> tuple[int, int]:
        """(the last seq queued, the row segment open now): what a cut now covers."""
        return self._seq, self.rowlog.segment

    def check(self) -> None:
        """Raise the thread's disk error, if it had one, on the loop (the run stops: exit 5)."""
        if self._error is not None:
            raise FilesystemError.of(self._error, "writing the journal", self.run_dir / JOURNAL_DIR) \
                if isinstance(self._error, OSError) else self._error

    # -- the checkpoint writer's side (its own thread)

    def sync(self) -> None:
        """Every record released before the call is durable on return, its row first.
        A disk error is a FilesystemError naming the journal (exit 5)."""
        with self._sync_lock:
            released = self._released  # the rows these name were buffered before them
            try:
                self.rowlog.flush()
                self.journal.flush(upto=released)
            except OSError as e:
                raise FilesystemError.of(e, "writing the journal", self.run_dir / JOURNAL_DIR) from None

    @contextlib.contextmanager
    def covering(self, position: tuple[int, int], store: CheckpointStore) -> Iterator[None]:
        """Around the publication in `store` of a checkpoint cut at `position`: before it,
        the journal reaches what the checkpoint covers and every row it names is durable
        (`sync`); once it is published (it covers the journal through `seq`), the journal
        segments it made redundant are deleted, and so are the row segments older than its
        cut that no checkpoint of the store names (docs/design.md §5.2)."""
        self.sync()
        yield
        seq, rows_segment = position
        delete_covered(self.run_dir / JOURNAL_DIR, seq, fs=self._fs)
        referenced = referenced_segments(store)
        if referenced is not None:  # a manifest that cannot be read keeps every segment
            delete_unreferenced(self.run_dir / ROWS_DIR, referenced, keep_from=rows_segment, fs=self._fs)

    # -- the thread

    def _run(self) -> None:
        while not self._stop:
            self._kick.wait(self._flush_s)
            try:
                self.cycle()
            except BaseException as e:  # the loop raises it (check); nothing more is written
                self.fail(e)
                return

    @property
    def kicked(self) -> bool:
        """`flush_events` records are waiting: the thread flushes now, not at its next tick."""
        return self._kick.is_set()

    def cycle(self) -> None:
        """One turn of the thread: `sync`, timed when it wrote. Raises what `sync` raises
        (the thread then stops: `fail`)."""
        self._kick.clear()
        t0 = time.perf_counter()
        before = self.journal.durable_seq
        self.sync()
        if self.journal.durable_seq != before:
            self.flush_seconds.append(time.perf_counter() - t0)

    def fail(self, e: BaseException) -> None:
        """The thread stopped on `e`: the loop raises it at its next event (`check`)."""
        self._error = e

    def close(self) -> None:
        """Stop the thread after a last `sync` of what was released. Records still staged
        are dropped, not released: the trace never flushed them, and on an error (a disk
        fault raised inside a sink) they may end in the middle of a scheduler transition,
        which a restore must never replay (found by `rollkeep simulate`: a budget-spending
        failure replayed without its drop gave the group an attempt past its budget). A
        graceful end flushed the trace at Stop, so it keeps everything."""
        self._stop = True
        self._kick.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self._error is None:
                self.sync()
        finally:
            # Only `sync` may make records durable: it fsyncs their rows first. After a failed
            # one (or a failed thread) the records still buffered may name rows that never
            # reached the disk (found by `rollkeep simulate`: one failed row-log write, then
            # the close flushed the seals naming it, and no restore could read their rows).
            self.journal.close(flush=False)
            self.rowlog.close()

    def stats(self) -> dict[str, Any]:
        """The `run_finished` fields: the flushes that wrote, and their p50 / p99 seconds."""
        s = sorted(self.flush_seconds)
        pick = (lambda q: s[min(len(s) - 1, int(q * len(s)))]) if s else (lambda q: None)
        return {"journal_flushes": len(s), "journal_flush_p50_s": pick(0.5), "journal_flush_p99_s": pick(0.99)}

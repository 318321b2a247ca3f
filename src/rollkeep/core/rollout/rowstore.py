"""The embedded `RowStore` of a run: its finished sibling rows, in memory or by reference.

Threading (docs/design.md §2, §3)
----------------------------
`put`, `put_ref`, `locate`, `delete`, `pin`, `ids`, `len` and `in` run on the controller's
loop thread. A checkpoint writer on a background thread holds a `RowPin` taken during the
cut and calls only `location` and `get` (or the pin's) with ids it knows were present when
the pin was taken (`RowPin.locations`, `RowPin.get`), and `get` only for rows without a
location, which are in memory; and `RowPin.gather`, the places `locate` recorded in columns
(`LocatedColumns`, whose module says when they are written and why its reads are safe;
`COLUMNS_FROM` says from what size the store keeps them). While any pin is held,
`delete` is deferred: the row leaves the store's logical view at once but stays readable by
`get` and `location`, and is removed when the last pin is released.

Why the writer's reads are safe: in CPython a plain `d[key]` lookup runs under the GIL as
one C call, and a dict resize caused by the loop thread inserting other keys happens inside
another such call, so the lookup never sees a half-resized table. (Free-threaded CPython
locks each dict for the same effect.) Only *iterating* a dict that another thread mutates
can fail ("dictionary changed size during iteration"), so the writer never iterates the
live dict: `ids()` returns a snapshot and is for the loop thread. The pin count and the set
of deferred deletes are guarded by a lock, so `RowPin.release()` may also be called from the
writer thread when it finishes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from rollkeep.core.errors import CustodyError
from rollkeep.core.rollout.located import Gathered, LocatedColumns, Places
from rollkeep.core.rollout.rows import Row, RowId, check_row_id, row_id_of

__all__ = ["RowPin", "RowStore"]

_PUT_BATCH = 4096  # places queued before the loop puts them into the columns (no pin held)
# The columns cost every located row ~2 us on the loop; a checkpoint that looks rows up one
# by one instead costs ~0.6 us per row it names. So they pay only where far more rows are in
# flight than are sealed between two checkpoints: the store keeps them from the first time
# it holds this many located rows (8 k groups of 16; below, a checkpoint's lookups take
# < 0.1 s), and then queues every place it already holds too.
COLUMNS_FROM = 1 << 17


class RowPin:
    """Holds deletions back while a checkpoint writer reads rows. Release exactly once
    (further calls are no-ops); use it as a context manager."""

    __slots__ = ("_store", "_released")

    def __init__(self, store: RowStore) -> None:
        self._store = store
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def get(self, row_id: RowId) -> Row:
        """`store.get(row_id)`, refused once this pin is released."""
        if self._released:
            raise CustodyError(
                "A row was read through a RowPin after the pin was released",
                expected="reads only while the pin is held",
                found=f"get({row_id!r}) after release()",
                remedy="release the pin after the checkpoint writer has read every row.",
            )
        return self._store.get(row_id)

    @property
    def locations(self) -> Callable[[RowId], Any]:
        """`store.location`, for a checkpoint naming 100 k rows without two calls per row:
        the row log's map's own `get` (plain lookups: safe from the writer's thread)."""
        return self._store._where.get

    def gather(self, group_ids: list[str], group: np.ndarray, generation: np.ndarray,
               attempt: np.ndarray) -> Gathered:
        """The places of many rows at once, for those the store's `LocatedColumns` hold
        (`LocatedColumns.gather`), after the places `locate` queued are put in; look the
        others up one by one (`locations`)."""
        store = self._store
        with store._gathering:
            with store._lock:
                store._put_queued()
            return store._located.gather(group_ids, group, generation, attempt)

    def release(self) -> None:
        """Drop this pin; the last one out applies the deferred deletes. Idempotent, and
        callable from the checkpoint writer thread."""
        self._store._unpin(self)

    def __enter__(self) -> RowPin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RowStore:
    """The row store of a run. See the module docstring for the threading rules.

    A row is held in memory, or by reference: its `RowLocation` in the row log
    (`rollkeep.core.rowlog.segments`), read on its first `get` by the `reader` the store was made
    with, verified, and kept in memory from then on. A row the journal appended to the row
    log has both (`locate`); a checkpoint then names it by its location instead of copying
    it (docs/design.md §5.2).

    The logical view (`in`, `len`, `ids`) drops a row as soon as it is deleted; `get` and
    `location` keep serving a deleted row while a pin defers its removal.
    """

    def __init__(self, reader: Callable[[RowId, Any], Row] | None = None, *, columns_from: int | None = None) -> None:
        """`columns_from`: keep the columns from this many located rows (`COLUMNS_FROM`)."""
        self._rows: dict[RowId, Row] = {}  # rows in memory
        self._where: dict[RowId, Any] = {}  # RowLocation of rows in the row log
        self._located = LocatedColumns()  # the places `locate` recorded, in columns (for checkpoints)
        self._queued: list[tuple[RowId, Any]] = []  # located, not yet in `_located`
        self._columns = False  # whether `locate` queues places for `_located`
        self._columns_from = COLUMNS_FROM if columns_from is None else columns_from
        self._gathering = threading.Lock()  # one gather (and the put before it) at a time
        self._deferred: set[RowId] = set()  # deleted while pinned; still held
        self._pins = 0
        self._n = 0  # rows of the logical view
        self._reader = reader
        self._lock = threading.Lock()

    def _held(self, rid: RowId) -> bool:
        return rid in self._rows or rid in self._where

    def put(self, row_id: RowId, row: Row) -> None:
        """Store `row` under `row_id`. The same content again is a no-op; a different row
        under a held id raises CustodyError and changes nothing."""
        rid = check_row_id(row_id)
        if not isinstance(row, Row):
            raise ValueError(f"RowStore.put needs a Row, got {type(row).__name__}")
        if not self._held(rid):
            with self._lock:
                self._rows[rid] = row
                self._n += 1
            return
        existing = self.get(rid)
        if not existing.equal(row):
            raise CustodyError(
                f"Conflicting seal: row {tuple(rid)} is already stored with different content",
                expected=f"the stored {existing!r} again (a duplicate seal is a no-op)",
                found=repr(row),
                remedy="an attempt is sealed once; a new rollout needs a new attempt.",
            )
        with self._lock:
            if rid in self._deferred:  # deleted while pinned, now stored again
                self._deferred.remove(rid)
                self._n += 1

    def put_ref(self, row_id: RowId, location: Any) -> None:
        """Hold the row under `row_id` by reference: read at `location` on its first `get`.
        The id must be new (a restore puts each row once)."""
        rid = check_row_id(row_id)
        if self._reader is None:
            raise ValueError("RowStore.put_ref needs a store made with a reader")
        if self._held(rid):
            raise ValueError(f"row {tuple(rid)} is already held")
        with self._lock:
            self._where[rid] = location
            self._n += 1

    def locate(self, row_id: RowId, location: Any) -> None:
        """Record where a held row was appended in the row log (the journal, at its seal).
        A row's place never changes: the same place again is a no-op, another a ValueError."""
        if row_id not in self._rows:
            raise KeyError(row_id)
        with self._lock:
            n = len(self._where)
            held = self._where.setdefault(row_id, location)
            if len(self._where) == n:  # located before
                if held != location:
                    raise ValueError(f"row {tuple(row_id)} is at {held!r} in the row log already, not {location!r}")
                return
            if self._columns or len(self._where) >= self._columns_from:
                if not self._columns:
                    self._columns = True
                    self._queued.extend(self._where.items())  # put in batch by batch, below
                else:
                    self._queued.append((row_id, location))
                if len(self._queued) >= _PUT_BATCH and not self._pins:
                    self._put_queued(_PUT_BATCH)

    def location(self, row_id: RowId) -> Any:
        """The row's `RowLocation` in the row log, or None if it is held in memory only.
        Safe from the checkpoint writer thread, as `get`."""
        return self._where.get(row_id)

    def get(self, row_id: RowId) -> Row:
        """The row under `row_id` (KeyError if absent); a row held by reference is read and
        verified now (the reader's errors: `RowSegmentCorrupt`, exit 3). Safe from the
        checkpoint writer thread for ids present when its pin was taken."""
        row = self._rows.get(row_id)
        if row is not None:
            return row
        row = self._reader(row_id, self._where[row_id])  # type: ignore[misc]  # KeyError if absent
        self._rows[row_id] = row  # one dict store: atomic under the GIL
        return row

    def delete(self, row_id: RowId) -> None:
        """Remove a row (KeyError if absent). Deferred while any pin is held."""
        with self._lock:
            if not self._held(row_id) or row_id in self._deferred:
                raise KeyError(row_id)
            self._n -= 1
            if self._pins:
                self._deferred.add(check_row_id(row_id))
            else:
                self._drop(row_id)

    def pin(self) -> RowPin:
        """O(1). Until the returned pin is released, deletes are deferred."""
        with self._lock:
            self._pins += 1
        return RowPin(self)

    def _unpin(self, pin: RowPin) -> None:
        with self._lock:
            if pin._released:
                return
            pin._released = True
            self._pins -= 1
            if self._pins == 0 and self._deferred:
                for rid in self._deferred:
                    self._drop(rid)
                self._deferred.clear()

    def _put_queued(self, at_most: int | None = None) -> None:
        """The queued places (the first `at_most`) of rows still held at them into the
        columns (under the lock, with no gather running: see `LocatedColumns`)."""
        queued, self._queued = self._queued, []
        if at_most is not None and len(queued) > at_most:
            queued, self._queued = queued[:at_most], queued[at_most:]
        where = self._where
        held = [(rid, loc) for rid, loc in queued if where.get(rid) is loc]
        self._located.put_many([rid for rid, _ in held], [loc for _, loc in held])

    def _drop(self, rid: RowId) -> None:
        """Remove a deleted row for good (under the lock, with no pin held)."""
        self._rows.pop(rid, None)
        if self._where.pop(rid, None) is not None and self._located:
            self._located.remove(rid)

    @property
    def pins(self) -> int:
        """Pins currently held."""
        return self._pins

    def __contains__(self, row_id: object) -> bool:
        return self._held(row_id) and row_id not in self._deferred  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self._n

    def ids(self) -> Iterator[RowId]:
        """A snapshot of the stored ids (in memory first, then by reference). Loop thread only."""
        with self._lock:
            snapshot = [rid for rid in self._rows if rid not in self._deferred]
            snapshot += [rid for rid in self._where if rid not in self._rows and rid not in self._deferred]
        # A restore's keys are plain tuples (`restore`): each given back as the RowId it equals.
        return map(row_id_of, snapshot)

    def restore(self, rows: Mapping[RowId, Any], located: Places | None = None, gone: Iterable[RowId] = ()) -> None:
        """Fill an empty store with what a restore produced (`Restored.rows`, a replay's rows:
        ids already checked by their decoders, as RowIds or the plain tuples they equal): a
        `Row` in memory, anything else (a `RowLocation`) by reference. O(rows) dict updates,
        no read. `located`: the same places as columns (the checkpoint's `rows.index`, from
        which `rows` was decoded), so that checkpoints gather them (`LocatedColumns`);
        `gone`: those of its rows that `rows` no longer holds (freed by a journal's tail)."""
        if self._rows or self._where:
            raise ValueError("RowStore.restore fills an empty store")
        # The kinds of value first, in one C-level pass: a restore with the journal names
        # every row by reference, and its 800 k entries are then copied whole (once, below).
        refs: Mapping[RowId, Any] = rows
        copied: dict[RowId, Row] = {}
        if any(issubclass(kind, Row) for kind in set(map(type, rows.values()))):
            refs = {rid: row for rid, row in rows.items() if not isinstance(row, Row)}
            copied = {rid: row for rid, row in rows.items() if rid not in refs}
        if refs and self._reader is None:
            raise ValueError("RowStore.restore of rows by reference needs a store made with a reader")
        with self._lock:
            self._where.update(refs)
            self._rows.update(copied)
            self._n = len(rows)
            if located is not None and len(self._where) >= self._columns_from:
                self._columns = True
                self._located.fill(located)
                for rid in gone:
                    self._located.remove(rid)

    def resident(self) -> int:
        """Rows held in memory (the rest are read on their first `get`)."""
        return len(self._rows)

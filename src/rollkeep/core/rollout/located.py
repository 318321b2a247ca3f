"""`LocatedColumns`: where the row log holds a run's located rows, in columns.

The `RowStore` keeps every row's `RowLocation` in a dict, which answers one row at a time.
A checkpoint at 100 k in-flight groups names 800 k rows: one dict lookup and one object
read per row cost ~0.5 s of its write (docs/design.md §9). This table holds the same
places as numpy columns, a block of slots per group indexed by generation, so the
checkpoint gathers them with a few array operations after one lookup per *group*.

It is an index of the store's dict, never the only record of a place: a row it does not
hold (sealed in a journal's tail before a restart, or an older attempt a newer one
displaced) is found in the dict as before, so what it must guarantee is only that what it answers is right. A
restart fills it from the restored checkpoint's `rows.index` (`fill`).

Slots: the block of a group starts at `base`; slot `base + g` holds generation g's row:
`key = g << 32 | attempt` (-1: empty), `where = segment << 33 | length`, `offset`,
`checksum`. A slot's key names its generation, so an index that runs past its group's block
into another's never matches (that block's slot there holds another generation).

Threading (the store's rules, docs/design.md §2): the table is changed only under the
store's lock and never while a `gather` runs. `locate` only queues a place; the store puts
the queue in (`put_many`, vectorised) on the loop thread when it is long and no pin is
held, and on the checkpoint writer's thread just before it gathers, holding its pin and
the store's gather lock (so two writers never gather and put at once). `remove` runs on
the loop thread with no pin held (the store defers deletes while one is), `fill` at a
restore. A gather, which runs holding a pin, therefore reads columns no one writes.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple, Protocol

import numpy as np

from .rows import RowId

__all__ = ["Gathered", "LocatedColumns", "Places"]

_EMPTY = -1
_LENGTH_BITS = 33  # a frame's length is at most header + 2**32 - 1
_LENGTH_MASK = (1 << _LENGTH_BITS) - 1
_MIN_BLOCK = 16
_PLACE = tuple(attrgetter(f) for f in ("segment", "offset", "length", "checksum"))


class _Columns(NamedTuple):
    key: np.ndarray  # int64: generation << 32 | attempt; -1 for an empty slot
    where: np.ndarray  # uint64: segment << 33 | length
    offset: np.ndarray  # uint64
    checksum: np.ndarray  # uint64

    @classmethod
    def empty(cls, n: int) -> _Columns:
        return cls(np.full(n, _EMPTY, np.int64), np.zeros(n, np.uint64), np.zeros(n, np.uint64),
                   np.zeros(n, np.uint64))

    def grown(self, n: int) -> _Columns:
        new = _Columns.empty(n)
        for old, col in zip(self, new, strict=True):
            col[: len(old)] = old
        return new


class Gathered(NamedTuple):
    """The places of some rows: `found[i]` says whether row i's are in the columns."""

    found: np.ndarray  # bool
    segment: np.ndarray  # int64
    offset: np.ndarray  # uint64
    length: np.ndarray  # uint64
    checksum: np.ndarray  # uint64


class Places(Protocol):
    """Many rows' places as columns, row i across them (a checkpoint's `RowColumns`): the
    rows' groups as runs, `group_ids[j]` for the next `counts[j]` rows."""

    group_ids: list[str]
    counts: np.ndarray
    generation: np.ndarray
    attempt: np.ndarray
    segment: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    checksum: np.ndarray


class LocatedColumns:
    """Row log places by group and generation. See the module docstring."""

    def __init__(self) -> None:
        self._cols = _Columns.empty(1024)
        self._base: dict[str, int] = {}  # group id -> its block's first slot
        self._cap: dict[int, int] = {}  # block base -> slots in the block
        self._used: dict[int, int] = {}  # block base -> occupied slots
        self._free: dict[int, list[int]] = {}  # block size -> bases of free blocks
        self._top = 0  # slots handed out so far

    def __len__(self) -> int:
        return sum(self._used.values())

    def __bool__(self) -> bool:
        return bool(self._base)

    def put_many(self, rids: list[RowId], locs: list[Any]) -> None:
        """Hold each `rids[i]` at `locs[i]` (a `RowLocation` of the row log, a layer above),
        in a few array operations: a block for each new group, a bigger one (the rows moved)
        where a generation is past its group's block, a row's place over any other attempt of
        its generation. A frame longer than the length field stays out (the store's dict
        holds every place)."""
        length = np.fromiter(map(_PLACE[2], locs), np.uint64, len(locs))
        if not (length <= _LENGTH_MASK).all():
            ok = (length <= _LENGTH_MASK).tolist()
            rids, locs, length = list(compress(rids, ok)), list(compress(locs, ok)), length[np.array(ok, bool)]
        n = len(rids)
        if not n:
            return
        gids = list(map(itemgetter(0), rids))
        gen = np.fromiter(map(itemgetter(1), rids), np.int64, n)
        att = np.fromiter(map(itemgetter(2), rids), np.int64, n)
        segment, offset, checksum = (np.fromiter(map(_PLACE[i], locs), np.uint64, n) for i in (0, 1, 3))
        bases = np.fromiter(map(self._base.get, gids, repeat(_EMPTY)), np.int64, n)
        caps = np.fromiter(map(self._cap.get, bases.tolist(), repeat(0)), np.int64, n)
        grow = np.flatnonzero(gen >= caps)  # a new group, or a generation past its block
        if len(grow):
            sizes = _block_sizes(gen[grow])
            by_size = grow[np.argsort(sizes, kind="stable")]  # dict() keeps the last, the largest
            need = dict(zip(map(gids.__getitem__, by_size.tolist()), np.sort(sizes).tolist(), strict=True))
            for gid, size in need.items():
                base = self._base.get(gid)
                self._base[gid] = self._block(size) if base is None else self._move(base, size)
            bases = np.fromiter(map(self._base.get, gids), np.int64, n)
        slot = bases + gen
        # The last place given for a slot wins (two attempts of one generation: the later).
        last = n - 1 - np.unique(slot[::-1], return_index=True)[1]
        slot = slot[last]
        cols = self._cols
        fresh = cols.key[slot] == _EMPTY
        for base, count in zip(*np.unique(bases[last][fresh], return_counts=True), strict=True):
            self._used[int(base)] += int(count)
        cols.where[slot] = segment[last] << np.uint64(_LENGTH_BITS) | length[last]
        cols.offset[slot] = offset[last]
        cols.checksum[slot] = checksum[last]
        cols.key[slot] = gen[last] << 32 | att[last]

    def fill(self, places: Places) -> None:
        """An empty table given many places at once, each row once (a restore's `rows.index`,
        whose decoder refused a row named twice and whose chain proved one attempt per
        sibling): a block per group, the columns scattered in a few array operations."""
        if self._base:
            raise ValueError("LocatedColumns.fill fills an empty table")
        names, group = _groups(places.group_ids, places.counts)
        gen = places.generation.astype(np.int64)
        top = np.zeros(len(names), np.int64)
        np.maximum.at(top, group, gen)
        sizes = _block_sizes(top)
        bases = np.cumsum(sizes) - sizes
        slot = bases[group] + gen
        total = int(sizes.sum())
        if total > len(self._cols.key):
            self._cols = _Columns.empty(total)
        self._top, self._free = total, {}  # no slot is occupied: the blocks freed before are laid out afresh
        base_list, size_list = bases.tolist(), sizes.tolist()
        self._base = dict(zip(names, base_list, strict=True))
        self._cap = dict(zip(base_list, size_list, strict=True))
        self._used = dict(zip(base_list, np.bincount(group, minlength=len(names)).tolist(), strict=True))
        cols = self._cols
        cols.where[slot] = places.segment.astype(np.uint64) << np.uint64(_LENGTH_BITS) | places.length
        cols.offset[slot] = places.offset
        cols.checksum[slot] = places.checksum
        key = gen << 32 | places.attempt
        cols.key[slot] = key
        if not np.array_equal(cols.key[slot], key):  # two rows of one generation: the later overwrote
            self.__init__()  # back to an empty table
            raise ValueError("LocatedColumns.fill: two places for one group's generation")

    def remove(self, rid: RowId) -> None:
        """Forget `rid` if its generation's slot holds it (never while a pin is held)."""
        gid, gen, att = rid
        base = self._base.get(gid)
        key = self._cols.key
        if base is None or gen >= self._cap[base] or key[base + gen] != gen << 32 | att:
            return
        key[base + gen] = _EMPTY
        self._used[base] -= 1
        if not self._used[base]:
            del self._base[gid], self._used[base]
            self._free.setdefault(self._cap[base], []).append(base)

    def gather(self, group_ids: list[str], group: np.ndarray, generation: np.ndarray,
               attempt: np.ndarray) -> Gathered:
        """The places of rows `(group_ids[group[i]], generation[i], attempt[i])`, for those
        the columns hold: one dict lookup per group, the rest array operations. Safe from
        the checkpoint writer's thread while it holds a pin."""
        cols = self._cols  # one consistent set (growing replaces them whole)
        bases = np.fromiter(map(self._base.get, group_ids, [_EMPTY] * len(group_ids)), np.int64,
                            len(group_ids))
        slot = bases[group] + generation
        ok = (bases[group] >= 0) & (slot < len(cols.key))
        slot[~ok] = 0
        found = ok & (cols.key[slot] == (generation.astype(np.int64) << 32 | attempt))
        where = cols.where[slot]
        return Gathered(found, (where >> _LENGTH_BITS).astype(np.int64), cols.offset[slot],
                        where & np.uint64(_LENGTH_MASK), cols.checksum[slot])

    def _block(self, size: int) -> int:
        free = self._free.get(size)
        if free:
            base = free.pop()
        else:
            base, self._top = self._top, self._top + size
            if self._top > len(self._cols.key):
                self._cols = self._cols.grown(max(2 * len(self._cols.key), self._top))
        self._cap[base], self._used[base] = size, 0
        return base

    def _move(self, base: int, size: int) -> int:
        """A bigger block for the group at `base`, its rows copied over; the new base."""
        new = self._block(size)
        old = self._cap[base]
        for col in self._cols:
            col[new : new + old] = col[base : base + old]
        self._used[new] = self._used.pop(base)
        self._cols.key[base : base + old] = _EMPTY
        self._free.setdefault(old, []).append(base)
        return new


def _block_sizes(generation: np.ndarray) -> np.ndarray:
    """The block each generation needs: a power of two past it, at least `_MIN_BLOCK`
    (`frexp`'s exponent of g is `g.bit_length()`)."""
    return np.maximum(_MIN_BLOCK, np.left_shift(1, np.frexp(generation.astype(np.float64))[1].astype(np.int64)))


def _groups(run_ids: list[str], counts: np.ndarray) -> tuple[list[str], np.ndarray]:
    """The distinct group ids of runs of rows and each row's position among them. An index
    lists each group's rows together (the ledger's order): then each run is a group;
    otherwise the runs of one group are found by a dict."""
    if len(set(run_ids)) == len(run_ids):
        return list(run_ids), np.repeat(np.arange(len(run_ids)), counts)
    pos = {gid: i for i, gid in enumerate(dict.fromkeys(run_ids))}
    return list(pos), np.repeat(np.fromiter(map(pos.__getitem__, run_ids), np.int64, len(run_ids)), counts)


"""`rows.index`: the rows a checkpoint names by reference instead of copying (docs/design.md §5.2).

A row the journal appended to the row log (`rollkeep.core.rowlog.segments`) is immutable at its
`RowLocation`, so a checkpoint records where it is: one entry per row, and in the manifest
the extent of every segment it names. Rows without a location (a run with the journal off,
or rows restored from a checkpoint that copied them) are still copied into
`rows.safetensors`; a row is in exactly one of the two files.

Format: msgpack `[3 (schema), rows, chunks, turns]`. `rows` are the rows named by
reference, in the order the checkpoint lists them (the ledger's: groups in key order, each
group's rows together), as `[group_ids, counts, generation, attempt, segment, offset,
length, checksum]`: each group named once with how many entries follow (uint32), then one
column per field as raw little-endian arrays (int32 x 3, uint64, uint32, uint64 = xxh3_64 of
the frame's payload), entry i across them. `chunks` are the partial generations' chains
(`core/rollout/prefixes.py`), each sibling's chunks in order, as `[group_ids, generation,
attempt, end, segment, offset, length, checksum]` with a group id per entry and `end` (int32)
the completion's tokens through the chunk; `turns` lists the chunks that end a turn of a
multi-turn episode (docs/design.md §5.4) as `[chunk's position in chunks, turn, the
environment's snapshot bytes or nil]`. Columns, not one array per row: 100 k groups' rows
decode in a few msgspec and numpy calls. Still read: schema 2, whose `rows` table is laid
out as `chunks` (a group id and an `end` of 0 per row: a third more bytes at 8 rows per
group), and schema 1 (schema 2 before episodes: no `turns`). The file is bound by its
sha256 in the manifest like every other file; the manifest's `rows.segments` lists, for each
segment the index names, `[segment, end]` where `end` is the end of the last frame it names
there (a restore checks each segment reaches that far, and retention keeps every segment a
retained checkpoint lists).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, repeat
from operator import attrgetter, ne
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np

from ..errors import RowsMismatch
from ..rollout.prefixes import Link
from ..rollout.rows import RowId, row_id_of
from ..rowlog.segments import FRAME_HEADER, MAX_OFFSET, ROWS_DIR, RowLocation
from .store import CheckpointStore

__all__ = ["INDEX_SCHEMA", "ROWS_INDEX", "RowColumns", "decode_index", "encode_index", "extents", "index_rows", "referenced_segments",
           "rows_dir_for", "segments_listed"]

ROWS_INDEX = "rows.index"
INDEX_SCHEMA = 3
_SCHEMAS_READ = (1, 2, 3)
_REMEDY = (
    "the rows index of this checkpoint is corrupt or was not written by this rollkeep; "
    "restore from an older checkpoint, or start the run fresh."
)


class _Table(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    group_ids: list[Annotated[str, msgspec.Meta(min_length=1)]]
    generation: bytes  # int32 LE, one per entry; likewise below
    attempt: bytes
    end: bytes  # int32: a chunk's end (tokens of the completion through it); 0 for a row
    segment: bytes
    offset: bytes  # uint64
    length: bytes  # uint32
    checksum: bytes  # uint64


class _Runs(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Schema 3's rows: each group named once, with the number of its entries."""

    group_ids: list[Annotated[str, msgspec.Meta(min_length=1)]]
    counts: bytes  # uint32 LE, one per group id
    generation: bytes  # int32 LE, one per entry; likewise below
    attempt: bytes
    segment: bytes
    offset: bytes  # uint64
    length: bytes  # uint32
    checksum: bytes  # uint64


class _Index(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    schema: int
    rows: msgspec.Raw  # `_Runs` (schema 3) or `_Table`, decoded once the schema is known
    chunks: _Table  # partial generations: each sibling's chain, in order
    turns: list[tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=0)], bytes | None]] = []


class _Written(msgspec.Struct, array_like=True):
    """What `encode_index` writes (schema 3): `_Index` with its rows as runs."""

    schema: int
    rows: _Runs
    chunks: _Table
    turns: list[tuple[int, int, bytes | None]]


_COLUMNS = {"generation": "<i4", "attempt": "<i4", "end": "<i4", "segment": "<i4", "offset": "<u8",
            "length": "<u4", "checksum": "<u8"}
_RUN_COLUMNS = {k: v for k, v in _COLUMNS.items() if k != "end"}
_COUNTS = "<u4"
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Index).decode
_decode_runs = msgspec.msgpack.Decoder(_Runs).decode
_decode_table = msgspec.msgpack.Decoder(_Table).decode


@dataclass(frozen=True)
class RowColumns:
    """Entries of a `rows.index` table as columns (entry i across them): what a checkpoint
    writes and a restore compares with the ledger, without an object per row. The entries'
    groups are runs: `group_ids[j]` for the next `counts[j]` entries (a group's rows are
    listed together, so a group is named once; `per_entry` finds the runs of a group id
    per entry)."""

    group_ids: list[str]  # one per run
    counts: np.ndarray  # int64, entries per run (each >= 1)
    generation: np.ndarray
    attempt: np.ndarray
    end: np.ndarray
    segment: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    checksum: np.ndarray

    @classmethod
    def per_entry(cls, group_ids: list[str], *columns: np.ndarray) -> RowColumns:
        """The columns of entries given a group id each (`columns` in the order of the
        fields after `counts`): runs of equal neighbours, found in C."""
        n = len(group_ids)
        starts = np.flatnonzero(np.fromiter(map(ne, group_ids[1:], group_ids), bool, max(n - 1, 0))) + 1
        starts = np.concatenate([np.zeros(min(n, 1), np.int64), starts])
        return cls(list(map(group_ids.__getitem__, starts.tolist())), np.diff(starts, append=n), *columns)

    def __len__(self) -> int:
        return len(self.generation)

    def entry_group_ids(self) -> list[str]:
        """Each entry's group id (the runs expanded, in C)."""
        return list(chain.from_iterable(map(repeat, self.group_ids, self.counts.tolist())))

    def ids(self) -> list[RowId]:
        # `row_id_of`: in C, where a NamedTuple's own __new__ is Python.
        return list(map(row_id_of, self.row_keys()))

    def row_keys(self) -> list[tuple[str, int, int]]:
        """The entries' row ids as plain tuples: equal to (and hashing as) their `RowId`s, so
        they look rows up alike; built by `zip` in C, and untracked by the cyclic collector
        after its first pass (a NamedTuple never is: 800 k of them made every later full
        collection of a restored run walk them)."""
        return list(zip(self.entry_group_ids(), self.generation.tolist(), self.attempt.tolist(), strict=True))

    def locations(self) -> Iterator[RowLocation]:
        return _locations(self.__dict__)

    def extents(self, more: Iterable[RowLocation] = ()) -> list[list[int]]:
        """`extents` of these entries' locations and `more`."""
        extra = list(more)
        return _extents(np.concatenate([self.segment.astype(np.int64), np.array([x.segment for x in extra], np.int64)]),
                        np.concatenate([self.offset + self.length.astype(np.uint64),
                                        np.array([x.offset + x.length for x in extra], np.uint64)]))


def index_rows(group_ids: list[str], generation, attempt, locations: list[RowLocation], end=None) -> RowColumns:
    """`RowColumns` of rows (or chunks, with their `end`s) and their places in the row log."""
    n = len(locations)

    def column(field: str, dtype: str) -> np.ndarray:
        return np.fromiter(map(attrgetter(field), locations), dtype, n)

    return RowColumns.per_entry(list(group_ids), np.asarray(generation, _COLUMNS["generation"]),
                      np.asarray(attempt, _COLUMNS["attempt"]),
                      np.zeros(n, _COLUMNS["end"]) if end is None else np.asarray(end, _COLUMNS["end"]),
                      *(column(f, _COLUMNS[f]) for f in ("segment", "offset", "length", "checksum")))


def _table(cols: RowColumns) -> _Table:
    return _Table(cols.entry_group_ids(), **{k: np.ascontiguousarray(getattr(cols, k), v).tobytes()
                                             for k, v in _COLUMNS.items()})


def _runs(cols: RowColumns) -> _Runs:
    if len(cols.counts) and (cols.counts.min() < 1 or cols.counts.max() > np.iinfo(_COUNTS).max):
        raise ValueError(f"rows index runs of {int(cols.counts.min())}..{int(cols.counts.max())} entries")
    return _Runs(cols.group_ids, cols.counts.astype(_COUNTS).tobytes(),
                 **{k: np.ascontiguousarray(getattr(cols, k), v).tobytes() for k, v in _RUN_COLUMNS.items()})


def encode_index(entries: RowColumns | Iterable[tuple[RowId, RowLocation]],
                 chains: Mapping[tuple[str, int], Iterable[Link]] | None = None) -> bytes:
    """`entries`: the rows named by reference (columns, or (id, place) pairs); `chains`:
    the partial generations, every chunk with its place (`Link.at`)."""
    if not isinstance(entries, RowColumns):
        pairs = list(entries)  # ids: the ledger's, checked
        entries = index_rows([rid[0] for rid, _ in pairs], [rid[1] for rid, _ in pairs],
                             [rid[2] for rid, _ in pairs], [loc for _, loc in pairs])
    links = [(gid, gen, ch) for (gid, gen), chain in (chains or {}).items() for ch in chain]
    chunks = index_rows([gid for gid, _, _ in links], [gen for _, gen, _ in links],
                        [ch.attempt for _, _, ch in links], [ch.at for _, _, ch in links],
                        [ch.end for _, _, ch in links])
    turns = [(i, ch.turn, ch.snapshot) for i, (_, _, ch) in enumerate(links) if ch.turn >= 0]
    return _encode(_Written(INDEX_SCHEMA, _runs(entries), _table(chunks), turns))


@dataclass(frozen=True)
class Index:
    """A decoded `rows.index`: the rows named by reference, the chains of partial
    generations, and `[segment, end]` of every segment either names."""

    located: dict[tuple[str, int, int], RowLocation]  # `rows` keyed by plain tuples (`RowColumns.row_keys`)
    chains: dict[tuple[str, int], tuple[Link, ...]]
    extents: list[list[int]]
    columns: RowColumns  # `rows` as columns, in the file's order

    @cached_property
    def rows(self) -> dict[RowId, RowLocation]:
        """The rows named by reference, keyed by their `RowId`s."""
        return dict(zip(self.columns.ids(), self.located.values(), strict=True))


def decode_index(data: bytes, *, path: str = ROWS_INDEX) -> Index:
    """Decode strictly: RowsMismatch naming `path` for anything malformed or out of range,
    an unknown schema, a row named twice, or a chain whose chunks do not grow. Checked in
    bulk (numpy), then built without per-entry validation: a restore at 100 k groups
    decodes it in tens of ms."""
    def bad(what: str, expected: str, found: str, field: str = "rows") -> RowsMismatch:
        return RowsMismatch(what, path=path, field=field, expected=expected, found=found, remedy=_REMEDY)

    try:
        index = _decode(data)
        if index.schema not in _SCHEMAS_READ:
            raise bad("Unsupported rows index schema", f"one of {list(_SCHEMAS_READ)}", str(index.schema), "schema")
        table = (_decode_runs if index.schema >= 3 else _decode_table)(index.rows)
    except msgspec.DecodeError as e:
        raise bad("The rows index does not decode", "msgpack [schema, rows, chunks, turns]: rows a table of "
                  "group_ids, counts, generation, attempt, segment, offset, length, checksum (schema 3; "
                  "group_ids, generation, attempt, end, ... before), chunks of group_ids, generation, attempt, "
                  "end, segment, offset, length, checksum", str(e)) from None
    if isinstance(table, _Runs):
        counts = _counts(table, bad)
        rows, ends = _columns(table, bad, "rows", n=int(counts.sum()), names=_RUN_COLUMNS)
        rows["end"] = np.zeros(len(ends), _COLUMNS["end"])
        columns = RowColumns(table.group_ids, counts, *(rows[col] for col in _COLUMNS))
    else:
        rows, ends = _columns(table, bad, "rows")
        columns = RowColumns.per_entry(table.group_ids, *(rows[col] for col in _COLUMNS))
    chunks, chunk_ends = _columns(index.chunks, bad, "chunks")
    ids = columns.row_keys()
    out = dict(zip(ids, columns.locations(), strict=True))
    if len(out) != len(ids):
        dup = next(rid for rid, c in Counter(ids).items() if c > 1)
        raise bad("The rows index names a row twice", "each (group_id, generation, attempt) once",
                  f"{tuple(dup)} more than once")
    turns = _turns(index.turns, len(index.chunks.group_ids), bad)
    chains: dict[tuple[str, int], tuple[Link, ...]] = {}
    for i, (gid, gen, att, end, loc) in enumerate(zip(index.chunks.group_ids, chunks["generation"].tolist(),
                                                      chunks["attempt"].tolist(), chunks["end"].tolist(),
                                                      _locations(chunks), strict=True)):
        chain = chains.get((gid, gen), ())
        turn, snapshot = turns.get(i, (-1, None))
        before = chain[-1].end if chain else 0
        # A turn's chunk may be empty (its tokens were all recorded by progress, and the
        # environment answered nothing); any other chunk adds tokens.
        if end < before or (end == before and turn < 0) or (chain and att < chain[-1].attempt):
            raise bad(f"The chain of partial generation {gid}/{gen} does not grow", "chunks in order: ends "
                      "increasing, attempts not decreasing", f"attempt {att} ending at token {end}", "chunks")
        finished = sum(link.turn >= 0 for link in chain)
        if turn >= 0 and turn != finished:
            raise bad(f"The episode of sibling {gid}/{gen} skips a turn", "turns 0, 1, 2, ... in order",
                      f"turn {turn} after {finished} finished turn(s)", "turns")
        chains[(gid, gen)] = (*chain, Link(att, end, None, loc, turn, snapshot))
    return Index(out, chains, _extents(np.concatenate([rows["segment"], chunks["segment"]]),
                                       np.concatenate([ends, chunk_ends])), columns)


def _turns(entries: list[tuple[int, int, bytes | None]], n_chunks: int, bad) -> dict[int, tuple[int, bytes | None]]:
    """chunk position -> (turn, snapshot), each position in range and listed once."""
    out = {i: (turn, snapshot) for i, turn, snapshot in entries}
    if len(out) != len(entries) or any(i >= n_chunks for i in out):
        raise bad("The rows index lists a turn of no chunk, or one chunk twice",
                  f"distinct chunk positions below {n_chunks}", str(sorted(i for i, _, _ in entries)[-3:]), "turns")
    return out


def _counts(t: _Runs, bad) -> np.ndarray:
    """Schema 3's entries per group: one uint32 >= 1 per group id."""
    width = np.dtype(_COUNTS).itemsize
    if len(t.counts) != len(t.group_ids) * width:
        raise bad("The rows index column rows.counts has the wrong length",
                  f"{len(t.group_ids)} x {width} bytes (one per group id)", f"{len(t.counts)} bytes")
    counts = np.frombuffer(t.counts, _COUNTS).astype(np.int64)
    if len(counts) and int(counts.min()) < 1:
        raise bad("The rows index column rows.counts is out of range", ">= 1 (a group named has rows)",
                  str(int(counts.min())))
    return counts


def _columns(t: _Table | _Runs, bad, name: str, *, n: int | None = None,
             names: Mapping[str, str] = _COLUMNS) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The table's columns, each checked to hold `n` entries (a `_Table`: one per group id)
    and within range; and each entry's end in its segment."""
    n = len(t.group_ids) if n is None else n
    cols = {}
    for col, dtype in names.items():
        raw = getattr(t, col)
        width = np.dtype(dtype).itemsize
        if len(raw) != n * width:
            raise bad(f"The rows index column {name}.{col} has the wrong length",
                      f"{n} x {width} bytes (one per entry)", f"{len(raw)} bytes", name)
        cols[col] = np.frombuffer(raw, dtype)
    for col, low in (("generation", 0), ("attempt", 0), ("end", 0), ("segment", 0), ("length", FRAME_HEADER.size)):
        if n and col in cols and int(cols[col].min()) < low:
            raise bad(f"The rows index column {name}.{col} is out of range", f">= {low}",
                      str(int(cols[col].min())), name)
    if n and int(cols["offset"].max()) > MAX_OFFSET:  # offset + length must not wrap
        raise bad(f"The rows index column {name}.offset is out of range", f"<= {MAX_OFFSET}",
                  str(int(cols["offset"].max())), name)
    return cols, cols["offset"] + cols["length"]


def _locations(cols: dict[str, np.ndarray]):
    return map(RowLocation, cols["segment"].tolist(), cols["offset"].tolist(), cols["length"].tolist(),
               cols["checksum"].tolist())


def extents(locations: Iterable[RowLocation]) -> list[list[int]]:
    """`[segment, end]` for each segment the locations name, in order: `end` is the end of
    the last frame named there."""
    locs = list(locations)
    return _extents(np.array([x.segment for x in locs], np.int64),
                    np.array([x.offset + x.length for x in locs], np.uint64))


def _extents(segments: np.ndarray, ends: np.ndarray) -> list[list[int]]:
    segments = segments.astype(np.int64)
    top = int(segments.max()) if len(segments) else -1
    if top < 4 * len(segments) + 4096:  # segment numbers count up from 0: a table indexed by them
        last = np.zeros(top + 1, np.uint64)
        np.maximum.at(last, segments, ends)
        uniq = np.flatnonzero(np.bincount(segments, minlength=top + 1))
        last = last[uniq]
    else:  # sparse (an index naming far-apart segments): sorted unique numbers, no table
        uniq = np.unique(segments)
        last = np.zeros(len(uniq), np.uint64)
        np.maximum.at(last, np.searchsorted(uniq, segments), ends)
    return [[s, e] for s, e in zip(uniq.tolist(), last.tolist(), strict=True)]


def segments_listed(manifest: Mapping[str, Any]) -> list[list[int]] | None:
    """The manifest's `rows.segments`, or None when it has none (a checkpoint that copied its
    rows) or it is malformed."""
    rows = manifest.get("rows")
    segs = rows.get("segments") if isinstance(rows, dict) else None
    if not isinstance(segs, list) or not all(
        isinstance(s, list) and len(s) == 2 and all(type(x) is int and x >= 0 for x in s) for s in segs
    ):
        return None
    return segs


def referenced_segments(store: CheckpointStore) -> set[int] | None:
    """Every row segment a checkpoint of `store` names (published, kept by retention, or set
    aside), or None if some manifest cannot be read or trusted: then nothing may be deleted."""
    out: set[int] = set()
    for _, manifest in store.manifests():
        if manifest is None:
            return None
        if manifest.get("schemas", {}).get("rows", 1) < 2:
            continue  # its rows are copies
        segs = segments_listed(manifest)
        if segs is None:
            return None
        out.update(seg for seg, _ in segs)
    return out


def rows_dir_for(checkpoint_dir: Path) -> Path:
    """The row log a checkpoint's index points into: `RUN_DIR/rows` for a checkpoint in
    `RUN_DIR/checkpoints/` or in one of its `abandoned-*/` directories."""
    parent = Path(checkpoint_dir).parent
    if parent.name.startswith("abandoned-"):
        parent = parent.parent
    return parent.parent / ROWS_DIR

"""`rows.index`: the rows a checkpoint names by reference instead of copying (docs/design.md §5.2).

A row the journal appended to the row log (`rollkeep.core.rowlog`) is immutable at its
`RowLocation`, so a checkpoint records where it is: one entry per row, and in the manifest
the extent of every segment it names. Rows without a location (a run with the journal off,
or rows restored from a checkpoint that copied them) are still copied into
`rows.safetensors`; a row is in exactly one of the two files.

Format: msgpack `[1 (schema), group_ids, generation, attempt, segment, offset, length,
checksum]`, a list of str and then one column per field as raw little-endian arrays (int32,
int32, int32, uint64, uint32, uint64 = xxh3_64 of the frame's payload), row i across them,
in the order the checkpoint lists its rows. Columns, not one array per row: 100 k rows
decode in a few msgspec and numpy calls. The file is bound by its
sha256 in the manifest like every other file; the manifest's `rows.segments` lists, for each
segment the index names, `[segment, end]` where `end` is the end of the last frame it names
there (a restore checks each segment reaches that far, and retention keeps every segment a
retained checkpoint lists).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from itertools import repeat
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np

from .errors import RowsMismatch
from .rowlog import FRAME_HEADER, ROWS_DIR, RowLocation
from .rows import RowId, _check_row_id
from .store import CheckpointStore

__all__ = ["INDEX_SCHEMA", "ROWS_INDEX", "decode_index", "encode_index", "extents", "referenced_segments",
           "rows_dir_for", "segments_listed"]

ROWS_INDEX = "rows.index"
INDEX_SCHEMA = 1
_REMEDY = (
    "the rows index of this checkpoint is corrupt or was not written by this rollkeep; "
    "restore from an older checkpoint, or start the run fresh."
)


class _Index(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    schema: int
    group_ids: list[Annotated[str, msgspec.Meta(min_length=1)]]
    generation: bytes  # int32 LE, one per row; likewise below
    attempt: bytes
    segment: bytes
    offset: bytes  # uint64
    length: bytes  # uint32
    checksum: bytes  # uint64


_COLUMNS = {"generation": "<i4", "attempt": "<i4", "segment": "<i4", "offset": "<u8", "length": "<u4",
            "checksum": "<u8"}
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Index).decode


def encode_index(entries: Iterable[tuple[RowId, RowLocation]]) -> bytes:
    ids, locs = [], []
    for rid, loc in entries:
        ids.append(_check_row_id(rid))
        locs.append(loc)
    cols = {
        "generation": [r.generation for r in ids], "attempt": [r.attempt for r in ids],
        "segment": [x.segment for x in locs], "offset": [x.offset for x in locs],
        "length": [x.length for x in locs], "checksum": [x.checksum for x in locs],
    }
    return _encode(_Index(INDEX_SCHEMA, [r.group_id for r in ids],
                          **{k: np.array(v, _COLUMNS[k]).tobytes() for k, v in cols.items()}))


def decode_index(data: bytes, *, path: str = ROWS_INDEX) -> tuple[dict[RowId, RowLocation], list[list[int]]]:
    """The index's rows and their `extents`, strictly: RowsMismatch naming `path` for anything malformed or out
    of range, an unknown schema, or a row named twice. Checked in bulk (numpy), then built
    without per-row validation: a restore at 100 k groups decodes it in tens of ms."""
    def bad(what: str, expected: str, found: str, field: str = "rows") -> RowsMismatch:
        return RowsMismatch(what, path=path, field=field, expected=expected, found=found, remedy=_REMEDY)

    try:
        index = _decode(data)
    except msgspec.DecodeError as e:
        raise bad("The rows index does not decode", "msgpack [schema, group_ids, generation, attempt, "
                  "segment, offset, length, checksum]", str(e)) from None
    if index.schema != INDEX_SCHEMA:
        raise bad("Unsupported rows index schema", str(INDEX_SCHEMA), str(index.schema), "schema")
    n = len(index.group_ids)
    cols = {}
    for name, dtype in _COLUMNS.items():
        raw = getattr(index, name)
        width = np.dtype(dtype).itemsize
        if len(raw) != n * width:
            raise bad(f"The rows index column {name!r} has the wrong length", f"{n} x {width} bytes "
                      f"(one per row)", f"{len(raw)} bytes", name)
        cols[name] = np.frombuffer(raw, dtype)
    for name, low in (("generation", 0), ("attempt", 0), ("segment", 0), ("length", FRAME_HEADER.size)):
        if n and int(cols[name].min()) < low:
            raise bad(f"The rows index column {name!r} is out of range", f">= {low}",
                      str(int(cols[name].min())), name)
    # tuple.__new__ in C: a NamedTuple's own __new__ is Python, ~5x slower per row.
    ids = list(map(tuple.__new__, repeat(RowId),
                   zip(index.group_ids, cols["generation"].tolist(), cols["attempt"].tolist(), strict=True)))
    locs = map(RowLocation, cols["segment"].tolist(), cols["offset"].tolist(), cols["length"].tolist(),
               cols["checksum"].tolist())
    out = dict(zip(ids, locs, strict=True))
    if len(out) != n:
        dup = next(rid for rid, c in Counter(ids).items() if c > 1)
        raise bad("The rows index names a row twice", "each (group_id, generation, attempt) once",
                  f"{tuple(dup)} more than once")
    ends = cols["offset"] + cols["length"]
    segs = np.unique(cols["segment"])
    last = np.full(len(segs), 0, np.uint64)
    np.maximum.at(last, np.searchsorted(segs, cols["segment"]), ends)
    return out, [[s, e] for s, e in zip(segs.tolist(), last.tolist(), strict=True)]


def extents(locations: Iterable[RowLocation]) -> list[list[int]]:
    """`[segment, end]` for each segment the locations name, in order: `end` is the end of
    the last frame named there."""
    ends: dict[int, int] = {}
    for loc in locations:
        end = loc.offset + loc.length
        if end > ends.get(loc.segment, 0):
            ends[loc.segment] = end
    return [[seg, ends[seg]] for seg in sorted(ends)]


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

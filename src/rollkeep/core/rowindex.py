"""`rows.index`: the rows a checkpoint names by reference instead of copying (docs/design.md §5.2).

A row the journal appended to the row log (`rollkeep.core.rowlog`) is immutable at its
`RowLocation`, so a checkpoint records where it is: one entry per row, and in the manifest
the extent of every segment it names. Rows without a location (a run with the journal off,
or rows restored from a checkpoint that copied them) are still copied into
`rows.safetensors`; a row is in exactly one of the two files.

Format: msgpack `[1 (schema), [[group_id, generation, attempt, [segment, offset, length,
xxh3_64]], ...]]`, in the order the checkpoint lists its rows. The file is bound by its
sha256 in the manifest like every other file; the manifest's `rows.segments` lists, for each
segment the index names, `[segment, end]` where `end` is the end of the last frame it names
there (a restore checks each segment reaches that far, and retention keeps every segment a
retained checkpoint lists).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

from .errors import RowsMismatch
from .rowlog import ROWS_DIR, RowLocation
from .rows import RowId, _check_row_id
from .store import CheckpointStore

__all__ = ["INDEX_SCHEMA", "ROWS_INDEX", "decode_index", "encode_index", "extents", "referenced_segments",
           "rows_dir_for", "segments_listed"]

ROWS_INDEX = "rows.index"
INDEX_SCHEMA = 1
_INT32_MAX = 2**31 - 1
_REMEDY = (
    "the rows index of this checkpoint is corrupt or was not written by this rollkeep; "
    "restore from an older checkpoint, or start the run fresh."
)
_Id = Annotated[int, msgspec.Meta(ge=0, le=_INT32_MAX)]


class _Entry(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    group_id: Annotated[str, msgspec.Meta(min_length=1)]
    generation: _Id
    attempt: _Id
    at: RowLocation


class _Index(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    schema: int
    rows: list[_Entry]


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Index).decode


def encode_index(entries: Iterable[tuple[RowId, RowLocation]]) -> bytes:
    out = []
    for rid, loc in entries:
        rid = _check_row_id(rid)
        out.append(_Entry(rid.group_id, rid.generation, rid.attempt, loc))
    return _encode(_Index(INDEX_SCHEMA, out))


def decode_index(data: bytes, *, path: str = ROWS_INDEX) -> dict[RowId, RowLocation]:
    """The index's rows, strictly: RowsMismatch naming `path` for anything malformed, an
    unknown schema, or a row named twice."""
    def bad(what: str, expected: str, found: str) -> RowsMismatch:
        return RowsMismatch(what, path=path, field="rows", expected=expected, found=found, remedy=_REMEDY)

    try:
        index = _decode(data)
    except msgspec.DecodeError as e:
        raise bad("The rows index does not decode", "msgpack [schema, [[group_id, generation, attempt, "
                  "[segment, offset, length, checksum]], ...]]", str(e)) from None
    if index.schema != INDEX_SCHEMA:
        raise bad("Unsupported rows index schema", str(INDEX_SCHEMA), str(index.schema))
    out = {RowId(e.group_id, e.generation, e.attempt): e.at for e in index.rows}
    if len(out) != len(index.rows):
        dup = next(rid for rid, c in Counter(RowId(e.group_id, e.generation, e.attempt)
                                             for e in index.rows).items() if c > 1)
        raise bad("The rows index names a row twice", "each (group_id, generation, attempt) once",
                  f"{tuple(dup)} more than once")
    return out


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

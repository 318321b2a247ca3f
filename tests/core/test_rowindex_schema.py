"""rows.index schema 3 (issue 29): each group named once with a count of its rows, no `end`
column for rows. Any rows round-trip; a schema-2 index (a group id and an `end` per row)
still decodes to the same rows; forged counts are refused."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkeep.core.checkpoint.rowindex import INDEX_SCHEMA, decode_index, encode_index
from rollkeep.core.errors import RowsMismatch
from rollkeep.core.rollout.rows import RowId
from rollkeep.core.rowlog.segments import FRAME_HEADER, RowLocation


def loc(i: int) -> RowLocation:
    return RowLocation(i % 3, 64 * i, FRAME_HEADER.size + 8 + i, i * 7919)


# Rows as a checkpoint lists them (a group's rows together) or not (a group in two runs:
# another writer's order); each row once.
ROWS = st.lists(st.tuples(st.sampled_from(["e0.1", "e0.2", "e1.10", "x"]), st.integers(0, 40), st.integers(0, 3)),
                unique_by=lambda r: r[:2], max_size=40)


def as_schema_2(blob: bytes) -> bytes:
    """The same index written as schema 2 wrote it: a group id and an `end` (0) per row."""
    raw = msgspec.msgpack.decode(blob)
    gids, counts, gen, att, seg, off, length, chk = raw[1]
    per_row = [g for g, c in zip(gids, np.frombuffer(counts, "<u4").tolist(), strict=True) for _ in range(c)]
    raw[0], raw[1] = 2, [per_row, gen, att, np.zeros(len(per_row), "<i4").tobytes(), seg, off, length, chk]
    return msgspec.msgpack.encode(raw)


@settings(max_examples=200, deadline=None)
@given(ROWS)
def test_rows_round_trip_and_schema_2_decodes_alike(rows) -> None:
    entries = [(RowId(*r), loc(i)) for i, r in enumerate(rows)]
    blob = encode_index(entries)
    for data in (blob, as_schema_2(blob)):
        index = decode_index(data)
        assert list(index.rows.items()) == entries
        cols = index.columns
        assert cols.entry_group_ids() == [r[0] for r in rows]
        assert cols.generation.tolist() == [r[1] for r in rows] and not cols.end.any()
        # runs are maximal: neighbours differ
        assert all(a != b for a, b in zip(cols.group_ids, cols.group_ids[1:], strict=False)) and (cols.counts >= 1).all()
    raw = msgspec.msgpack.decode(blob)
    gids = [r[0] for r in rows]
    assert raw[0] == INDEX_SCHEMA == 3
    assert raw[1][0] == [g for i, g in enumerate(gids) if i == 0 or gids[i - 1] != g]  # each run named once


ENTRIES = [(RowId("e0.1", g, 0), loc(g)) for g in range(3)] + [(RowId("e0.2", 0, 0), loc(5))]


def forged(change) -> bytes:
    raw = msgspec.msgpack.decode(encode_index(ENTRIES))
    change(raw[1])
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.__setitem__(1, np.array([3, 0], "<u4").tobytes()), "rows.counts is out of range"),
    (lambda t: t.__setitem__(1, np.array([3], "<u4").tobytes()), "rows.counts has the wrong length"),
    (lambda t: t.__setitem__(1, np.array([3, 2], "<u4").tobytes()), "rows.generation has the wrong length"),
    (lambda t: t.__setitem__(1, np.array([1, 1], "<u4").tobytes()), "rows.generation has the wrong length"),
    (lambda t: t.__setitem__(0, ["e0.1", ""]), "does not decode"),
    (lambda t: t.pop(), "does not decode"),
    (lambda t: t.__setitem__(0, ["e0.1", "e0.1"]), "names a row twice"),
])
def test_forged_counts_are_refused(change, message) -> None:
    with pytest.raises(RowsMismatch, match=message):
        decode_index(forged(change))

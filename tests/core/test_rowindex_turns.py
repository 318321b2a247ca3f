"""rows.index's turns table (issue 12): finished turns round-trip with their snapshots,
schema-1 indexes still decode, and a forged table is refused."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkeep.core.checkpoint.rowindex import decode_index, encode_index
from rollkeep.core.errors import RowsMismatch
from rollkeep.core.rollout.prefixes import Link
from rollkeep.core.rowlog.segments import FRAME_HEADER, RowLocation


def loc(i: int) -> RowLocation:
    return RowLocation(0, 64 * i, FRAME_HEADER.size + 8, i)


CHAINS = {("e0.1", 0): (Link(0, 5, at=loc(0), turn=0, snapshot=b"s0"), Link(0, 7, at=loc(1)),
                        Link(1, 9, at=loc(2), turn=1, snapshot=None))}


def forged(change) -> bytes:
    raw = msgspec.msgpack.decode(encode_index([], CHAINS))
    change(raw)
    return msgspec.msgpack.encode(raw)


def test_turns_round_trip_and_schema_1_has_none() -> None:
    (chain,) = decode_index(encode_index([], CHAINS)).chains.values()
    assert [(x.end, x.turn, x.snapshot) for x in chain] == [(5, 0, b"s0"), (7, -1, None), (9, 1, None)]
    old = forged(lambda raw: (raw.__setitem__(0, 1), raw.pop()))
    assert [x.turn for x in next(iter(decode_index(old).chains.values()))] == [-1, -1, -1]


@pytest.mark.parametrize("change, message", [
    (lambda raw: raw[3].append([7, 2, None]), "turn of no chunk"),
    (lambda raw: raw[3].append([0, 0, None]), "turn of no chunk, or one chunk twice"),
    (lambda raw: raw[3].__setitem__(1, [2, 2, None]), "skips a turn"),
    (lambda raw: raw.__setitem__(0, 4), "Unsupported rows index schema"),
    (lambda raw: raw[3].append([-1, 0, None]), "does not decode"),
])
def test_a_forged_turns_table_is_refused(change, message) -> None:
    with pytest.raises(RowsMismatch, match=message):
        decode_index(forged(change))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**31 - 1) | st.integers(0, 40), st.integers(0, 2**40)), min_size=0, max_size=60))
def test_extents_are_the_last_end_in_each_segment_named(entries):
    """The manifest's `rows.segments`: dense segment numbers take a table, far-apart ones a
    sort; both give each segment named, in order, with the end of its last frame."""
    from rollkeep.core.checkpoint.rowindex import _extents

    expected: dict[int, int] = {}
    for seg, end in entries:
        expected[seg] = max(expected.get(seg, 0), end)
    got = _extents(np.array([s for s, _ in entries], np.int32), np.array([e for _, e in entries], np.uint64))
    assert got == [[s, expected[s]] for s in sorted(expected)]

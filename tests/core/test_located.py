"""`LocatedColumns`, the row store's places in columns: what a checkpoint gathers from them
is the place the store's dict holds, whatever was put, moved, deleted or pinned; and the
checkpoint's rows index is the same with the columns as with one lookup per row."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkeep.bench.controller import _row
from rollkeep.bench.ledger import inflight_ledger
from rollkeep.core.checkpoint.cut import checkpoint_files, cut, referenced_columns
from rollkeep.core.checkpoint.rowindex import decode_index
from rollkeep.core.custody.ledger import Ledger
from rollkeep.core.rollout.rows import RowId
from rollkeep.core.rollout.rowstore import RowStore
from rollkeep.core.rowlog.segments import RowLocation

ROW = _row(2)
GROUPS = ["a", "b", "c"]


def reader(rid, loc):
    return ROW


def loc_of(i: int) -> RowLocation:
    # lengths past 2**32 and checksums and offsets near their limits: the packing must keep them
    return RowLocation(i % 7, (i * 7919) % 2**48, 12 + (i * 104729) % (2**33 - 12), (i * 2654435761) ** 2 % 2**64)


def gathered(store: RowStore, rids: list[RowId]) -> dict[RowId, RowLocation]:
    """What `RowPin.gather` finds for `rids`, as places (loc_of(i) never repeats the
    made-up RowLocation(7, ...) a test relocates to: its segment is below 7)."""
    with store.pin() as pin:
        got = pin.gather(GROUPS, np.array([GROUPS.index(r[0]) for r in rids], np.int64),
                         np.array([r[1] for r in rids], np.int64), np.array([r[2] for r in rids], np.int64))
    return {rid: RowLocation(int(s), int(o), int(n), int(c))
            for rid, f, s, o, n, c in zip(rids, got.found, got.segment, got.offset, got.length, got.checksum,
                                          strict=True) if f}


rid_st = st.builds(RowId, st.sampled_from(GROUPS), st.sampled_from([0, 1, 15, 16, 17, 40]), st.integers(0, 2))
ops = st.lists(st.tuples(st.sampled_from(["locate", "locate", "relocate", "delete", "pin", "release"]), rid_st,
                         st.integers(0, 10**6)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_what_the_columns_give_is_the_dicts_place_and_pinned_places_never_change(script):
    store = RowStore(reader=reader)
    pins: list = []
    frozen: dict[RowId, RowLocation] = {}  # places found when the oldest held pin was taken
    for op, rid, n in script:
        if op == "locate" and rid not in store:
            store.put(rid, ROW)
            store.locate(rid, loc_of(n))
        elif op == "relocate" and rid in store:  # a row's place never changes
            with pytest.raises(ValueError, match="in the row log already"):
                store.locate(rid, RowLocation(7, 0, 12, 0))
            store.locate(rid, store.location(rid))  # the same place again: nothing happens
        elif op == "delete" and rid in store:
            store.delete(rid)
        elif op == "pin":
            if not pins:
                held = list(store.ids())
                frozen = gathered(store, held)
            pins.append(store.pin())
        elif op == "release" and pins:
            pins.pop().release()
        held = list(store.ids())
        probe = held + list(frozen) + [RowId(g, gen, att) for g in GROUPS for gen in (0, 15, 16, 40) for att in (0, 1)]
        found = gathered(store, probe)
        for rid, place in found.items():  # a deleted row stays readable while pinned: so does its place
            assert store.location(rid) == place, rid
        if pins:  # the checkpoint writer's view: what it found at the pin it finds all along
            assert {rid: found.get(rid) for rid in frozen} == frozen
    for pin in pins:
        pin.release()
    assert not store.pins


def test_rows_located_with_no_pin_are_all_in_the_columns_and_leave_with_their_groups():
    store = RowStore(reader=reader)
    rids = [RowId(g, gen, 0) for g in GROUPS for gen in (5, 0, 17, 3, 40)]  # 17 and 40 move blocks
    for i, rid in enumerate(rids):
        store.put(rid, ROW)
        store.locate(rid, loc_of(i))
    assert gathered(store, rids) == {rid: loc_of(i) for i, rid in enumerate(rids)}
    for rid in rids:
        store.delete(rid)
    assert gathered(store, rids) == {} and not len(store._located)
    for i, rid in enumerate(rids):  # freed blocks are handed out again
        store.put(rid, ROW)
        store.locate(rid, loc_of(i + 1))
    assert gathered(store, rids) == {rid: loc_of(i + 1) for i, rid in enumerate(rids)}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["located", "restored", "copied", "located_pinned"]), min_size=1, max_size=60))
def test_a_checkpoint_names_each_row_at_its_dicts_place_whether_or_not_the_columns_hold_it(kinds):
    """Rows restored by reference (not in the columns), located, located into a slot taken
    while a pin was held, and held in memory only: the rows index names exactly the placed
    ones, in the ledger's order, each at the place the store's dict holds; the others are
    copied."""
    state = inflight_ledger(len(kinds), 4).capture()
    sealed = referenced_columns(state).row_ids()
    kind = {rid: kinds[sealed_ix % len(kinds)] for sealed_ix, rid in enumerate(sealed)}
    store = RowStore(reader=reader)
    store.restore({tuple(rid): loc_of(i) for i, rid in enumerate(sealed) if kind[rid] == "restored"})
    pin = store.pin()
    for i, rid in enumerate(sealed):
        if kind[rid] == "restored":
            continue
        if kind[rid] == "located_pinned":  # another attempt took the slot first
            other = RowId(rid.group_id, rid.generation, rid.attempt + 1)
            store.put(other, ROW)
            store.locate(other, loc_of(10**6 + i))
        store.put(rid, ROW)
        if kind[rid] != "copied":
            store.locate(rid, loc_of(i))
    pin.release()
    files, rows = checkpoint_files(cut(Ledger.from_state(state), store))
    index = decode_index(files["rows.index"])
    placed = [rid for rid in sealed if kind[rid] != "copied"]
    assert index.columns.ids() == placed
    assert index.rows == {rid: store.location(rid) for rid in placed}
    assert rows["copied"] == len(sealed) - len(placed) and rows["by_reference"] == len(placed)

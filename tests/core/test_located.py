"""`LocatedColumns`, the row store's places in columns: what a checkpoint gathers from them
is the place the store's dict holds, whatever was located, moved, deleted or pinned, and
every located row is found; the checkpoint's rows index is the same with the columns as
with one lookup per row; a restore fills them from its index."""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkeep.bench.controller import _row
from rollkeep.bench.ledger import inflight_ledger
from rollkeep.core.checkpoint.cut import checkpoint_files, cut, referenced_columns
from rollkeep.core.checkpoint.rowindex import RowColumns, decode_index
from rollkeep.core.custody.ledger import Ledger
from rollkeep.core.restore.start import Start, open_state
from rollkeep.core.rollout import rowstore
from rollkeep.core.rollout.rows import RowId
from rollkeep.core.rollout.rowstore import RowStore
from rollkeep.core.rowlog.segments import RowLocation

ROW = _row(2)
GROUPS = ["a", "b", "c"]


@pytest.fixture(autouse=True)
def columns_at_any_size(monkeypatch):
    """The store keeps columns only from `COLUMNS_FROM` located rows; here from the first."""
    monkeypatch.setattr(rowstore, "COLUMNS_FROM", 0)


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
@given(ops, st.sampled_from([1, 3, 4096]))
def test_what_the_columns_give_is_the_dicts_place_and_every_rows_place_is_found(script, batch):
    """Whatever is located, relocated, deleted, pinned and released (and however often the
    loop puts the queued places in): a gather finds only the dict's places, and finds the
    place of every held row whose generation no other attempt was ever located in (another
    attempt's place displaces it: then the dict alone has it)."""
    store = RowStore(reader=reader)
    pins: list = []
    attempts: dict[tuple, int] = {}  # (group, generation) -> attempts located in it
    with patch.object(rowstore, "_PUT_BATCH", batch):
        for op, rid, n in script:
            if op == "locate" and rid not in store:
                store.put(rid, ROW)
                store.locate(rid, loc_of(n))
                attempts[rid[:2]] = attempts.get(rid[:2], 0) + 1
            elif op == "relocate" and rid in store:  # a row's place never changes
                with pytest.raises(ValueError, match="in the row log already"):
                    store.locate(rid, RowLocation(7, 0, 12, 0))
                store.locate(rid, store.location(rid))  # the same place again: nothing happens
            elif op == "delete" and rid in store:
                store.delete(rid)
            elif op == "pin":
                pins.append(store.pin())
            elif op == "release" and pins:
                pins.pop().release()
            held = [rid for rid in (RowId(g, gen, att) for g in GROUPS for gen in (0, 1, 15, 16, 17, 40)
                                    for att in (0, 1, 2)) if store.location(rid) is not None]
            found = gathered(store, held)
            for rid, place in found.items():  # a deleted row stays readable while pinned: so does its place
                assert store.location(rid) == place, rid
            alone = [rid for rid in held if attempts[rid[:2]] == 1]
            assert all(rid in found for rid in alone), [rid for rid in alone if rid not in found]
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


def index_of(rids: list[RowId]) -> RowColumns:
    """A checkpoint's index of `rids`, row i at loc_of(i)."""
    places = [loc_of(i) for i in range(len(rids))]
    return RowColumns.per_entry([r.group_id for r in rids], np.array([r.generation for r in rids], np.int32),
                      np.array([r.attempt for r in rids], np.int32), np.zeros(len(rids), np.int32),
                      *(np.array([getattr(p, f) for p in places], dtype) for f, dtype in (
                          ("segment", np.int32), ("offset", np.uint64), ("length", np.uint64), ("checksum", np.uint64))))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(GROUPS), st.integers(0, 70), st.integers(0, 3), st.booleans()),
                unique_by=lambda t: t[:2], max_size=60))
def test_a_restore_fills_the_columns_from_the_index_less_the_rows_its_tail_freed(entries):
    """A restore hands the store its checkpoint's index as columns and the rows a journal's
    tail freed since: the columns then hold exactly the dict's places, and the rows leave
    them as they are deleted, as if each had been located."""
    rids = [RowId(g, gen, att) for g, gen, att, _ in entries]
    gone = [rid for rid, (*_, freed) in zip(rids, entries, strict=True) if freed]
    kept = {tuple(rid): loc_of(i) for i, rid in enumerate(rids) if rid not in gone}
    store = RowStore(reader=reader)
    store.restore(kept, index_of(rids), gone)
    assert gathered(store, rids) == kept and len(store._located) == len(kept)
    for rid in kept:
        store.delete(RowId(*rid))
    assert not len(store._located) and not store._located._base
    for i, rid in enumerate(rids):  # the blocks the restore laid out are handed out again
        store.put(rid, ROW)
        store.locate(rid, loc_of(i + 1))
    assert gathered(store, rids) == {rid: loc_of(i + 1) for i, rid in enumerate(rids)}


def test_the_columns_are_filled_once_and_each_generation_once():
    rids = [RowId("a", 3, 0), RowId("b", 20, 1)]
    store = RowStore(reader=reader)
    store.restore({tuple(r): loc_of(i) for i, r in enumerate(rids)}, index_of(rids))
    with pytest.raises(ValueError, match="empty table"):
        store._located.fill(index_of(rids))
    with pytest.raises(ValueError, match="two places for one group's generation"):
        RowStore(reader=reader).restore({}, index_of([RowId("a", 3, 0), RowId("a", 3, 1)]))


def test_a_restart_hands_the_store_its_checkpoints_index_less_what_the_tail_freed(tmp_path):
    """`open_state`: the restored checkpoint's index fills the columns, the rows its journal
    tail freed leave them, and a row the tail sealed is held by its place in the dict only."""
    ckpt = [RowId(g, gen, 0) for g in GROUPS for gen in (0, 1, 20)]
    freed, sealed = ckpt[:4], RowId("d", 2, 1)
    at = {tuple(rid): loc_of(i) for i, rid in enumerate(ckpt)}
    later = {rid: loc for rid, loc in at.items() if RowId(*rid) not in freed} | {tuple(sealed): loc_of(99)}
    restored = SimpleNamespace(rows=at, located=index_of(ckpt), prefixes={}, effects={})
    tail = SimpleNamespace(rows=later, prefixes={}, state=Ledger(n_rows=4, seed=0, epochs=1).capture())
    _, store, _ = open_state(tmp_path, Start(restored, tail, next_seq=1, stale=False), source=None)
    assert gathered(store, ckpt) == {rid: loc for rid, loc in later.items() if rid != tuple(sealed)}
    assert len(store._located) == len(ckpt) - len(freed) and store.location(sealed) == loc_of(99)


def test_the_store_keeps_columns_only_from_columns_from_located_rows(monkeypatch):
    """Below `COLUMNS_FROM` located rows a row's place is in the dict only (a checkpoint
    looks it up, cheaply at that size); from the first time it holds that many, every
    place is in the columns too, those located before included."""
    monkeypatch.setattr(rowstore, "COLUMNS_FROM", 10)
    store = RowStore(reader=reader)
    rids = [RowId(g, gen, 0) for g in GROUPS for gen in range(8)]
    for i, rid in enumerate(rids):
        store.put(rid, ROW)
        store.locate(rid, loc_of(i))
        if i == 8:
            assert gathered(store, rids[:9]) == {} and not store._located
    assert gathered(store, rids) == {rid: loc_of(i) for i, rid in enumerate(rids)}
    for rid in rids:
        store.delete(rid)
    assert not store._located


def test_a_frame_too_long_for_the_length_field_stays_in_the_dict_only():
    store = RowStore(reader=reader)
    long, short = RowId("a", 0, 0), RowId("b", 1, 0)
    for rid, loc in ((long, RowLocation(0, 0, 2**33, 1)), (short, loc_of(1))):
        store.put(rid, ROW)
        store.locate(rid, loc)
    assert gathered(store, [long, short]) == {short: loc_of(1)} and "a" not in store._located._base
    assert store.location(long) == RowLocation(0, 0, 2**33, 1)

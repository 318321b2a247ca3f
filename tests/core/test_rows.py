"""Rows: the immutable Row, the RowStore (idempotent put, pins that defer deletes) and the
rows.safetensors codec (round trip, and a RowsMismatch naming the field for every kind of
corruption)."""

from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from rollkeep.core.checkpoint.rowcodec import decode_rows, encode_rows
from rollkeep.core.errors import CustodyError, RowsMismatch
from rollkeep.core.rollout.rows import FINISH_REASONS, Row, RowId
from rollkeep.core.rollout.rowstore import RowPin, RowStore

TENSORS = [
    "prompt_ids",
    "completion_ids",
    "logprobs",
    "versions",
    "prompt_offsets",
    "completion_offsets",
    "reward",
    "finish_reason",
    "generation",
    "attempt",
]


def make_row(
    prompt=(1, 2, 3),
    completion=(4, 5),
    logprobs=None,
    versions=None,
    reward=1.0,
    finish_reason="stop",
) -> Row:
    def arr(values, dtype):  # an ndarray passes unchanged, so tests can send a wrong dtype
        return values if isinstance(values, np.ndarray) else np.asarray(values, dtype)

    completion = arr(completion, np.int32)
    if logprobs is None:
        logprobs = -0.5 * np.arange(1, len(completion) + 1, dtype=np.float32)
    if versions is None:
        versions = np.full(len(completion), 2, np.int32)
    return Row(
        arr(prompt, np.int32),
        completion,
        arr(logprobs, np.float32),
        arr(versions, np.int32),
        reward,
        finish_reason,
    )


def sample_rows() -> dict[RowId, Row]:
    """Four rows with distinct lengths, one with an empty completion."""
    return {
        RowId("e0.0", 0, 0): make_row((1, 2, 3), (4, 5, 6), reward=0.25),
        RowId("e0.0", 1, 2): make_row((1, 2, 3), (), reward=-1.0, finish_reason="length"),
        RowId("e0.7", 0, 0): make_row((9,), (10, 11, 12, 13), versions=(0, 0, 1, 1)),
        RowId("e1.3", 3, 1): make_row((7, 8), (14,), reward=0.0, finish_reason="length"),
    }


def split(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """A rows file's tensors (writable copies) and metadata."""
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    return {k: np.array(v) for k, v in st_load(data).items()}, dict(meta)


def raw_file(header: dict, body: bytes) -> bytes:
    """A safetensors file from an arbitrary header, for tampering safetensors won't write."""
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + body


def rows_mismatch(data: bytes, path: str = "ckpt/rows.safetensors") -> RowsMismatch:
    with pytest.raises(RowsMismatch) as info:
        decode_rows(data, path=path)
    assert info.value.path == path
    assert path in str(info.value)
    return info.value


GOOD = encode_rows(sample_rows().items())


# --- Row --------------------------------------------------------------------------------


def test_row_arrays_are_read_only_and_the_record_frozen():
    row = make_row()
    for name in ("prompt_ids", "completion_ids", "logprobs", "versions"):
        arr = getattr(row, name)
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.reward = 2.0  # type: ignore[misc]
    assert row.tokens == 2


def test_row_copies_writable_input_so_later_writes_do_not_reach_it():
    prompt = np.array([1, 2, 3], np.int32)
    row = Row(
        prompt,
        np.array([4], np.int32),
        np.array([-1.0], np.float32),
        np.array([0], np.int32),
        1.0,
        "stop",
    )
    prompt[0] = 99
    assert row.prompt_ids.tolist() == [1, 2, 3]
    assert prompt.flags.writeable  # the caller's array is left alone


def test_row_copies_a_read_only_view_of_writable_memory_but_not_frozen_memory():
    base = np.array([1, 2, 3, 4], np.int32)
    view = base[:2]
    view.flags.writeable = False
    frozen = np.array([5, 6], np.int32)
    frozen.flags.writeable = False
    row = Row(view, frozen, np.zeros(2, np.float32), np.zeros(2, np.int32), 0.0, "stop")
    base[0] = 42
    assert row.prompt_ids.tolist() == [1, 2]
    assert row.completion_ids is frozen


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": np.array([1, 2], np.int64)}, "prompt_ids must have dtype int32"),
        ({"logprobs": np.zeros(2, np.float64)}, "logprobs must have dtype float32"),
        ({"completion": [[1, 2]]}, "completion_ids must be 1-D"),
        ({"logprobs": [-1.0]}, "logprobs has length 1"),
        ({"versions": [0, 0, 0]}, "versions has length 3"),
        ({"versions": [0, -2]}, r"versions must be >= 0 \(or -1"),
        ({"prompt": [-5]}, "prompt_ids must be non-negative"),
        ({"reward": True}, "reward must be a float"),
        ({"reward": "1.0"}, "reward must be a float"),
        ({"finish_reason": "eos"}, "finish_reason must be one of"),
    ],
)
def test_row_construction_rejects_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_row(**kwargs)


def test_row_rejects_a_list_where_an_array_belongs():
    with pytest.raises(ValueError, match="prompt_ids must be a numpy array"):
        Row(
            [1, 2],
            np.zeros(0, np.int32),
            np.zeros(0, np.float32),
            np.zeros(0, np.int32),
            0.0,
            "stop",
        )


def test_row_equality_compares_contents_and_rows_are_unhashable():
    assert make_row() == make_row()
    assert make_row().equal(make_row())
    assert make_row(reward=np.float32(1.0)).reward == 1.0
    assert make_row(reward=float("nan")) == make_row(reward=float("nan"))
    for change in (
        {"prompt": (1, 2)},
        {"completion": (4, 6)},
        {"logprobs": (-0.5, -1.5)},
        {"versions": (2, 3)},
        {"reward": 1.5},
        {"finish_reason": "length"},
    ):
        assert make_row() != make_row(**change), change
    assert make_row() != "a row"
    with pytest.raises(TypeError):
        hash(make_row())


# --- RowStore ---------------------------------------------------------------------------


def test_store_put_get_and_counts():
    store = RowStore()
    rows = sample_rows()
    for rid, row in rows.items():
        store.put(rid, row)
    assert len(store) == 4
    assert list(store.ids()) == list(rows)
    assert store.resident() == 4
    rid = RowId("e0.7", 0, 0)
    assert store.get(rid) is rows[rid]
    assert rid in store and ("e0.7", 0, 0) in store
    assert RowId("e9.9", 0, 0) not in store
    with pytest.raises(KeyError):
        store.get(RowId("e9.9", 0, 0))


def test_duplicate_put_with_the_same_content_is_a_no_op():
    store = RowStore()
    first = make_row()
    store.put(RowId("e0.0", 0, 0), first)
    store.put(("e0.0", 0, 0), make_row())  # equal content, another object
    assert len(store) == 1
    assert store.get(RowId("e0.0", 0, 0)) is first


def test_conflicting_put_raises_and_changes_nothing():
    store = RowStore()
    rid = RowId("e0.0", 0, 0)
    store.put(rid, make_row(reward=1.0))
    with pytest.raises(CustodyError, match="Conflicting seal"):
        store.put(rid, make_row(reward=0.0))
    assert store.get(rid).reward == 1.0
    assert len(store) == 1


@pytest.mark.parametrize(
    "bad_id",
    [
        ("e0.0", 0),
        ("", 0, 0),
        (3, 0, 0),
        ("e0.0", -1, 0),
        ("e0.0", 0, 2**31),
        ("e0.0", True, 0),
        ("e0.0", 0, 1.0),
    ],
)
def test_put_rejects_malformed_row_ids(bad_id):
    store = RowStore()
    with pytest.raises(ValueError, match="row id"):
        store.put(bad_id, make_row())
    assert len(store) == 0


def test_put_rejects_non_rows():
    with pytest.raises(ValueError, match="needs a Row"):
        RowStore().put(RowId("e0.0", 0, 0), {"prompt_ids": []})


def test_delete_without_pins_removes_at_once():
    store = RowStore()
    rid = RowId("e0.0", 0, 0)
    store.put(rid, make_row())
    store.delete(rid)
    assert rid not in store and len(store) == 0 and store.resident() == 0
    with pytest.raises(KeyError):
        store.get(rid)
    with pytest.raises(KeyError):
        store.delete(rid)


def test_pin_defers_delete_and_the_last_release_applies_it():
    store = RowStore()
    rows = sample_rows()
    for rid, row in rows.items():
        store.put(rid, row)
    gone = RowId("e0.7", 0, 0)
    first, second = store.pin(), store.pin()
    assert store.pins == 2
    store.delete(gone)
    # Logically gone at once ...
    assert gone not in store and len(store) == 3
    assert gone not in set(store.ids())
    with pytest.raises(KeyError):
        store.delete(gone)  # a second delete is still an error
    # ... but still readable by the checkpoint writer.
    assert store.get(gone) is rows[gone]
    assert first.get(gone) is rows[gone]
    first.release()
    first.release()  # idempotent: must not release the second pin's hold
    assert store.pins == 1
    assert store.get(gone) is rows[gone]
    with pytest.raises(CustodyError, match="after the pin was released"):
        first.get(gone)
    with second:
        pass
    assert second.released and store.pins == 0
    with pytest.raises(KeyError):
        store.get(gone)
    assert len(store) == 3


def test_put_again_after_a_deferred_delete():
    store = RowStore()
    rid = RowId("e0.0", 0, 0)
    store.put(rid, make_row())
    with store.pin() as pin:
        assert isinstance(pin, RowPin)
        store.delete(rid)
        with pytest.raises(CustodyError):  # the writer may still read the old content
            store.put(rid, make_row(reward=5.0))
        store.put(rid, make_row())  # the same content: undeletes
        assert rid in store and len(store) == 1
    assert store.get(rid) == make_row()  # the release did not remove it


def test_writer_thread_reads_pinned_rows_while_the_loop_thread_mutates():
    """The checkpoint writer encodes the rows it captured while the loop thread deletes
    them and inserts enough new rows to resize the dict; no sleeps, explicit ordering."""
    store = RowStore()
    captured = {RowId(f"e0.{i}", 0, 0): make_row(completion=(i, i + 1)) for i in range(50)}
    for rid, row in captured.items():
        store.put(rid, row)
    pin = store.pin()
    ids = list(captured)  # what the cut captured
    mutated = threading.Event()
    result: dict[str, bytes] = {}

    def writer() -> None:
        mutated.wait()
        result["data"] = encode_rows((rid, pin.get(rid)) for rid in ids)

    thread = threading.Thread(target=writer)
    thread.start()
    for rid in ids:
        store.delete(rid)
    for i in range(5000):
        store.put(RowId(f"e1.{i}", 0, 0), make_row())
    mutated.set()
    thread.join()
    pin.release()
    assert decode_rows(result["data"]) == captured
    assert len(store) == 5000 and not any(rid in store for rid in ids)
    with pytest.raises(KeyError):
        store.get(ids[0])


# --- codec: round trip -------------------------------------------------------------------

int32s = st.integers(0, 2**31 - 1)
ids_strategy = st.builds(RowId, st.text(min_size=1, max_size=8), int32s, int32s)


@st.composite
def rows_strategy(draw) -> Row:
    prompt = draw(st.lists(int32s, max_size=12))
    n = draw(st.integers(0, 12))
    return Row(
        np.array(prompt, np.int32),
        np.array(draw(st.lists(int32s, min_size=n, max_size=n)), np.int32),
        np.array(draw(st.lists(st.floats(width=32), min_size=n, max_size=n)), np.float32),
        np.array(draw(st.lists(int32s, min_size=n, max_size=n)), np.int32),
        draw(st.floats()),
        draw(st.sampled_from(FINISH_REASONS)),
    )


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(ids_strategy, rows_strategy(), max_size=8))
def test_round_trip(rows):
    decoded = decode_rows(encode_rows(rows.items()))
    assert list(decoded) == list(rows)  # same ids, same order
    assert all(type(rid) is RowId for rid in decoded)
    for rid, row in rows.items():
        assert decoded[rid] == row
        for name in ("prompt_ids", "completion_ids", "logprobs", "versions"):
            assert not getattr(decoded[rid], name).flags.writeable


def test_round_trip_zero_rows():
    data = encode_rows([])
    assert decode_rows(data) == {}
    tensors, meta = split(data)
    assert meta == {"rows_schema": "1", "group_ids": "[]"}
    assert tensors["prompt_offsets"].tolist() == [0]


def test_round_trip_empty_prompts_and_completions_only():
    rows = {RowId("e0.0", g, 0): make_row(prompt=(), completion=()) for g in range(3)}
    assert decode_rows(encode_rows(rows.items())) == rows


def test_round_trip_from_a_store_with_exact_layout():
    store = RowStore()
    for rid, row in sample_rows().items():
        store.put(rid, row)
    data = encode_rows((rid, store.get(rid)) for rid in store.ids())
    tensors, meta = split(data)
    assert sorted(tensors) == sorted(TENSORS)
    assert tensors["prompt_offsets"].tolist() == [0, 3, 6, 7, 9]
    assert tensors["completion_offsets"].tolist() == [0, 3, 3, 7, 8]
    assert tensors["finish_reason"].tolist() == [0, 1, 0, 1]
    assert json.loads(meta["group_ids"]) == ["e0.0", "e0.0", "e0.7", "e1.3"]
    assert decode_rows(data) == sample_rows()


def test_encode_rejects_duplicate_ids_and_non_rows():
    row = make_row()
    with pytest.raises(ValueError, match="more than once"):
        encode_rows([(RowId("e0.0", 0, 0), row), (RowId("e0.0", 0, 0), row)])
    with pytest.raises(ValueError, match="needs Row values"):
        encode_rows([(RowId("e0.0", 0, 0), "row")])


# --- codec: corruption -------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"1234567",
        b"hello, this is not safetensors",
        bytes(64),
        b"\xff" * 64,
        GOOD[:-1],
        GOOD[:20],
        GOOD + b"x",
    ],
    # Named, not shown: safetensors writes the metadata map in an order that differs from
    # process to process, so ids made of GOOD's bytes differ between xdist workers.
    ids=["empty", "7 bytes", "text", "zeros", "ones", "last byte cut", "header cut", "a byte more"],
)
def test_bytes_that_are_not_a_rows_file(data):
    err = rows_mismatch(data)
    assert err.field is None


def test_header_that_is_not_json():
    rows_mismatch((10).to_bytes(8, "little") + b"{not json}")
    rows_mismatch((6).to_bytes(8, "little") + b"[1, 2]")


@pytest.mark.parametrize("name", TENSORS)
def test_wrong_dtype_names_the_tensor(name):
    tensors, meta = split(GOOD)
    tensors[name] = tensors[name].astype(np.int16)
    err = rows_mismatch(st_save(tensors, metadata=meta))
    assert err.field == name and "dtype" in err.what


@pytest.mark.parametrize("name", TENSORS)
def test_wrong_rank_names_the_tensor(name):
    tensors, meta = split(GOOD)
    tensors[name] = tensors[name][None, :]
    err = rows_mismatch(st_save(tensors, metadata=meta))
    assert err.field == name and "rank" in err.what


@pytest.mark.parametrize("name", TENSORS)
def test_truncated_tensor_names_the_tensor(name):
    tensors, meta = split(GOOD)
    tensors[name] = tensors[name][:-1]
    err = rows_mismatch(st_save(tensors, metadata=meta))
    assert err.field == name


@pytest.mark.parametrize("name", TENSORS)
def test_missing_tensor_names_it(name):
    tensors, meta = split(GOOD)
    del tensors[name]
    err = rows_mismatch(st_save(tensors, metadata=meta))
    assert err.field == name and "missing" in err.what


def test_unknown_tensor_names_it():
    tensors, meta = split(GOOD)
    tensors["advantages"] = np.zeros(4, np.float32)
    err = rows_mismatch(st_save(tensors, metadata=meta))
    assert err.field == "advantages"


@pytest.mark.parametrize(
    ("name", "tamper", "fields"),
    [
        ("prompt_offsets", lambda o: o.__setitem__(0, 1), {"prompt_offsets"}),
        ("completion_offsets", lambda o: o.__setitem__(0, -1), {"completion_offsets"}),
        ("prompt_offsets", lambda o: o.__setitem__(2, 1), {"prompt_offsets"}),
        ("completion_offsets", lambda o: o.__setitem__(3, 1), {"completion_offsets"}),
        ("completion_offsets", lambda o: o.__setitem__(-1, 100), {"completion_offsets"}),
        ("completion_offsets", lambda o: o.__setitem__(-1, 7), {"completion_offsets"}),
        # Two voters only: the offsets or the flat array may take the blame.
        ("prompt_offsets", lambda o: o.__setitem__(-1, 10), {"prompt_offsets", "prompt_ids"}),
    ],
)
def test_bad_offsets(name, tamper, fields):
    tensors, meta = split(GOOD)
    tamper(tensors[name])
    err = rows_mismatch(st_save(tensors, metadata=meta))
    assert err.field in fields


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("finish_reason", 2),
        ("versions", -2),
        ("generation", -3),
        ("attempt", -1),
        ("prompt_ids", -7),
        ("completion_ids", -2),
    ],
)
def test_bad_values_name_the_tensor(name, value):
    tensors, meta = split(GOOD)
    tensors[name][0] = value
    err = rows_mismatch(st_save(tensors, metadata=meta))
    assert err.field == name


@pytest.mark.parametrize(
    ("meta_change", "field"),
    [
        ({"rows_schema": None}, "rows_schema"),
        ({"rows_schema": "2"}, "rows_schema"),
        ({"group_ids": None}, "group_ids"),
        ({"group_ids": "not json"}, "group_ids"),
        ({"group_ids": '{"a": 1}'}, "group_ids"),
        ({"group_ids": '["e0.0", "e0.0", 7, "e1.3"]'}, "group_ids"),
        ({"group_ids": '["e0.0", "e0.0", "", "e1.3"]'}, "group_ids"),
        ({"group_ids": '["e0.0", "e0.0", "e0.7"]'}, "group_ids"),
        ({"group_ids": '["e0.0", "e0.0", "e0.7", "e1.3", "e2.0"]'}, "group_ids"),
        ({"owner": "me"}, "owner"),
    ],
)
def test_metadata_tampering(meta_change, field):
    tensors, meta = split(GOOD)
    for key, value in meta_change.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    err = rows_mismatch(st_save(tensors, metadata=meta))
    assert err.field == field


def test_no_metadata_at_all():
    tensors, _ = split(GOOD)
    assert rows_mismatch(st_save(tensors)).field == "rows_schema"


def test_metadata_that_is_not_a_map():
    header = {"__metadata__": ["rows_schema", "1"]}
    assert rows_mismatch(raw_file(header, b"")).field == "__metadata__"


def test_duplicate_row_ids():
    tensors, meta = split(GOOD)
    tensors["generation"][1] = 0
    tensors["attempt"][1] = 0  # row 1 now claims row 0's id ("e0.0", 0, 0)
    err = rows_mismatch(st_save(tensors, metadata=meta))
    assert "Duplicate" in err.what and "('e0.0', 0, 0)" in str(err)


def test_default_path_is_named():
    with pytest.raises(RowsMismatch, match=r"File: rows\.safetensors\."):
        decode_rows(b"junk")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_corrupted_byte_gives_rows_or_rows_mismatch(data):
    """Flip one byte anywhere: decoding either succeeds or raises RowsMismatch, never
    anything else."""
    buf = bytearray(GOOD)
    i = data.draw(st.integers(0, len(buf) - 1))
    buf[i] ^= data.draw(st.integers(1, 255))
    try:
        rows = decode_rows(bytes(buf))
    except RowsMismatch:
        return
    assert len(rows) == 4

"""Tests for the prompt source: permutation, visit order, resume, datasets, fingerprints."""

from __future__ import annotations

import itertools
import json
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkeep.core.custody.keys import Key, exhausted, next_key
from rollkeep.core.errors import CustodyError, DatasetError, UserInputError
from rollkeep.core.rollout.datasets import (
    JsonlDataset,
    SequenceDataset,
    load_dataset,
    row_fingerprint,
)
from rollkeep.core.rollout.permutation import permutation
from rollkeep.core.rollout.source import PromptSource

MASK = 2**64 - 1
G = 0x9E3779B97F4A7C15


def rows(n: int, **extra) -> SequenceDataset:
    return SequenceDataset([{"prompt": f"p{i}", "answer": i, **extra} for i in range(n)])


def write_jsonl(path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


# --- permutation -----------------------------------------------------------------------------


def reference_permutation(seed: int, epoch: int, n: int) -> list[int]:
    """The documented formula, in plain Python ints, independent of numpy."""

    def mix(z: int) -> int:
        z &= MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    stream = mix(mix(seed) + G * (epoch + 1))
    hashes = [mix(stream + G * (i + 1)) for i in range(n)]
    return sorted(range(n), key=lambda i: hashes[i])


@pytest.mark.parametrize("n", [0, 1, 2, 17, 1000])
def test_permutation_is_a_permutation(n):
    perm = permutation(3, 1, n)
    assert perm.dtype == np.int64
    assert sorted(perm.tolist()) == list(range(n))


def test_permutation_is_deterministic_and_varies_with_seed_and_epoch():
    base = permutation(42, 0, 100)
    assert np.array_equal(base, permutation(42, 0, 100))
    assert not np.array_equal(base, permutation(42, 1, 100))
    assert not np.array_equal(base, permutation(43, 0, 100))


@pytest.mark.parametrize(("seed", "epoch", "n"), [(0, 0, 50), (12345, 3, 64), (2**63 - 1, 9, 33)])
def test_permutation_matches_pure_python_formula(seed, epoch, n):
    assert permutation(seed, epoch, n).tolist() == reference_permutation(seed, epoch, n)


def test_permutation_pinned_values():
    # The permutation is part of the checkpoint format: these values were computed once
    # from the documented formula and pinned. If this fails, the formula changed and every
    # existing checkpoint would name different rows. Do not update the values; revert.
    assert permutation(0, 0, 10).tolist() == [5, 7, 8, 2, 9, 0, 3, 1, 6, 4]
    assert permutation(12345, 3, 8).tolist() == [7, 3, 4, 6, 2, 0, 1, 5]
    assert permutation(2**63 - 1, 100, 6).tolist() == [5, 1, 4, 3, 2, 0]


def test_row_fingerprint_pinned_and_canonical():
    # Part of the checkpoint format, pinned like the permutation.
    assert row_fingerprint({"prompt": "hi", "task": "math", "answer": 4}) == 14103398889588054288
    assert row_fingerprint({"prompt": "héllo ✓"}) == 1298599699679451992
    # Canonical: field order does not matter, any value change does.
    assert row_fingerprint({"answer": 4, "task": "math", "prompt": "hi"}) == 14103398889588054288
    assert row_fingerprint({"prompt": "hi", "task": "math", "answer": 5}) != 14103398889588054288


def test_row_fingerprint_rejects_non_json_values():
    with pytest.raises(DatasetError, match="JSON"):
        row_fingerprint({"prompt": "x", "blob": object()})


# --- visit order and resume ------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 25),
    seed=st.integers(0, 2**63 - 1),
    epochs=st.integers(0, 4),
    data=st.data(),
)
def test_resume_from_any_cut_continues_the_uninterrupted_sequence(n, seed, epochs, data):
    source = PromptSource(rows(n), seed=seed, epochs=epochs)
    full = list(source.keys_from(Key(0, 0)))
    assert len(full) == n * epochs
    # The ledger's cursor walks the same sequence.
    walked, key = [], Key(0, 0)
    while not exhausted(key, epochs):
        walked.append(key)
        key = next_key(key, n)
    assert walked == full

    cut = data.draw(st.integers(0, len(full)), label="cut")
    cursor = full[cut] if cut < len(full) else Key(epochs, 0)
    # A fresh source (a restarted process) resumes from the cursor alone.
    resumed = PromptSource(rows(n), seed=seed, epochs=epochs)
    tail = list(resumed.keys_from(cursor))
    assert tail == full[cut:]
    assert exhausted(cursor, epochs) == (cut == len(full))
    assert [resumed.idx(k) for k in tail] == [source.idx(k) for k in full[cut:]]

    # Every row is visited exactly once per epoch.
    per_epoch = Counter((k.epoch, source.idx(k)) for k in full)
    assert set(per_epoch.values()) <= {1}
    assert set(per_epoch) == {(e, i) for e in range(epochs) for i in range(n)}


def test_visit_order_follows_permutation():
    source = PromptSource(rows(7), seed=5, epochs=2)
    for epoch in range(2):
        perm = permutation(5, epoch, 7).tolist()
        assert [source.idx(Key(epoch, o)) for o in range(7)] == perm


def test_unbounded_source_rolls_over_epochs_forever():
    source = PromptSource(rows(3), seed=1, epochs=None)
    keys = list(itertools.islice(source.keys_from(Key(0, 1)), 8))
    assert keys == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert next_key(Key(1000, 2), 3) == Key(1001, 0)
    assert not exhausted(Key(10**6, 0), None)


def test_exhaustion():
    source = PromptSource(rows(3), seed=1, epochs=2)
    assert next_key(Key(0, 2), 3) == Key(1, 0)
    assert next_key(Key(1, 2), 3) == Key(2, 0) and exhausted(Key(2, 0), 2)
    assert not exhausted(Key(1, 2), 2)
    assert list(source.keys_from(Key(2, 0))) == []
    assert list(source.keys_from(Key(1, 2))) == [Key(1, 2)]


def test_zero_epochs_is_exhausted_from_the_start():
    source = PromptSource(rows(3), seed=1, epochs=0)
    assert exhausted(Key(0, 0), 0)
    assert list(source.keys_from(Key(0, 0))) == []


@pytest.mark.parametrize("key", [Key(2, 0), Key(0, 3), Key(-1, 0), Key(0, -1)])
def test_keys_outside_the_source_are_refused(key):
    source = PromptSource(rows(3), seed=1, epochs=2)
    with pytest.raises(CustodyError):
        source.idx(key)


def test_cursor_with_ordinal_past_the_epoch_is_refused():
    source = PromptSource(rows(3), seed=1, epochs=2)
    with pytest.raises(CustodyError):
        next(source.keys_from(Key(0, 3)))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seed": -1, "epochs": 1}, "seed"),
        ({"seed": 2**63, "epochs": 1}, "seed"),
        ({"seed": 1.5, "epochs": 1}, "seed"),
        ({"seed": True, "epochs": 1}, "seed"),
        ({"seed": 0, "epochs": -1}, "epochs"),
        ({"seed": 0, "epochs": 2.0}, "epochs"),
    ],
)
def test_constructor_validates_arguments(kwargs, field):
    with pytest.raises(UserInputError) as info:
        PromptSource(rows(2), **kwargs)
    assert info.value.field == field


def test_properties():
    source = PromptSource(rows(4), seed=9, epochs=None)
    assert (source.n_rows, source.seed, source.epochs) == (4, 9, None)


def test_permutation_cache_holds_at_most_two_epochs():
    source = PromptSource(rows(5), seed=1, epochs=None)
    for epoch in range(6):
        source.idx(Key(epoch, 0))
    assert len(source._perms) <= 2


# --- rehydrate and describe ------------------------------------------------------------------


def test_rehydrate_is_stable_and_passes_fields_through():
    data = SequenceDataset(
        [{"prompt": "a", "answer": 1}, {"prompt": "b", "task": "math", "answer": 2, "meta": [1]}]
    )
    source = PromptSource(data, seed=3, epochs=3)
    for key in source.keys_from(Key(0, 0)):
        p1, p2 = source.rehydrate(key), source.rehydrate(key)
        assert p1 == p2
        row = data[p1.idx]
        assert p1.key == key and p1.group_id == f"e{key.epoch}.{key.ordinal}"
        assert p1.prompt == row["prompt"]
        assert dict(p1.row) == row
        assert p1.task == row.get("task", "default")
        assert p1.row_fingerprint == row_fingerprint(row)
        ref = source.describe(key)
        assert (ref.key, ref.group_id, ref.idx, ref.task, ref.row_fingerprint) == (
            p1.key,
            p1.group_id,
            p1.idx,
            p1.task,
            p1.row_fingerprint,
        )
    with pytest.raises(TypeError):
        p1.row["prompt"] = "changed"  # the row is a read-only view


def test_records_are_frozen():
    ref = PromptSource(rows(2), seed=0, epochs=1).describe(Key(0, 0))
    with pytest.raises(AttributeError):
        ref.idx = 5


def test_raw_sequence_rows_are_checked_when_used():
    source = PromptSource([{"prompt": "ok"}, {"text": "no prompt"}], seed=0, epochs=1)
    bad = next(k for k in source.keys_from(Key(0, 0)) if source.idx(k) == 1)
    with pytest.raises(DatasetError, match="index 1"):
        source.rehydrate(bad)


# --- datasets --------------------------------------------------------------------------------


def test_jsonl_loads_rows_and_ignores_trailing_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b\u2028c", "task": "t", "x": 1}\n\n  \n')
    ds = load_dataset(path)
    assert isinstance(ds, JsonlDataset)
    assert len(ds) == 2
    assert ds[1] == {"prompt": "b\u2028c", "task": "t", "x": 1}


@pytest.mark.parametrize(
    ("bad_line", "what", "field"),
    [
        ("{not json", "not JSON", None),
        ("[1, 2]", "not an object", None),
        ('{"task": "t"}', "no `prompt`", "prompt"),
        ('{"prompt": 3}', "`prompt` is not a string", "prompt"),
        ('{"prompt": "p", "task": null}', "`task` is not a string", "task"),
        ("", "blank line", None),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, bad_line, what, field):
    path = tmp_path / "data.jsonl"
    write_jsonl(
        path, ['{"prompt": "fine"}', '{"prompt": "also fine"}', bad_line, '{"prompt": "z"}']
    )
    with pytest.raises(DatasetError) as info:
        load_dataset(path)
    err = info.value
    message = str(err)
    assert "line 3 " in message and str(path) in message and what in message
    assert err.path == str(path)
    assert err.field == field
    assert err.expected and err.found and err.remedy


def test_jsonl_not_utf8(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DatasetError, match="line 2 .*not UTF-8"):
        load_dataset(path)


def test_empty_and_missing_jsonl(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DatasetError, match="empty"):
        load_dataset(empty)
    with pytest.raises(DatasetError, match="Cannot read"):
        load_dataset(tmp_path / "missing.jsonl")


def test_unknown_extension(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt\nx\n")
    with pytest.raises(UserInputError, match="Unknown dataset format"):
        load_dataset(path)


def test_parquet_without_datasets_library(tmp_path, monkeypatch):
    # `datasets` is an optional extra; make it unimportable even where it is installed.
    monkeypatch.setitem(sys.modules, "datasets", None)
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(UserInputError, match=r"pip install 'rollkeep\[data\]'") as info:
        load_dataset(path)
    assert not isinstance(info.value, DatasetError)


@pytest.mark.parametrize(
    ("bad_row", "field"),
    [
        ("str row", None),
        ({"task": "t"}, "prompt"),
        ({"prompt": b"x"}, "prompt"),
        ({"prompt": "p", "task": 1}, "task"),
    ],
)
def test_sequence_dataset_errors_name_the_index(bad_row, field):
    with pytest.raises(DatasetError, match="index 1") as info:
        SequenceDataset([{"prompt": "ok"}, bad_row])
    assert info.value.field == field


def test_sequence_dataset_rejects_empty_and_unserializable():
    with pytest.raises(DatasetError, match="empty"):
        SequenceDataset([])
    with pytest.raises(DatasetError, match="index 0"):
        SequenceDataset([{"prompt": "p", "x": {1, 2}}])
    with pytest.raises(DatasetError, match="empty"):
        PromptSource([], seed=0, epochs=1)


# --- fingerprints and restore checks ---------------------------------------------------------


def test_edited_row_changes_fingerprint_and_check_ref_reports_it():
    original = [{"prompt": f"p{i}", "answer": i} for i in range(6)]
    edited = [dict(r) for r in original]
    edited[4]["answer"] = 99
    before = PromptSource(SequenceDataset(original), seed=7, epochs=2)
    after = PromptSource(SequenceDataset(edited), seed=7, epochs=2)

    key = next(k for k in before.keys_from(Key(1, 0)) if before.idx(k) == 4)
    ref = before.describe(key)
    assert after.describe(key).row_fingerprint != ref.row_fingerprint
    diff = after.check_ref(ref.key, ref.idx, ref.task, ref.row_fingerprint)
    assert diff is not None and "row_fingerprint" in diff and ref.group_id in diff
    assert "\n" not in diff

    # Unedited rows still check out, in the old and the new dataset.
    for other in before.keys_from(Key(0, 0)):
        r = before.describe(other)
        assert before.check_ref(r.key, r.idx, r.task, r.row_fingerprint) is None
        if r.idx != 4:
            assert after.check_ref(r.key, r.idx, r.task, r.row_fingerprint) is None
    assert before.fingerprint() != after.fingerprint()


def test_check_ref_reports_task_idx_and_range_changes():
    source = PromptSource(rows(6), seed=7, epochs=1)
    ref = source.describe(Key(0, 2))
    assert "task" in source.check_ref(ref.key, ref.idx, "other", ref.row_fingerprint)
    assert "idx" in source.check_ref(ref.key, (ref.idx + 1) % 6, ref.task, ref.row_fingerprint)
    shrunk = PromptSource(rows(2), seed=7, epochs=1)
    assert "ordinal" in shrunk.check_ref(Key(0, 5), 0, "default", 0)
    assert "epoch" in source.check_ref(Key(3, 0), 0, "default", 0)


def test_dataset_fingerprint_detects_reorder_and_shrink(tmp_path):
    base = [{"prompt": f"p{i}"} for i in range(5)]
    fp = PromptSource(SequenceDataset(base), seed=0, epochs=1).fingerprint()
    assert fp.startswith("5:") and len(fp.split(":")[1]) == 16
    # Same rows in a file give the same fingerprint; seed does not enter it.
    path = tmp_path / "d.jsonl"
    write_jsonl(path, [json.dumps(r) for r in base])
    assert PromptSource(load_dataset(path), seed=99, epochs=None).fingerprint() == fp

    reordered = [base[1], base[0], *base[2:]]
    assert PromptSource(SequenceDataset(reordered), seed=0, epochs=1).fingerprint() != fp
    assert PromptSource(SequenceDataset(base[:4]), seed=0, epochs=1).fingerprint().startswith("4:")
    assert PromptSource(SequenceDataset(base[:4]), seed=0, epochs=1).fingerprint() != fp


def test_dataset_fingerprint_is_computed_once():
    class Counting:
        def __init__(self):
            self.reads = 0

        def __len__(self):
            return 4

        def __getitem__(self, idx):
            self.reads += 1
            return {"prompt": str(idx)}

    data = Counting()
    source = PromptSource(data, seed=0, epochs=1)
    assert data.reads == 0  # lazy
    first = source.fingerprint()
    assert data.reads == 4
    assert source.fingerprint() == first
    assert data.reads == 4

"""The restore chain on whole checkpoints: every file damaged in every way is refused by
the right step, nothing on disk changes, and a good checkpoint restores what was cut."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest

from rollkeep.core import codec
from rollkeep.core.checkpoint import LEDGER_FILE, ROWS_FILE, cut, write_checkpoint
from rollkeep.core.errors import (
    CheckpointCustodyError,
    CheckpointError,
    CheckpointNotFound,
    ConfigMismatch,
    DatasetMismatch,
    LedgerDecodeError,
    ManifestMismatch,
    RowsMismatch,
)
from rollkeep.core.events import Admitted, Dispatched, Finalizing, Ready, Sealed
from rollkeep.core.ledger import Ledger
from rollkeep.core.restore import restore_chain
from rollkeep.core.rows import Row, RowId, RowStore
from rollkeep.core.source import PromptSource, SequenceDataset
from rollkeep.core.store import CheckpointStore
from rollkeep.core.take import take_event

G = 3
CONFIG = {"seed": 5, "rollout": {"group_size": G}, "train": {"num_prompts_per_step": 2}}


def rows_dataset(n: int = 10, edit: int | None = None) -> SequenceDataset:
    return SequenceDataset(
        [{"prompt": f"{i}+1=", "answer": i + 1 + (100 if i == edit else 0)} for i in range(n)]
    )


def row(seed: int) -> Row:
    r = np.random.default_rng(seed)
    n = int(r.integers(1, 6))
    return Row(
        prompt_ids=r.integers(0, 50, 4).astype(np.int32),
        completion_ids=r.integers(0, 50, n).astype(np.int32),
        logprobs=-r.random(n).astype(np.float32),
        versions=np.zeros(n, np.int32),
        reward=float(r.random()),
        finish_reason="stop",
    )


def build(source: PromptSource, salt: int = 0) -> tuple[Ledger, RowStore]:
    """e0.0 READY, e0.1 generating with sibling 0 sealed, e0.2 RESERVED."""
    led, store = Ledger(n_rows=source.n_rows, seed=source.seed, epochs=source.epochs), RowStore()
    for _ in range(3):
        led.apply(take_event(led, source, group_size=G))
    for gid, n_sealed in (("e0.0", G), ("e0.1", 1)):
        led.apply(Admitted(group_id=gid, target_step=1, version=0))
        led.apply(Dispatched(group_id=gid, generations=tuple(range(G)), version=0))
        for g in range(n_sealed):
            store.put(RowId(gid, g, 0), row(hash((gid, g, salt)) % 1000))
            led.apply(Sealed(group_id=gid, generation=g, attempt=0, version=0, tokens=3))
    led.apply(Finalizing(group_id="e0.0"))
    led.apply(Ready(group_id="e0.0", advantages=(1.0, 0.0, -1.0)))
    return led, store


def publish(root: Path, source: PromptSource, *, salt: int = 0) -> tuple[CheckpointStore, Ledger, RowStore]:
    led, rows = build(source, salt)
    store = CheckpointStore(root)
    meta = {"dataset": {"n_rows": source.n_rows, "seed": source.seed, "fingerprint": source.fingerprint()},
            "config": CONFIG}
    write_checkpoint(store, cut(led, rows), trainer_files={"model.bin": b"weights" * (10 + salt)},
                     meta=meta, keep_last=3)
    return store, led, rows


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def source() -> PromptSource:
    return PromptSource(rows_dataset(), seed=5, epochs=2)


def test_good_checkpoint_restores_what_was_cut(tmp_path, source) -> None:
    store, led, rows = publish(tmp_path / "checkpoints", source)
    r = restore_chain(store, source=source, config=CONFIG)
    assert codec.encode(r.ledger) == codec.encode(led.capture())
    assert set(r.rows) == {RowId("e0.0", g, 0) for g in range(G)} | {RowId("e0.1", 0, 0)}
    for rid, got in r.rows.items():
        assert got == rows.get(rid)
    assert r.trainer_file("model.bin") == b"weights" * 10
    assert r.plan.groups_reused == 1 and r.plan.siblings_reused == 1
    assert r.plan.siblings_regenerated == G - 1 and r.plan.groups_readmitted == 1


def test_no_checkpoint(tmp_path, source) -> None:
    with pytest.raises(CheckpointNotFound):
        restore_chain(CheckpointStore(tmp_path / "checkpoints"), source=source, config=CONFIG)


FILES = [LEDGER_FILE, ROWS_FILE, "trainer/model.bin", "MANIFEST.json"]


def damage(path: Path, how: str, other: Path) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        b = bytearray(data)
        b[len(b) // 2] ^= 0x40
        path.write_bytes(bytes(b))
    elif how == "delete":
        path.unlink()
    elif how == "swap":
        shutil.copyfile(other, path)


@pytest.mark.parametrize("how", ["truncate", "flip", "delete", "swap"])
@pytest.mark.parametrize("name", FILES)
def test_every_damaged_file_is_refused_and_nothing_changes(tmp_path, source, name, how) -> None:
    store, _, _ = publish(tmp_path / "a" / "checkpoints", source)
    # A second run's checkpoint of the same step, different content: the swap source.
    other_src = PromptSource(rows_dataset(), seed=6, epochs=2)
    publish(tmp_path / "b" / "checkpoints", other_src, salt=1)
    assert (tmp_path / "b" / "checkpoints" / "step_000000" / name).read_bytes() != (
        tmp_path / "a" / "checkpoints" / "step_000000" / name).read_bytes()
    ck = tmp_path / "a" / "checkpoints" / "step_000000"
    other = tmp_path / "b" / "checkpoints" / "step_000000" / name
    damage(ck / name, how, other)
    before = tree_digest(tmp_path / "a")
    with pytest.raises(CheckpointError) as err:
        restore_chain(store, source=source, config=CONFIG)
    assert isinstance(err.value, (ManifestMismatch, CheckpointNotFound))  # caught at steps 1-2
    if name == "MANIFEST.json" and how == "swap":
        # A whole manifest from another run is self-consistent: the first file it
        # describes wrongly is the one named.
        assert "wrong sha256" in str(err.value)
    else:
        assert name.split("/")[-1] in str(err.value)
    assert tree_digest(tmp_path / "a") == before


def republish_with(tmp_path: Path, source: PromptSource, name: str, mutate) -> CheckpointStore:
    """A checkpoint whose manifest is consistent but whose `name` content is bad: the
    deeper steps of the chain must catch it."""
    store, _, _ = publish(tmp_path / "src" / "checkpoints", source)
    ck = store.open()
    files = {f: ck.read(f) for f in ck.files()}
    files[name] = mutate(files[name])
    meta = {k: v for k, v in ck.manifest.items()
            if k not in ("manifest_schema", "name", "step", "created", "files", "manifest_sha256")}
    bad = CheckpointStore(tmp_path / "bad" / "checkpoints")
    bad.publish(0, files, meta, keep_last=None)
    return bad


def _ledger_doc(blob: bytes) -> dict:
    return msgspec.msgpack.decode(blob)


def test_step4_undecodable_ledger(tmp_path, source) -> None:
    bad = republish_with(tmp_path, source, LEDGER_FILE, lambda b: b[:-7])
    with pytest.raises(LedgerDecodeError):
        restore_chain(bad, source=source, config=CONFIG)


def test_step5_custody_violation(tmp_path, source) -> None:
    def two_owners(blob: bytes) -> bytes:
        doc = _ledger_doc(blob)
        doc["spare"] = [[0, 0]]  # e0.0 is also a group: two owners
        return msgspec.msgpack.encode(doc)

    bad = republish_with(tmp_path, source, LEDGER_FILE, two_owners)
    with pytest.raises(CheckpointCustodyError, match="two owners"):
        restore_chain(bad, source=source, config=CONFIG)


def test_step6_rows_missing(tmp_path, source) -> None:
    from rollkeep.core.rows import decode_rows, encode_rows

    def drop_one(blob: bytes) -> bytes:
        rows = decode_rows(blob)
        rows.pop(RowId("e0.1", 0, 0))
        return encode_rows(rows.items())

    bad = republish_with(tmp_path, source, ROWS_FILE, drop_one)
    with pytest.raises(RowsMismatch, match="1 missing"):
        restore_chain(bad, source=source, config=CONFIG)


def test_step6_rows_unreferenced(tmp_path, source) -> None:
    from rollkeep.core.rows import decode_rows, encode_rows

    def add_one(blob: bytes) -> bytes:
        rows = decode_rows(blob)
        rows[RowId("e0.2", 0, 0)] = row(1)
        return encode_rows(rows.items())

    bad = republish_with(tmp_path, source, ROWS_FILE, add_one)
    with pytest.raises(RowsMismatch, match="1 unreferenced"):
        restore_chain(bad, source=source, config=CONFIG)


def test_step7_edited_row_of_an_inflight_group(tmp_path, source) -> None:
    store, led, _ = publish(tmp_path / "checkpoints", source)
    idx = led.group("e0.1").idx
    edited = PromptSource(rows_dataset(edit=idx), seed=5, epochs=2)
    before = tree_digest(tmp_path)
    with pytest.raises(DatasetMismatch) as err:
        restore_chain(store, source=edited, config=CONFIG)
    assert "e0.1" in str(err.value)
    assert tree_digest(tmp_path) == before


def test_step7_edited_row_not_in_flight_needs_permission(tmp_path, source) -> None:
    store, led, _ = publish(tmp_path / "checkpoints", source)
    inflight = {r.idx for _, r in led.groups()}
    idx = next(i for i in range(source.n_rows) if i not in inflight)
    edited = PromptSource(rows_dataset(edit=idx), seed=5, epochs=2)
    with pytest.raises(DatasetMismatch, match="--allow-dataset-change"):
        restore_chain(store, source=edited, config=CONFIG)
    restore_chain(store, source=edited, config=CONFIG, allow_dataset_change=True)


@pytest.mark.parametrize(
    ("src_kwargs", "field"),
    [({"rows": 11}, "n_rows"), ({"seed": 9}, "seed"), ({"epochs": 3}, "epochs")],
)
def test_step7_dataset_shape(tmp_path, source, src_kwargs, field) -> None:
    store, _, _ = publish(tmp_path / "checkpoints", source)
    other = PromptSource(rows_dataset(src_kwargs.get("rows", 10)), seed=src_kwargs.get("seed", 5),
                         epochs=src_kwargs.get("epochs", 2))
    with pytest.raises(DatasetMismatch) as err:
        restore_chain(store, source=other, config=CONFIG)
    assert err.value.field == field


def test_step8_config_change_is_refused_with_a_dotted_diff(tmp_path, source) -> None:
    store, _, _ = publish(tmp_path / "checkpoints", source)
    changed = {**CONFIG, "train": {"num_prompts_per_step": 4}}
    with pytest.raises(ConfigMismatch) as err:
        restore_chain(store, source=source, config=changed)
    assert err.value.diff == [("train.num_prompts_per_step", 2, 4)]
    assert "train.num_prompts_per_step: 2 -> 4" in str(err.value)
    r = restore_chain(store, source=source, config=changed, allow_config_change=["train.num_prompts_per_step"])
    assert r.config_changes == [("train.num_prompts_per_step", 2, 4)]

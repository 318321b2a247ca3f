"""The restore chain on whole checkpoints: every file damaged in every way is refused by
the right step, nothing on disk changes, and a good checkpoint restores what was cut."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest
from test_store import rewrite_manifest

from rollkeep.cli import exit_code
from rollkeep.core.checkpoint.cut import LEDGER_FILE, ROWS_FILE, cut, save_files, write_checkpoint
from rollkeep.core.checkpoint.rowcodec import decode_rows
from rollkeep.core.checkpoint.rowindex import (
    ROWS_INDEX,
    decode_index,
    encode_index,
    extents,
    referenced_segments,
)
from rollkeep.core.checkpoint.store import CheckpointStore
from rollkeep.core.custody import codec
from rollkeep.core.custody.events import Admitted, Dispatched, Finalizing, Ready, Sealed
from rollkeep.core.custody.ledger import Ledger
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
from rollkeep.core.restore.chain import restore_chain
from rollkeep.core.rollout.datasets import SequenceDataset
from rollkeep.core.rollout.generation import Tokens
from rollkeep.core.rollout.prefixes import Link, PrefixStore, chunk_row
from rollkeep.core.rollout.rows import Row, RowId
from rollkeep.core.rollout.rowstore import RowStore
from rollkeep.core.rollout.source import PromptSource
from rollkeep.core.rollout.take import take_event
from rollkeep.core.rowlog.segments import (
    ROWS_DIR,
    RowLocation,
    RowLogReader,
    RowSegmentCorrupt,
    segment_path,
)
from rollkeep.core.rowlog.writer import RowLogWriter

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
    write_checkpoint(store, cut(led, rows), trainer_save=save_files({"model.bin": b"weights" * (10 + salt)}),
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


FILES = [LEDGER_FILE, ROWS_FILE, "trainer/model.bin", "MANIFEST.json"]  # rows.index: the by-reference tests below


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
    from rollkeep.core.checkpoint.rowcodec import decode_rows, encode_rows

    def drop_one(blob: bytes) -> bytes:
        rows = decode_rows(blob)
        rows.pop(RowId("e0.1", 0, 0))
        return encode_rows(rows.items())

    bad = republish_with(tmp_path, source, ROWS_FILE, drop_one)
    with pytest.raises(RowsMismatch, match="1 missing"):
        restore_chain(bad, source=source, config=CONFIG)


def test_step6_rows_unreferenced(tmp_path, source) -> None:
    from rollkeep.core.checkpoint.rowcodec import decode_rows, encode_rows

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


# -- rows by reference (docs/design.md §5.2) ------------------------------------------------


def publish_by_reference(run: Path, source: PromptSource, *, locate=lambda rid: True, republish=False):
    """The `build` checkpoint in `run/checkpoints`, with the rows `locate` picks appended to
    `run/rows` first (as the journal does), so the checkpoint names them instead of copying."""
    led, rows = build(source)
    log = RowLogWriter(run / ROWS_DIR)
    for rid in list(rows.ids()):
        if locate(rid):
            rows.locate(rid, log.append(rid, rows.get(rid)))
    log.close()
    store = CheckpointStore(run / "checkpoints")
    meta = {"dataset": {"n_rows": source.n_rows, "seed": source.seed, "fingerprint": source.fingerprint()},
            "config": CONFIG}
    write_checkpoint(store, cut(led, rows), trainer_save=save_files({"model.bin": b"weights"}), meta=meta, keep_last=3)
    return store, led, rows


def test_a_checkpoint_names_the_rows_in_the_row_log_and_copies_only_the_others(tmp_path, source) -> None:
    run = tmp_path / "run"
    copied = RowId("e0.0", 1, 0)
    store, led, rows = publish_by_reference(run, source, locate=lambda rid: rid != copied)
    ck = store.open()
    assert set(decode_rows(ck.read(ROWS_FILE))) == {copied}  # no other row byte was rewritten
    decoded = decode_index(ck.read(ROWS_INDEX))
    index, named = decoded.rows, decoded.extents
    assert set(index) == {RowId("e0.0", 0, 0), RowId("e0.0", 2, 0), RowId("e0.1", 0, 0)}
    assert ck.manifest["rows"] == {"by_reference": 3, "copied": 1, "segments": named, "partial": 0,
                                   "partial_tokens": 0, "turns": 0} and named[0][0] == 0
    assert ck.manifest["schemas"]["rows"] == 2

    r = restore_chain(store, source=source, config=CONFIG)
    assert isinstance(r.rows[copied], Row) and all(isinstance(r.rows[rid], RowLocation) for rid in index)
    restored = RowStore(reader=RowLogReader(run / ROWS_DIR).read)
    restored.restore(r.rows)
    assert restored.resident() == 1, "a restore reads no row by reference"
    for rid in rows.ids():
        assert restored.get(rid) == rows.get(rid)
    assert restored.resident() == 4


def test_a_changed_byte_in_a_named_row_is_refused_when_it_is_read(tmp_path, source) -> None:
    run = tmp_path / "run"
    store, _, _ = publish_by_reference(run, source)
    seg = segment_path(run / ROWS_DIR, 0)
    data = bytearray(seg.read_bytes())
    data[-3] ^= 0x01  # inside the last row's frame
    seg.write_bytes(bytes(data))
    r = restore_chain(store, source=source, config=CONFIG)  # what it proves: the segment reaches that far
    restored = RowStore(reader=RowLogReader(run / ROWS_DIR).read)
    restored.restore(r.rows)
    last = max(r.rows, key=lambda rid: r.rows[rid].offset)
    with pytest.raises(RowSegmentCorrupt, match="checksum") as e:
        restored.get(last)
    assert exit_code(e.value) == 3


@pytest.mark.parametrize("damage_to", ["truncated", "missing", "renamed", "symlink"])
def test_a_named_segment_that_is_short_missing_or_not_its_own_is_refused(tmp_path, source, damage_to) -> None:
    run = tmp_path / "run"
    store, _, _ = publish_by_reference(run, source)
    seg = segment_path(run / ROWS_DIR, 0)
    data = seg.read_bytes()
    if damage_to == "truncated":
        seg.write_bytes(data[:-1])
    elif damage_to == "missing":
        seg.unlink()
    elif damage_to == "renamed":  # another segment's bytes under its name: its header names segment 1
        log = RowLogWriter(run / ROWS_DIR)
        log.append(RowId("e9.9", 0, 0), row(7))
        log.close()
        seg.unlink()
        segment_path(run / ROWS_DIR, 1).rename(seg)
    else:
        aside = tmp_path / "elsewhere.rows"
        seg.rename(aside)
        seg.symlink_to(aside)
    before = tree_digest(tmp_path)
    with pytest.raises(RowSegmentCorrupt, match="segment 0") as e:
        restore_chain(store, source=source, config=CONFIG)
    assert exit_code(e.value) == 3 and tree_digest(tmp_path) == before


def _forged(run: Path, edit_manifest=None, index=None) -> None:
    """Rewrite the checkpoint with a valid manifest checksum (so only the edit is wrong)."""
    ckdir = run / "checkpoints" / "step_000000"
    if index is not None:
        (ckdir / ROWS_INDEX).write_bytes(index)

    def edit(m: dict) -> None:
        if index is not None:
            m["files"][ROWS_INDEX] = {"size": len(index), "sha256": hashlib.sha256(index).hexdigest()}
        if edit_manifest is not None:
            edit_manifest(m)

    rewrite_manifest(ckdir, edit)


def test_the_manifests_segments_must_be_the_ones_the_index_names(tmp_path, source) -> None:
    run = tmp_path / "run"
    store, _, _ = publish_by_reference(run, source)
    _forged(run, edit_manifest=lambda m: m["rows"].update(segments=[]))  # retention would delete it
    with pytest.raises(RowsMismatch, match="row segments are not the ones") as e:
        restore_chain(store, source=source, config=CONFIG)
    assert e.value.field == "rows.segments"


@pytest.mark.parametrize("forgery", ["unreferenced", "also_copied", "twice", "garbage", "short_column",
                                     "negative"])
def test_a_forged_rows_index_is_refused(tmp_path, source, forgery) -> None:
    run = tmp_path / "run"
    copied = RowId("e0.0", 1, 0)
    store, _, rows = publish_by_reference(run, source, locate=lambda rid: rid != copied)
    ck = store.open()
    index = decode_index(ck.read(ROWS_INDEX)).rows
    loc = next(iter(index.values()))
    entries = list(index.items())
    if forgery == "unreferenced":
        entries.append((RowId("e0.2", 0, 0), loc))
    elif forgery == "also_copied":
        entries.append((copied, loc))
    elif forgery == "twice":
        entries.append(entries[0])
    blob = encode_index(entries)
    if forgery == "garbage":
        blob = b"\x93\x01\x02"
    elif forgery == "short_column":
        doc = msgspec.msgpack.decode(blob)
        doc[1][1] = doc[1][1][:-4]  # one generation too few
        blob = msgspec.msgpack.encode(doc)
    elif forgery == "negative":
        doc = msgspec.msgpack.decode(blob)
        doc[1][2] = np.full(len(entries), -1, "<i4").tobytes()  # attempt -1
        blob = msgspec.msgpack.encode(doc)
    _forged(run, index=blob)
    with pytest.raises(RowsMismatch) as e:
        restore_chain(store, source=source, config=CONFIG)
    assert exit_code(e.value) == 3
    expected = {"unreferenced": "1 unreferenced", "also_copied": "1 both copied and named", "twice": "twice",
                "garbage": "does not decode", "short_column": "wrong length", "negative": "out of range"}
    assert expected[forgery] in str(e.value)


@pytest.mark.parametrize("change", ["reordered", "missing", "unreferenced"])
def test_an_index_naming_every_row_is_compared_as_a_set(tmp_path, source, change) -> None:
    """With no row copied, the chain first compares the index's columns with the ledger's
    sealed attempts in the ledger's order; an index listing them in another order still
    restores, one naming other rows is refused as when rows are copied."""
    run = tmp_path / "run"
    store, _, rows = publish_by_reference(run, source)
    ck = store.open()
    entries = list(decode_index(ck.read(ROWS_INDEX)).rows.items())
    if change == "reordered":
        entries.reverse()
    elif change == "missing":
        entries.pop()
    else:
        entries.append((RowId("e0.2", 0, 0), entries[0][1]))
    _forged(run, index=encode_index(entries))
    if change == "reordered":
        restored = RowStore(reader=RowLogReader(run / ROWS_DIR).read)
        restored.restore(restore_chain(store, source=source, config=CONFIG).rows)
        assert sorted(restored.ids()) == sorted(rows.ids())
        assert all(type(rid) is RowId for rid in restored.ids()), "the ids a restore keys by plain tuples"
        return
    with pytest.raises(RowsMismatch, match=f"1 {change}") as e:
        restore_chain(store, source=source, config=CONFIG)
    assert "RowId(group_id=" in str(e.value)  # the rows it names, as before


def test_retention_keeps_every_segment_a_checkpoint_names_and_nothing_when_a_manifest_is_in_doubt(
        tmp_path, source) -> None:
    run = tmp_path / "run"
    store, _, _ = publish_by_reference(run, source)
    assert referenced_segments(store) == {0}
    (run / "checkpoints" / "step_000000" / "MANIFEST.json").write_text("{")  # unreadable: keep everything
    assert referenced_segments(store) is None


def _with_chain(run: Path, source, gid: str, gen: int, attempt: int = 0, ends=(2, 4)) -> CheckpointStore:
    """The by-reference checkpoint with a forged partial generation of sibling `gid`/`gen`
    in its index (frames appended for real, the manifest resealed)."""
    store, _, rows = publish_by_reference(run, source)
    log = RowLogWriter(run / ROWS_DIR)
    chain, start = [], 0
    for end in ends:
        n = max(end - start, 1)  # (a forged chain that does not grow still has frames)
        tokens = Tokens(np.arange(start, start + n, dtype=np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32))
        chain.append(Link(attempt, end, None, log.append(RowId(gid, gen, attempt), chunk_row(tokens))))
        start = end
    log.close()
    ck = store.open()
    index = decode_index(ck.read(ROWS_INDEX))
    blob = encode_index(index.rows.items(), {(gid, gen): tuple(chain)})
    locations = [*index.rows.values(), *(c.at for c in chain)]
    _forged(run, index=blob, edit_manifest=lambda m: m["rows"].update(segments=extents(locations)))
    return store


def test_a_partial_generation_of_a_sibling_still_generating_is_restored_by_reference(tmp_path, source) -> None:
    run = tmp_path / "run"
    store = _with_chain(run, source, "e0.1", 1)  # e0.1: sibling 0 sealed, 1 and 2 dispatched
    r = restore_chain(store, source=source, config=CONFIG)
    chain = r.prefixes[("e0.1", 1)]
    assert [c.end for c in chain] == [2, 4] and all(c.tokens is None for c in chain)
    prefixes = PrefixStore(reader=RowLogReader(run / ROWS_DIR).read)
    prefixes.restore(r.prefixes)
    assert prefixes.prefix("e0.1", 1).completion_ids.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(("gid", "gen", "attempt", "ends", "found"), [
    ("e0.1", 0, 0, (2, 4), "SEALED"),  # a sealed sibling has its row
    ("e0.0", 1, 0, (2, 4), "READY"),  # a group no longer generating
    ("e0.9", 0, 0, (2, 4), "no generating group"),
    ("e0.1", 1, 5, (2, 4), "attempt 0"),  # a later attempt than the ledger's
    ("e0.1", 1, 0, (4, 2), "does not grow"),
])
def test_a_partial_generation_the_ledger_has_no_place_for_is_refused(tmp_path, source, gid, gen, attempt, ends,
                                                                     found) -> None:
    store = _with_chain(tmp_path / "run", source, gid, gen, attempt, ends)
    with pytest.raises(RowsMismatch, match=found) as e:
        restore_chain(store, source=source, config=CONFIG)
    assert exit_code(e.value) == 3

"""`CheckpointMeta`: what the run writes is what every reader gets back, typed; a manifest
value of the wrong type (an edit with the hash recomputed) is refused naming its field."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_store import rewrite_manifest

from rollkeep.cli import exit_code
from rollkeep.core.checkpoint.cut import cut, save_files, write_checkpoint
from rollkeep.core.checkpoint.meta import CheckpointMeta, JournalPosition, read_meta
from rollkeep.core.checkpoint.store import CheckpointStore
from rollkeep.core.custody.ledger import Ledger
from rollkeep.core.errors import ManifestMismatch
from rollkeep.core.rollout.datasets import SequenceDataset
from rollkeep.core.rollout.rowstore import RowStore
from rollkeep.core.rollout.source import PromptSource
from rollkeep.core.schedule.cutting import checkpoint_meta

SEMANTIC = {"seed": 3, "rollout": {"group_size": 2}}


def _publish(root: Path, journal: tuple[int, int] | None) -> tuple[CheckpointStore, PromptSource]:
    source = PromptSource(SequenceDataset([{"prompt": f"{i}", "answer": i} for i in range(6)]), seed=3, epochs=2)
    store = CheckpointStore(root)
    meta = checkpoint_meta(source, SEMANTIC, "run-1", writer="9.9", journal=journal)
    write_checkpoint(store, cut(Ledger(n_rows=6, seed=3, epochs=2), RowStore()),
                     trainer_save=save_files({"state.json": b"{}"}), meta=meta, keep_last=None)
    return store, source


@pytest.mark.parametrize("journal", [(7, 2), None])
def test_what_the_run_writes_every_reader_gets_back(tmp_path, journal) -> None:
    store, source = _publish(tmp_path / "ck", journal)
    ck = store.open()
    m = ck.meta
    assert isinstance(m, CheckpointMeta)
    assert (m.name, m.step, m.weight_version, m.trainer_step) == (ck.name, 0, 0, None)
    assert (m.dataset.n_rows, m.dataset.seed, m.dataset.epochs) == (6, 3, 2)
    assert m.dataset_fingerprint == source.fingerprint()
    assert (m.config, m.run_id, m.rollkeep_version) == (SEMANTIC, "run-1", "9.9")
    assert m.journal == (None if journal is None else JournalPosition(*journal))
    assert m.journal_seq == (None if journal is None else journal[0])
    # journal off is the key's absence in the manifest, as before the type existed
    assert ("journal" in ck.manifest) == (journal is not None)


def test_keys_it_does_not_name_are_kept_and_ignored(tmp_path) -> None:
    store, _ = _publish(tmp_path / "ck", None)
    rewrite_manifest(store.root / store.latest(), lambda m: m.update(custom_writer={"x": 1}))
    ck = store.open()
    assert ck.manifest["custom_writer"] == {"x": 1} and ck.meta.run_id == "run-1"


FIELDS = {  # field -> wrong values (no honest writer produces them)
    "journal": [{"seq": -1, "rows_segment": 0}, {"seq": True, "rows_segment": 0}, {"seq": 1}, [1, 2],
                {"seq": 1, "rows_segment": 0, "more": 1}],
    "dataset": [{"n_rows": "6", "seed": 3}, {"n_rows": -1, "seed": 3}, "ds", {"seed": 3}],
    "config": [[], "cfg", 3],
    "cut_time": ["now", None, [1.0]],
    "run_id": [5, {"a": 1}],
    "trainer_step": ["0", 1.5],
}


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from([(f, v) for f, vs in FIELDS.items() for v in vs]))
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(case) -> None:
    field, value = case
    manifest = {"name": "step_000000", "step": 0, "weight_version": 0, field: value}
    with pytest.raises(ManifestMismatch) as e:
        read_meta(manifest, path="MANIFEST.json")
    assert e.value.field == field or e.value.field.startswith(field + ".")
    assert exit_code(e.value) == 3
    if field == "journal":  # the message restores and inspect have always given
        assert "journal position" in str(e.value)


def test_an_edited_manifest_is_refused_at_the_first_read_and_nothing_changes(tmp_path) -> None:
    store, _ = _publish(tmp_path / "ck", (4, 1))
    ckdir = store.root / store.latest()
    rewrite_manifest(ckdir, lambda m: m.update(journal={"seq": "4", "rows_segment": 1}))
    before = (ckdir / "MANIFEST.json").read_bytes()
    ck = store.open()  # the hash matches: steps 1-3 pass
    with pytest.raises(ManifestMismatch, match="journal position"):
        _ = ck.meta
    assert (ckdir / "MANIFEST.json").read_bytes() == before

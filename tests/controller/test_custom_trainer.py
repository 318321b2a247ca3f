"""Bring your own trainer: `trainer.name: custom` with the worked example
(examples/dcp_trainer.py, torch.distributed.checkpoint) through the real runner, killed and
resumed; a damaged DCP shard refused on restore; the factory's config errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_harness import (
    DEFAULTS,
    FAST,
    ROOT,
    check,
    config,
    final_sha,
    killed,
    run_child,
    run_to_end,
)

from rollkeep.cli import main

pytestmark = pytest.mark.slow

DCP = [
    "engine.name=torch", "trainer.name=custom", "trainer.factory=examples.dcp_trainer:make",
    "engine.max_new_tokens=4", "trainer.model.n_layer=1", "trainer.model.n_head=2",
    "trainer.model.n_embd=32", "trainer.model.block_size=16",
    "trainer.kwargs.micro_batch_size=8", "trainer.kwargs.lr=0.003",
    "rollout.group_size=4", "train.num_prompts_per_step=4", "train.total_steps=6",
    "checkpoint.every_steps=2", "data.generated.n_rows=64", "data.epochs=null",
    "deterministic=true", "rollout.on_dropped_prompt=shrink",
]


@pytest.fixture(autouse=True)
def _from_the_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # `examples` is imported from the current directory, as a user runs it


def test_dcp_trainer_killed_and_resumed_ends_as_the_uninterrupted_run(tmp_path) -> None:
    reference = config(tmp_path / "reference", *DCP)
    run_to_end(reference)
    cfg = config(tmp_path / "killed", *DCP)
    for point in ["ledger.sealed:30", "publish.file_written:4", "checkpoint.after_cut:1"]:
        assert killed(run_child(cfg, point)), point
    run_to_end(cfg)
    report = check(cfg, final_sha(reference))  # exactly once, and the same final weights
    assert report.restarts == 3 and report.steps == 6
    ck = Path(cfg.run_dir) / "checkpoints" / "step_000006"
    listed = json.loads((ck / "MANIFEST.json").read_text())["files"]
    assert {"trainer/step.json", "trainer/dcp/.metadata", "trainer/dcp/__0_0.distcp"} <= set(listed)
    assert json.loads((ck / "trainer" / "step.json").read_text())["rollkeep_step"] == 6


def test_a_damaged_dcp_shard_is_refused_on_restore(tmp_path, capsys) -> None:
    cfg = config(tmp_path / "run", *DCP, "train.total_steps=2")
    run_to_end(cfg)
    shard = Path(cfg.run_dir) / "checkpoints" / "step_000002" / "trainer" / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    code = main(["train", DEFAULTS, *FAST, f"run_dir={cfg.run_dir}", *DCP, "train.total_steps=4"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "trainer/dcp/__0_0.distcp" in err and "sha256" in err and "Traceback" not in err


BAD_FACTORIES = {
    "no_such_module_xyz:make": "cannot be imported",
    "bad_trainers:missing": "has no attribute 'missing'",
    "bad_trainers:NOT_CALLABLE": "is not callable",
    "bad_trainers:no_methods": "does not build a trainer",
    "bad_trainers:raises": "building the trainer failed",
    "bad_trainers:takes_nothing": "cannot be called with these arguments",
}


@pytest.mark.parametrize("spec, says", BAD_FACTORIES.items())
def test_a_bad_trainer_factory_is_exit_2_before_anything_runs(tmp_path, monkeypatch, capsys, spec, says) -> None:
    (tmp_path / "bad_trainers.py").write_text(
        "NOT_CALLABLE = 3\n"
        "def no_methods(**kw):\n    return object()\n"
        "def raises(**kw):\n    raise RuntimeError('no GPU here')\n"
        "def takes_nothing():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = tmp_path / "run"
    code = main(["train", DEFAULTS, *FAST, f"run_dir={run_dir}", *DCP, f"trainer.factory={spec}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and says in err and "Traceback" not in err, err
    assert not (run_dir / "checkpoints").exists()

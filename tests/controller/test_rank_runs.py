"""Whole runs on several trainer ranks (`trainer.world_size`), the slower tier (`make
test-ranks`; CI runs it after `make test`): a rank that hangs stops the run (exit 5)
naming it, and the rerun finishes exactly once; a damaged, missing or foreign shard is
refused (exit 3) with nothing changed; a 2-rank run exports from one process. The kill
storms are in test_rank_kills.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hostile import refuses
from run_harness import (
    DEFAULTS,
    FAST,
    check,
    config,
    events,
    final_sha,
    run_to_end,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.environ.get("ROLLKEEP_TEST_RANKS"), reason="the slower tier: make test-ranks (ROLLKEEP_TEST_RANKS=1)")]

TINY = [
    "engine.name=torch", "trainer.name=torch", "engine.max_new_tokens=4",
    "trainer.model.n_layer=1", "trainer.model.n_head=2", "trainer.model.n_embd=32",
    "trainer.model.block_size=16", "trainer.micro_batch_size=4",
    "rollout.group_size=4", "train.num_prompts_per_step=4", "train.total_steps=8",
    "checkpoint.every_steps=2", "warmup.sft_steps=10", "warmup.sft_batch_size=8",
    "checkpoint.warmup_every_steps=5", "data.generated.n_rows=64", "data.epochs=null",
    "rollout.on_dropped_prompt=shrink",
]


def cli(cfg, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`rollkeep train` in a subprocess on `cfg`'s run_dir (exit code, message)."""
    return subprocess.run([sys.executable, "-m", "rollkeep", "train", DEFAULTS, *FAST, *TINY, *overrides,
                           f"run_dir={cfg.run_dir}"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def world_sizes(cfg) -> list[int]:
    return [e["world_size"] for e in events(cfg, "trainer_started")]






def test_a_rank_that_hangs_stops_the_run_naming_it_and_the_rerun_finishes(tmp_path) -> None:
    cfg = config(tmp_path / "run", *TINY, "trainer.world_size=2", "trainer.step_timeout_s=4")
    hung = cli(cfg, "trainer.world_size=2", "trainer.step_timeout_s=4",
               env={"ROLLKEEP_RANK_CRASH_AT": "rank.train:3", "ROLLKEEP_RANK_CRASH_SIGNAL": "STOP"})
    assert hung.returncode == 5, hung.stderr
    assert "rank 1 (pid" in hung.stderr and "stopped" in hung.stderr and "trainer.step_timeout_s = 4 s" in hung.stderr
    assert "Traceback" not in hung.stderr
    run_to_end(cfg)
    check(cfg)


def test_a_damaged_or_foreign_shard_is_refused_with_nothing_changed(tmp_path, capsys) -> None:
    from hostile import rehash

    cfg = config(tmp_path / "run", *TINY, "trainer.world_size=2", "train.total_steps=4")
    run_to_end(cfg)
    root = Path(cfg.run_dir)
    latest = root / "checkpoints" / (root / "checkpoints" / "LATEST").read_text().strip()
    older = sorted(p for p in (root / "checkpoints").iterdir() if p.name.startswith("step_") and p != latest)[-1]
    shard = Path("trainer/shards/shard-00001-model-00001-of-00001.safetensors")
    args = ["train", DEFAULTS, *FAST, *TINY, "trainer.world_size=2", "train.total_steps=6", f"run_dir={root}"]
    pristine = (latest / shard).read_bytes()
    exported = subprocess.run([sys.executable, "-m", "rollkeep", "export", str(root), "--out", str(tmp_path / "model")],
                              capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr  # one process reads the shards
    assert json.loads((tmp_path / "model" / "rollkeep_export.json").read_text())["weights_sha256"] == final_sha(cfg)

    data = bytearray(pristine)
    data[-9] ^= 0xFF
    (latest / shard).write_bytes(bytes(data))  # damaged: the manifest's digest no longer matches
    assert str(shard) in refuses(capsys, args, 3, root)
    (latest / shard).write_bytes((older / shard).read_bytes())  # another step's shard, manifest forged to match
    rehash(latest)
    err = refuses(capsys, args, 3, root)
    assert "not of step" in err and "shard-00001" in err
    (latest / shard).unlink()
    rehash(latest)
    assert "not the 2 the checkpoint lists" in refuses(capsys, args, 3, root)  # (`refuses`: nothing changed)

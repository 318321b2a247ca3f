"""Whole runs on several trainer ranks (`trainer.world_size`): SIGKILLs of the controller
and of a rank, resumes on 1, 2 and 3 ranks, exactly once; the deterministic 2-rank run
killed and resumed ends byte-identical to its uninterrupted run; a rank that hangs stops
the run (exit 5) naming it; a damaged shard is refused (exit 3) with nothing changed;
`rollkeep chaos` on 2 ranks."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hostile import refuses
from run_harness import DEFAULTS, FAST, check, config, events, final_sha, killed, run_child, run_to_end

pytestmark = pytest.mark.slow

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


def test_kills_of_the_controller_and_of_a_rank_resume_on_one_two_and_three_ranks(tmp_path) -> None:
    """SIGKILLs at instants drawn at random: the controller mid-generation, mid-commit and
    mid-checkpoint, a rank mid-step and mid-checkpoint; each restart on another number of
    ranks; the run ends with every prompt trained exactly once."""
    rng = random.Random(26)
    cfg = config(tmp_path / "run", *TINY, "trainer.world_size=2")
    assert killed(run_child(cfg, f"ledger.sealed:{rng.randint(20, 60)}"))  # in the warm start or RL
    assert killed(run_child(config(tmp_path / "run", *TINY, "trainer.world_size=1"),
                            f"train.before_commit:{rng.randint(1, 3)}"))
    died = cli(cfg, "trainer.world_size=3",
               env={"ROLLKEEP_RANK_CRASH_AT": f"rank.train:{rng.randint(1, 2)}", "ROLLKEEP_RANK_CRASH_RANK": "2"})
    assert died.returncode == 5, died.stderr
    assert "trainer rank 2 (pid" in died.stderr and "killed by SIGKILL" in died.stderr
    assert "Traceback" not in died.stderr
    died = cli(cfg, "trainer.world_size=2", env={"ROLLKEEP_RANK_CRASH_AT": "rank.save:1"})
    assert died.returncode == 5 and "trainer rank 1" in died.stderr and "during save" in died.stderr, died.stderr
    assert killed(run_child(config(tmp_path / "run", *TINY, "trainer.world_size=3"), "publish.file_written:2"))
    run_to_end(config(tmp_path / "run", *TINY, "trainer.world_size=2"))
    report = check(cfg)
    assert report.steps == 8
    sizes = world_sizes(cfg)
    assert {1, 2, 3} <= set(sizes) and sizes[-1] == 2, sizes
    failed = events(cfg, "run_failed")
    assert any("trainer rank 2" in e["error"] for e in failed), failed


def test_the_deterministic_two_rank_run_killed_and_resumed_ends_byte_identical(tmp_path) -> None:
    reference = config(tmp_path / "reference", *TINY, "trainer.world_size=2", "deterministic=true")
    run_to_end(reference)
    cfg = config(tmp_path / "killed", *TINY, "trainer.world_size=2", "deterministic=true")
    for point in ["ledger.sealed:30", "publish.file_written:3"]:  # (chaos below kills at random instants)
        assert killed(run_child(cfg, point)), point
    died = cli(cfg, "trainer.world_size=2", "deterministic=true", env={"ROLLKEEP_RANK_CRASH_AT": "rank.train:2"})
    assert died.returncode == 5, died.stderr
    run_to_end(cfg)
    check(cfg, final_sha(reference))
    assert world_sizes(cfg) == [2, 2, 2, 2]  # (the first process died in the warm start: no RL trace)


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


def test_chaos_on_two_ranks_ends_byte_identical(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rollkeep", "chaos", DEFAULTS, *TINY, "deterministic=true", "trainer.world_size=2",
         "logger.progress=none", "--kills", "3", "--seed", "26", "--workdir", str(tmp_path / "chaos")],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(== uninterrupted run)" in out.stdout and "duplicates: 0   lost: 0" in out.stdout

"""Trainer ranks as Ray actors (`trainer.world_size` > 1 with `cluster.backend: ray`), on the
session's local Ray; the slower tier (`make test-ranks`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from run_harness import DEFAULTS, FAST, check, config, events, run_to_end
from test_ray_runs import TORCH, on_ray

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray"), pytest.mark.skipif(
    not os.environ.get("ROLLKEEP_TEST_RANKS"), reason="the slower tier: make test-ranks (ROLLKEEP_TEST_RANKS=1)")]


def test_trainer_ranks_as_ray_actors_a_rank_death_then_a_resume_on_local_ranks(tmp_path, ray_address) -> None:
    """`trainer.world_size: 2` with `cluster.backend: ray`: the ranks are Ray actors; one
    SIGKILLed mid-step stops the run (exit 5) naming it; the rerun on 3 local ranks and
    the local engine ends exactly once."""
    on = [*TORCH, *on_ray(ray_address, 1), "trainer.world_size=2", "cluster.trainer_cpus=0.5"]
    cfg = config(tmp_path / "run", *on)
    died = subprocess.run([sys.executable, "-m", "rollkeep", "train", DEFAULTS, *FAST, *on, f"run_dir={cfg.run_dir}"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ROLLKEEP_RANK_CRASH_AT": "rank.train:3"})
    assert died.returncode == 5, died.stderr
    assert "trainer rank 1" in died.stderr and "its Ray actor's process ended" in died.stderr, died.stderr
    started = events(cfg, "trainer_started")
    assert started[0]["backend"] == "gloo" and started[0]["placement"] == "ray" and len(started[0]["pids"]) == 2
    run_to_end(config(tmp_path / "run", *TORCH, "trainer.world_size=3"))
    check(cfg)
    assert events(cfg, "trainer_started")[-1]["placement"] == "process"

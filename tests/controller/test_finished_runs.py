"""Re-opening a run that reached train.total_steps, or lowering train.total_steps below
the run's step: `rollkeep train` says so and writes nothing (issue 28)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from run_harness import DEFAULTS, FAST
from test_train_cli import tree_digest

pytestmark = pytest.mark.slow


def rollkeep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollkeep", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    out = rollkeep("train", DEFAULTS, *FAST, f"run_dir={run}")
    assert out.returncode == 0, out.stderr
    return run


def test_reopening_a_finished_run_says_so_exits_0_and_writes_nothing(finished: Path) -> None:
    before = tree_digest(finished)
    out = rollkeep("train", DEFAULTS, *FAST, f"run_dir={finished}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("already finished at step 12; nothing to do"), out.stdout
    assert "larger train.total_steps" in out.stdout
    assert tree_digest(finished) == before


def test_total_steps_below_the_runs_step_exits_2_and_writes_nothing(finished: Path) -> None:
    before = tree_digest(finished)
    out = rollkeep("train", DEFAULTS, *FAST, f"run_dir={finished}", "train.total_steps=5")
    assert out.returncode == 2, out.stderr
    assert "train.total_steps is 5, but the run in" in out.stderr and "is at step 12 already" in out.stderr
    assert "give train.total_steps=12 or more" in out.stderr
    assert tree_digest(finished) == before


def test_raising_total_steps_trains_on(tmp_path) -> None:
    run = tmp_path / "run"
    assert rollkeep("train", DEFAULTS, *FAST, f"run_dir={run}", "train.total_steps=6").returncode == 0
    out = rollkeep("train", DEFAULTS, *FAST, f"run_dir={run}", "train.total_steps=10")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("done: step 10 (finished)"), out.stdout

"""The slower tier of runs on several trainer ranks (`make test-ranks`; CI runs it after
`make test`): SIGKILLs of the controller and of a rank at instants drawn at random, resumes
on 1, 2 and 3 ranks, exactly once; the deterministic 2-rank run killed and resumed ends
byte-identical to its uninterrupted run; `rollkeep chaos` on 2 ranks; a terminal's Ctrl-C
to the whole process group."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from run_harness import (
    DEFAULTS,
    FAST,
    check,
    config,
    events,
    final_sha,
    killed,
    run_child,
    run_to_end,
)
from test_rank_runs import TINY, cli, world_sizes

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.environ.get("ROLLKEEP_TEST_RANKS"), reason="the slower tier: make test-ranks (ROLLKEEP_TEST_RANKS=1)")]


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
    assert 3 in sizes and sizes[-1] == 2, sizes  # (a killed process may not have flushed its line)
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


def test_chaos_on_two_ranks_with_rank_kills_ends_byte_identical(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rollkeep", "chaos", DEFAULTS, *TINY, "deterministic=true", "trainer.world_size=2",
         "logger.progress=none", "--kills", "4", "--rank-kills", "2", "--seed", "26", "--workdir", str(tmp_path / "chaos")],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(== uninterrupted run)" in out.stdout and "duplicates: 0   lost: 0" in out.stdout
    assert "2 of them trainer ranks" in out.stdout, out.stdout


def test_ctrl_c_to_the_terminal_s_process_group_stops_gracefully_with_its_ranks(tmp_path) -> None:
    """A terminal's Ctrl-C reaches the whole foreground process group: the ranks (in a
    session of their own) keep going while the controller writes its final checkpoint
    through them, exits 130, and the rerun finishes exactly once."""
    import signal

    long = [*TINY, "trainer.world_size=2", "train.total_steps=400", "data.generated.n_rows=4000"]
    cfg = config(tmp_path / "run", *long)
    child = subprocess.Popen([sys.executable, "-m", "rollkeep", "train", DEFAULTS, *FAST, *long, "logger.progress=lines",
                              f"run_dir={cfg.run_dir}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        for line in child.stdout:  # the first RL checkpoint is published: mid-run, ranks started
            if line.startswith("checkpoint step_000002"):
                break
        os.killpg(child.pid, signal.SIGINT)
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    assert child.returncode == 130, err
    assert "trainer rank" not in err
    stopped = events(cfg, "run_finished")[-1]
    assert stopped["reason"] == "signal" and 2 <= stopped["step"] < 400
    end = config(tmp_path / "run", *long, f"train.total_steps={stopped['step'] + 2}")
    run_to_end(end)
    check(end)

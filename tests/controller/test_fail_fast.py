"""A user's reward function that raises fails fast, names itself and loses nothing (issue 28;
../shared/findings/first-hour.md, "a reward function that raises"): when the run's first
`rollout.fail_fast_attempts` attempts all fail with the same error, the run stops with exit 2
before dropping any prompt, and once the function is fixed the same command resumes and
trains every prompt exactly once. A function that fails on some rows only stays a data
failure."""

from __future__ import annotations

import importlib
import shutil
import sys
import uuid
from pathlib import Path

import pytest
from run_harness import DEFAULTS, FAST, check, config, events

from rollkeep import tasks
from rollkeep.cli import main
from rollkeep.core.schedule.failfast import FailFast, Watch

NO_INJECTED = ["engine.data_fail_rate=0", "engine.infra_fail_rate=0"]


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    tasks.use_rewards(None)


def write_module(where: Path, name: str, source: str) -> None:
    """(Re)write module `name`, so that the next import reads this source."""
    sys.modules.pop(name, None)
    shutil.rmtree(where / "__pycache__", ignore_errors=True)
    (where / f"{name}.py").write_text(source)
    importlib.invalidate_caches()


def train_cli(capsys, run_dir: Path, *overrides: str) -> tuple[int, str]:
    code = main(["train", DEFAULTS, *FAST, f"run_dir={run_dir}", *NO_INJECTED, *overrides])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("budget", [2, 1])  # 1: every failure spends its sibling's budget (its drop is held)
def test_a_reward_function_that_always_raises_stops_with_exit_2_and_drops_nothing(cwd, capsys, budget) -> None:
    name = f"rk_ff_{uuid.uuid4().hex[:10]}"
    write_module(cwd, name, "def score(completion, row):\n    raise RuntimeError('my reward blew up on purpose')\n")
    run_dir = cwd / "run"
    code, err = train_cli(capsys, run_dir, f"reward.fn={name}:score", f"rollout.max_data_attempts={budget}")
    assert code == 2, err
    assert "Traceback" not in err
    assert f"reward function {name}:score raised RuntimeError: my reward blew up on purpose" in err, err
    assert "the first 8 attempts of the run all failed with the same error" in err and "no prompt was dropped" in err
    assert "the same command" in err  # where it resumes from
    cfg = config(run_dir, f"reward.fn={name}:score", *NO_INJECTED)
    assert events(cfg, "dropped") == []
    failed = events(cfg, "failed")
    assert len(failed) >= 8 and {f["error"] for f in failed} == {
        f"reward function {name}:score raised RuntimeError: my reward blew up on purpose"}
    assert events(cfg, "run_finished")[-1]["reason"] == "user code"

    # The function fixed (the module file swapped), the same command resumes and trains
    # every prompt exactly once.
    write_module(cwd, name, "def score(completion, row):\n    return 1.0\n")
    code, err = train_cli(capsys, run_dir, f"reward.fn={name}:score", f"rollout.max_data_attempts={budget}")
    assert code == 0, err
    assert events(cfg, "dropped") == []
    assert events(cfg, "run_finished")[-1]["reason"] == "finished"
    assert events(cfg, "run_finished")[-1]["step"] == 12
    check(cfg)  # exactly-once, from the trace and the final checkpoint


def test_a_reward_function_that_fails_on_some_rows_only_stays_a_data_failure(cwd, capsys) -> None:
    name = f"rk_ff_{uuid.uuid4().hex[:10]}"
    write_module(cwd, name, "def score(completion, row):\n"
                            "    if int(row['answer']) % 3 == 0:\n        raise ValueError('a row I cannot score')\n"
                            "    return 1.0\n")
    run_dir = cwd / "run"
    code, err = train_cli(capsys, run_dir, f"reward.fn={name}:score", "rollout.max_data_attempts=1")
    assert code == 0, err
    cfg = config(run_dir)
    dropped = events(cfg, "dropped")
    assert dropped and all("data budget spent" in d["reason"] and "a row I cannot score" in d["reason"]
                           for d in dropped)
    assert events(cfg, "run_finished")[-1]["reason"] in ("finished", "data exhausted")


def test_fail_fast_attempts_0_keeps_the_data_budgets_alone(cwd, capsys) -> None:
    name = f"rk_ff_{uuid.uuid4().hex[:10]}"
    write_module(cwd, name, "def score(completion, row):\n    raise RuntimeError('always')\n")
    run_dir = cwd / "run"
    code, err = train_cli(capsys, run_dir, f"reward.fn={name}:score", "rollout.fail_fast_attempts=0")
    assert code == 5, err  # the old behaviour, by name: the data budgets drop the prompts
    assert events(config(run_dir), "dropped")


# -- the core's watch, alone ---------------------------------------------------------------


def test_the_watch_trips_on_n_identical_failures_only() -> None:
    w = FailFast(3)
    assert [w.failed("E"), w.failed("E"), w.failed("E")] == [Watch.WATCHING, Watch.WATCHING, Watch.TRIPPED]
    assert w.error == "E" and w.failed("E") is Watch.TRIPPED and w.sealed() is Watch.TRIPPED


def test_a_success_or_a_different_error_clears_the_watch_for_good() -> None:
    w = FailFast(3)
    w.failed("E")
    assert w.sealed() is Watch.CLEARED
    assert [w.failed("E") for _ in range(5)] == [Watch.CLEARED] * 5
    w = FailFast(3)
    w.failed("E")
    assert w.failed("F") is Watch.CLEARED and w.failed("F") is Watch.CLEARED
    assert FailFast(0).state is Watch.CLEARED  # off
    assert FailFast(2).give_up() is Watch.CLEARED

"""A judge that hangs, answers garbage or a huge body (docs/effects.md): each call is a data
failure of its attempt, recorded as the call's error, within the budgets; the run ends as
a run whose data all failed does, with no traceback and exactly-once custody."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from run_harness import DEFAULTS, FAST, config, events

from rollkeep.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "effects"))
from effect_servers import FakeJudge  # noqa: E402

OVER = ["reward.fn=rollkeep.tasks.judge:score", "engine.infra_fail_rate=0", "engine.data_fail_rate=0",
        "data.generated.n_rows=8", "train.num_prompts_per_step=2", "train.total_steps=2",
        "rollout.max_data_attempts=2", "rollout.backoff_ms=0", "reward.timeout_s=2"]


@pytest.mark.parametrize("mode", ["hang", "garbage", "huge", "error500"])
def test_a_misbehaving_judge_is_a_data_failure_within_budgets(tmp_path, monkeypatch, capsys, mode) -> None:
    with FakeJudge(mode) as judge:
        monkeypatch.setenv("ROLLKEEP_JUDGE_URL", judge.url)
        monkeypatch.setenv("ROLLKEEP_JUDGE_TIMEOUT_S", "0.3")
        cfg = config(tmp_path / "run", *OVER)
        code = main(["train", DEFAULTS, *FAST, f"run_dir={cfg.run_dir}", *OVER])
    err = capsys.readouterr().err
    # Every prompt failed: the step is short of its minimum, an external failure (exit 5), not a bug.
    assert code == 5 and "Traceback" not in err and "data budget spent" in err, err
    failed = events(cfg, "failed")
    assert failed and all(x["kind"] == "data" for x in failed)
    assert all("judge" in x["error"] or "reward" in x["error"] for x in failed), failed[0]["error"]
    attempts = {}
    for x in failed:
        attempts[(x["group_id"], x["generation"])] = attempts.get((x["group_id"], x["generation"]), 0) + 1
    assert max(attempts.values()) <= 2, "rollout.max_data_attempts bounds the calls of each sibling"
    done = events(cfg, "effect_done")
    assert done and not any(x["ok"] for x in done), "every call's error is recorded"
    assert all(x["bytes"] <= 4096 for x in done), "an error is recorded as its text, not the body"
    assert events(cfg, "dropped"), "a sibling out of budget drops its prompt"

"""The end-of-run summary and the progress ETA: what a run reports about itself matches
what its trace and its ledger record."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_harness import config, killed, run_child, trace_lines

from rollkeep.controller import train
from rollkeep.controller.summary import Restarts, restarts_in_trace, summary_lines
from rollkeep.progress import Eta, duration


def test_the_eta_is_the_pace_of_the_recent_steps() -> None:
    eta = Eta(100, window=4)
    assert eta.update(10, 0.0) is None  # one step seen: no pace yet
    assert eta.update(11, 2.0) == pytest.approx(89 * 2.0)
    for step in range(12, 20):  # a faster pace fills the window: the slow start drops out
        eta.update(step, 2.0 + (step - 11) * 0.5)
    assert eta.update(20, 6.5) == pytest.approx(80 * 0.5)
    assert eta.update(100, 6.6) == 0


def test_durations_read_as_a_person_would() -> None:
    assert (duration(3.21), duration(245), duration(3725)) == ("3.2 s", "4m05s", "1h02m")


def test_the_summary_lines_name_every_fact() -> None:
    common = dict(step=300, total_steps=300, first_step=120, rl_seconds=134.0, warmup_seconds=31.0,
                  final_eval=(300, {"eval/accuracy": 0.994, "eval/reward_mean": 0.99}),
                  counts={"trained": 2400, "dropped": 3}, now=1000.0, run_dir="runs/arith")
    lines = summary_lines(**common, restarts=Restarts(count=2, steps_redone=5, siblings_regenerated=96,
                                                      down_seconds=4.0, first_t=700.0))
    text = "\n".join(lines)
    assert "300 of 300; this process trained 121-300 in 2m14s (+ 31.0 s warm start)" in text
    assert "final eval  step 300: accuracy 0.994, reward_mean 0.990" in text
    assert "2400 trained, 3 dropped" in text
    assert "restarts    2: 5 step(s) trained again, 96 sibling(s) generated again, 4.0 s down" in text
    assert "5m00s since the first start" in text
    text = "\n".join(summary_lines(**{**common, "final_eval": (None, {})}, restarts=Restarts()))
    assert "restarts    none" in text and "final eval" not in text


@pytest.mark.slow
def test_a_resumed_run_sums_up_its_restart_from_the_trace(tmp_path) -> None:
    cfg = config(tmp_path / "run", "checkpoint.every_steps=3", "engine.latency_ms=5")
    # Killed at the step-6 cut: step 3 is published (a cut waits for the previous write).
    assert killed(run_child(cfg, "checkpoint.after_cut:2"))
    result = train(cfg)
    lines = trace_lines(cfg)
    restored = next(x for x in lines if x["event"] == "restored")
    finished = next(x for x in lines if x["event"] == "run_finished")
    killed_last_t = max(x["t"] for x in lines if x["run_id"] != restored["run_id"])
    started_t = next(x["t"] for x in lines if x["event"] == "run_started" and x["run_id"] == restored["run_id"])

    r = restarts_in_trace(Path(cfg.run_dir) / "trace.jsonl")
    assert (r.count, r.steps_redone, r.siblings_regenerated) == (1, 3, restored["siblings_regenerated"])
    assert r.down_seconds == pytest.approx(started_t - killed_last_t, abs=1e-5)
    # The lineage: the killed run's commits up to the checkpoint, then the resumed run's.
    lineage = [x for x in lines if x["run_id"] == restored["run_id"] or x["t"] <= restored["cut_time"]]
    trained = [p for x in lineage if x["event"] == "step_committed" for p in x["prompts"]]
    dropped = [x["prompt"] for x in lineage if x["event"] == "dropped"]
    text = result.summary()
    assert text.startswith(f"done: step {finished['step']} (finished)")
    assert f"this process trained 4-{finished['step']}" in text
    assert f"{len(trained)} trained, {len(dropped)} dropped" in text
    assert "restarts    1: 3 step(s) trained again" in text

"""The real job: the built-in GPT, GRPO, warm start and evaluation, through the same
controller, ledger and checkpoints as the toy job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from run_harness import (
    DEFAULTS,
    FAST,
    check,
    config,
    final_sha,
    killed,
    run_child,
    run_to_end,
    trace_lines,
)

pytestmark = pytest.mark.slow

TINY = [
    "engine.name=torch", "trainer.name=torch", "engine.max_new_tokens=4",
    "trainer.model.n_layer=1", "trainer.model.n_head=2", "trainer.model.n_embd=32",
    "trainer.model.block_size=16", "trainer.micro_batch_size=8",
    "rollout.group_size=4", "train.num_prompts_per_step=4", "train.total_steps=8",
    "checkpoint.every_steps=2", "warmup.sft_steps=20", "warmup.sft_batch_size=8",
    "checkpoint.warmup_every_steps=5", "data.generated.n_rows=64", "data.epochs=null",
    "deterministic=true", "rollout.on_dropped_prompt=shrink",
]


def test_real_model_kill_and_resume_ends_byte_identical(tmp_path) -> None:
    """Deterministic mode: killed in the warm start, mid-generation, before a commit and
    mid-checkpoint, the resumed run ends with the same weights as one never killed."""
    reference = config(tmp_path / "reference", *TINY)
    run_to_end(reference)
    cfg = config(tmp_path / "killed", *TINY)
    for point in ["publish.latest_replaced:2",  # the warm start's second checkpoint
                  "ledger.sealed:40", "train.before_commit:3", "publish.file_written:2",
                  "ledger.ready:9", "checkpoint.after_cut:1"]:
        assert killed(run_child(cfg, point)), point
    run_to_end(cfg)
    report = check(cfg, final_sha(reference))
    # Five controller restarts: the process killed in the warm start never began RL.
    assert report.restarts == 5 and report.steps == 8
    warm = Path(cfg.run_dir) / "warmup" / "checkpoints"
    assert (warm / "LATEST").read_text().strip() == "step_000020"


@pytest.mark.parametrize("sig, code", [("INT", 130), ("TERM", 143)])
def test_a_signal_in_the_warm_start_checkpoints_it_and_exits_128_plus_signal(tmp_path, sig, code) -> None:
    """The signal lands at the warm start's first checkpoint (step 5 of 20): the step in
    progress is checkpointed, the process exits 128 + signal naming that checkpoint, and
    the rerun resumes the warm start there and ends as a run never stopped."""
    reference = config(tmp_path / "reference", *TINY)
    run_to_end(reference)
    cfg = config(tmp_path / "stopped", *TINY)
    env = {**os.environ, "ROLLKEEP_CRASH_AT": "publish.latest_replaced:1", "ROLLKEEP_CRASH_SIGNAL": sig}
    child = subprocess.run([sys.executable, "-m", "rollkeep", "train", DEFAULTS, *FAST, *TINY,
                            f"run_dir={cfg.run_dir}"], capture_output=True, text=True, env=env, timeout=120)
    assert child.returncode == code, child.stderr
    warm = Path(cfg.run_dir) / "warmup" / "checkpoints"
    reached = int((warm / "LATEST").read_text().strip().removeprefix("step_"))
    assert 5 <= reached < 20  # checkpointed after the step the signal interrupted, not at the end
    assert (f"stopped at warm-start step {reached} by SIG{sig}; a rerun resumes the warm start from "
            f"warmup/checkpoints/step_{reached}") in child.stdout
    assert not (Path(cfg.run_dir) / "checkpoints" / "LATEST").exists()  # RL never began
    run_to_end(cfg)
    check(cfg, final_sha(reference))


def test_metrics_and_eval_are_logged(tmp_path) -> None:
    import math

    from rollkeep.report import analyse

    cfg = config(tmp_path / "run", *TINY, "eval.every_steps=4", "data.generated.eval_rows=16",
                 "logger.tensorboard=true")
    run_to_end(cfg)
    run = Path(cfg.run_dir)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # metrics.jsonl stays numbers: every value but `run_id` (a number, not a bool)
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool)
               for r in records for k, v in r.items() if k != "run_id")
    warm = [r for r in records if "warmup/step" in r]
    steps = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all({"batch_age", "tokens", "trainer/loss", "trainer/clip_frac", "custody/trained"} <= r.keys()
               for r in steps)
    assert [r["step"] for r in evals] == [0, 4, 8]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)
    assert any(e["event"] == "eval" for e in trace_lines(cfg))
    # One TensorBoard event file for the warm start and one for RL (not one overwriting the other).
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2

    # The warm start: one line per step, on its own lines (step 0) under its own run_id.
    assert [r["warmup/step"] for r in warm] == list(range(1, 21)) and {r["step"] for r in warm} == {0}
    assert all(math.isfinite(r["warmup/loss"]) and r["warmup/loss"] > 0 for r in warm)
    assert len({r["run_id"] for r in warm}) == 1 and warm[0]["run_id"] != steps[0]["run_id"]
    # Step 1's clock starts after the warm start ended, so its step time leaves it out.
    assert steps[0]["t"] - steps[0]["step_seconds"] >= warm[-1]["t"]
    assert warm[-1]["warmup/seconds"] >= warm[0]["warmup/seconds"] > 0

    # Response lengths: completion tokens per sibling, at most engine.max_new_tokens (4).
    for r in steps:
        assert 0 <= r["response_length/min"] <= r["response_length/mean"] <= r["response_length/max"] <= 4
        assert 0.0 <= r["response_length/clip_ratio"] <= 1.0
        assert r["tokens_generated_per_s"] > 0 and r["tokens_generated_per_s_run"] > 0

    # Samples: eval.num_samples (4) per eval, the same prompts each time, at the eval's step.
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 4, 8]
    assert all(len(s["samples"]) == 4 and s["run_id"] == steps[0]["run_id"] for s in samples)
    assert len({tuple(x["prompt"] for x in s["samples"]) for s in samples}) == 1
    assert all({"prompt", "completion", "reward", "answer"} == x.keys() and isinstance(x["answer"], str)
               for s in samples for x in s["samples"])

    # The report takes no warm-start line for a step.
    report = analyse(run)
    assert [s.step for s in report.steps] == list(range(1, 9)) and len(report.custody) == 8


# The CI-sized learning test: the default job (reversed-digit answers, lr warmup), with a
# 300-step warm start and 100 GRPO steps. Deterministic mode makes its outcome a function
# of the config alone (no timing), so it cannot flake on a slow or busy machine. Measured
# here: greedy accuracy 0.405 after the warm start, 0.725 after 100 GRPO steps (on 200 of
# the held-out problems); the assertion asks for +0.08, well below the +0.320 measured.
LEARN = [
    "deterministic=true", "rollout.on_dropped_prompt=shrink", "warmup.sft_steps=300",
    "train.total_steps=100", "eval.every_steps=100", "eval.n_rows=200",
    "checkpoint.every_steps=50",
]


def test_grpo_raises_greedy_accuracy(tmp_path) -> None:
    from importlib.resources import files

    from rollkeep.config import load_config

    cfg = load_config(str(files("rollkeep") / "configs" / "arith.yaml"),
                      [*LEARN, f"run_dir={tmp_path / 'run'}", "logger.progress=none"])
    run_to_end(cfg)
    evals = [x for x in trace_lines(cfg) if x["event"] == "eval"]
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    assert [e["step"] for e in evals] == [0, 100]
    assert after >= before + 0.08, (before, after)


def test_real_model_random_sigkills_end_byte_identical(tmp_path) -> None:
    """`rollkeep chaos` on the built-in model: SIGKILLs at random instants and at crash
    points, in subprocesses, then the byte-identical check against an unkilled run."""
    import subprocess
    import sys

    from run_harness import DEFAULTS

    out = subprocess.run(
        [sys.executable, "-m", "rollkeep", "chaos", DEFAULTS, *TINY, "logger.progress=none",
         "--kills", "4", "--seed", "2", "--workdir", str(tmp_path / "chaos")],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(== uninterrupted run)" in out.stdout and "duplicates: 0   lost: 0" in out.stdout

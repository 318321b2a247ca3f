"""`rollkeep bench` preemption and speedup sections: the measures of a killed-and-resumed
job are consistent with each other, with an uninterrupted run and with the final checkpoint.

The kill delays below are the benchmark's own schedule (how long a segment runs before its
SIGKILL), not test synchronisation: the assertions hold wherever the kills land, except
`kills_landed`, which the toy latency makes certain (a segment runs for about a second).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import pytest
from run_harness import FAST

from rollkeep.bench.preemption import kill_schedule, run_preempted
from rollkeep.bench.speedup import async_speedup
from rollkeep.cli import main
from rollkeep.core.restore import restore_chain
from rollkeep.core.store import CheckpointStore

# Twenty steps of 4 groups of 3, every generation 50 + U(0, 50) ms: about a second in all
# (lookahead 1 generates two steps at once), a checkpoint every 2 steps, so a kill lands
# between checkpoints with groups in flight.
# 120 rows leave room for the prompts cursor_only loses and refills from the source.
# (`rollkeep train` with no config runs the packaged arith.yaml, hence the toy config.)
TOY = str(files("rollkeep") / "configs" / "toy.yaml")
TINY = [
    *FAST,
    "train.total_steps=20",
    "engine.latency_ms=50",
    "engine.latency_jitter_ms=50",
    "engine.infra_fail_rate=0",
    "engine.data_fail_rate=0",
    "data.generated.n_rows=120",
]
DELAYS = [0.35, 0.3]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run_preempted(
        TOY, TINY, kill_delays=[], workdir=tmp_path_factory.mktemp("ref"), timeout=120
    )


def _lost_in_final_checkpoint(workdir: Path) -> int:
    restored = restore_chain(
        CheckpointStore(workdir / "run" / "checkpoints"), source=None, config=None
    )
    return sum(reason.startswith("lost") for reason, *_ in restored.ledger.dropped.values())


@pytest.mark.slow
def test_uninterrupted_run_trains_every_generated_token(reference):
    assert reference["kills_landed"] == 0 and reference["restarts"] == 0
    assert reference["steps"] == 20
    assert reference["tokens_generated"] > 0
    # No failures, no kills: every sealed sibling belongs to a trained group.
    assert reference["tokens_trained"] == reference["tokens_generated"]
    assert reference["goodput"] == 1.0
    assert reference["wall_s"] > reference["run_s"] > 0  # wall includes start-up


@pytest.mark.slow
def test_sibling_mode_trains_the_same_tokens_as_the_uninterrupted_run(tmp_path, reference):
    r = run_preempted(
        TOY, [*TINY, "recovery.mode=sibling"], kill_delays=DELAYS, workdir=tmp_path, timeout=120
    )
    assert r["kills_landed"] == 2 and r["restarts"] == 2
    assert r["steps"] == 20
    assert r["prompts_duplicated"] == 0
    assert r["prompts_lost"] == 0
    # The toy engine's completions are functions of the prompt and sibling only, and the
    # surviving lineage trains the same prompts: only the surviving steps are counted.
    assert r["tokens_trained"] == reference["tokens_trained"]
    assert r["tokens_trained"] <= r["tokens_generated"]
    assert 0 < r["goodput"] <= 1
    assert r["goodput"] == r["tokens_trained"] / r["tokens_generated"]


@pytest.mark.slow
def test_cursor_only_counts_the_prompts_the_final_checkpoint_records_as_lost(tmp_path):
    r = run_preempted(
        TOY, [*TINY, "recovery.mode=cursor_only"], kill_delays=DELAYS, workdir=tmp_path, timeout=120
    )
    assert r["kills_landed"] == 2 and r["restarts"] == 2
    assert r["steps"] == 20
    assert r["prompts_duplicated"] == 0
    assert r["prompts_lost"] >= 0
    assert r["prompts_lost"] == _lost_in_final_checkpoint(tmp_path)
    assert 0 < r["tokens_trained"] <= r["tokens_generated"]
    assert 0 < r["goodput"] <= 1


@pytest.mark.slow
def test_lookahead_one_overlaps_generation_and_training(tmp_path):
    r = async_speedup(
        "toy",
        repeats=1,
        quick=True,
        lookaheads=(0, 1),
        steps=12,
        workdir=tmp_path,
        log=lambda _: None,
    )
    la = r["lookaheads"]
    assert set(la) == {"0", "1"} and r["steps"] == 12
    assert la["0"]["speedup_vs_0"] == 1.0
    assert la["1"]["steps_per_s"] == pytest.approx(12 / la["1"]["run_s"])
    # Lookahead 0: a step is generation (~100 ms) then training (100 ms); lookahead 1
    # overlaps them, so about 2x. 1.2x leaves room for a loaded machine.
    assert la["1"]["speedup_vs_0"] > 1.2


def test_kill_schedule_is_shared_per_repeat_and_inside_the_window():
    a, b = kill_schedule(0, 0, 4, 10.0), kill_schedule(0, 0, 4, 10.0)
    assert a == b and len(a) == 4
    # Gaps between sorted instants in [0, 7] s: they add up to at most 7 s of run time.
    assert all(d >= 0 for d in a) and sum(a) <= 7.0 + 1e-9
    assert kill_schedule(0, 1, 4, 10.0) != a
    assert kill_schedule(1, 0, 4, 10.0) != a


def test_async_speedup_needs_the_synchronous_baseline():
    with pytest.raises(ValueError, match="must include 0"):
        async_speedup("toy", repeats=1, lookaheads=(1, 2))


def test_bench_cli_refuses_bad_options_before_running_anything(capsys):
    assert main(["bench", "--suite", "nope"]) == 2
    assert main(["bench", "--suite", "speedup", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err

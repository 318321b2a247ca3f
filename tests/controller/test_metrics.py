"""The metrics records, without a run: the throughput window (time passed in), the
response-length keys of a step line, the warm-start and sample writers."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from rollkeep.controller.metrics import (
    SAMPLES_FILE,
    MetricsLog,
    Throughput,
    samples_markdown,
    step_record,
)
from rollkeep.core.rollout.batch import Batch, TrainGroup
from rollkeep.core.rollout.rows import Row


def test_throughput_is_windowed_and_counts_from_the_start_of_the_rl_loop() -> None:
    tp = Throughput(100.0, window=3)  # the RL loop starts at t=100 with nothing sealed
    # Right after the start the window holds the steps there are.
    assert tp.step(101.0, 50) == (50.0, 50.0)
    assert tp.step(102.0, 150) == (75.0, 75.0)
    assert tp.step(103.0, 300) == (100.0, 100.0)
    # Then only the last 3 steps: the tokens sealed between t=101 and t=104, over 3 s.
    windowed, run = tp.step(104.0, 1000)
    assert windowed == pytest.approx((1000 - 50) / 3) and run == pytest.approx(1000 / 4)
    windowed, run = tp.step(105.0, 1000)  # a step that sealed nothing lowers the window only
    assert windowed == pytest.approx((1000 - 150) / 3) and run == pytest.approx(1000 / 5)


def test_a_resumed_run_reads_the_same_as_a_fresh_one_at_the_same_rate() -> None:
    """The bug: a fresh run's clock included the warm start (tok/s ramped from 20), a resumed
    one's did not. Both count from the start of their own RL loop now."""
    fresh, resumed = Throughput(43.5), Throughput(7000.0)
    for i in range(1, 25):
        a, b = fresh.step(43.5 + i, 1000 * i), resumed.step(7000.0 + i, 1000 * i)
        assert a == b == (pytest.approx(1000.0), pytest.approx(1000.0))


def test_throughput_of_no_elapsed_time_is_zero_and_the_window_is_at_least_one_step() -> None:
    assert Throughput(5.0).step(5.0, 10) == (0.0, 0.0)
    with pytest.raises(ValueError, match="at least one step"):
        Throughput(0.0, window=0)


def _row(n: int, finish: str, reward: float = 0.5) -> Row:
    ids = np.arange(n, dtype=np.int32)
    return Row(prompt_ids=np.arange(3, dtype=np.int32), completion_ids=ids, logprobs=np.zeros(n, np.float32),
               versions=np.zeros(n, np.int32), reward=reward, finish_reason=finish)


def test_a_step_line_has_the_response_lengths_and_both_throughputs() -> None:
    rows = (_row(4, "length"), _row(2, "stop"), _row(1, "stop"), _row(4, "length"))
    batch = Batch(step=1, groups=(TrainGroup("g", 0, 0, 0, "default", (0.0,) * 4, rows),))
    rec = step_record(batch, {"loss": 0.25}, train_seconds=0.1, step_seconds=0.5, generated_per_s=(10.0, 8.0),
                      counts={"trained": 1})
    assert (rec["response_length/mean"], rec["response_length/max"], rec["response_length/min"]) == (2.75, 4, 1)
    assert rec["response_length/clip_ratio"] == 0.5  # 2 of 4 siblings hit the length limit
    assert (rec["tokens_generated_per_s"], rec["tokens_generated_per_s_run"]) == (10.0, 8.0)
    assert all(isinstance(v, (int, float)) for v in rec.values())


def test_warm_start_lines_and_samples(tmp_path) -> None:
    log = MetricsLog(tmp_path, "warm", tensorboard=False, logger=SimpleNamespace(tensorboard=False, wandb=False))
    log.write_warmup(3, {"warmup/loss": 1.5, "warmup/seconds": 0.2})
    with pytest.raises(ValueError, match="warmup/"):
        log.write_warmup(4, {"loss": 1.0})  # a warm-start key without its prefix is a bug
    assert not (tmp_path / SAMPLES_FILE).exists()  # opened by the first samples only
    log.write_samples(0, [{"prompt": "1+1=", "completion": "2|x\n", "reward": 1.0, "answer": "2"}])
    log.write_samples(5, [])  # nothing to write
    log.close()
    [line] = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line["step"] == 0 and line["warmup/step"] == 3 and line["warmup/loss"] == 1.5
    [samples] = [json.loads(x) for x in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert samples["step"] == 0 and samples["run_id"] == "warm" and samples["samples"][0]["answer"] == "2"
    table = samples_markdown(samples["samples"])
    assert table.splitlines()[2] == "| 1+1= | 2\\|x\\n | 1 | 2 |"  # escaped: one row, four cells


def test_a_fifo_at_samples_jsonl_is_refused_without_hanging(tmp_path) -> None:
    os.mkfifo(tmp_path / SAMPLES_FILE)
    log = MetricsLog(tmp_path, "r", tensorboard=False, logger=SimpleNamespace(tensorboard=False, wandb=False))
    with pytest.raises(OSError, match="FIFO"):
        log.write_samples(0, [{"prompt": "p", "completion": "c", "reward": 0.0, "answer": None}])
    log.close()

"""Per-step metrics: `RUN_DIR/metrics.jsonl` always (one JSON object per line, with `t`,
`run_id` and `step`), and TensorBoard event files in `RUN_DIR/tensorboard` with
`logger.tensorboard: true` (needs the `tb` extra: tensorboardX)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import ConfigError


class MetricsLog:
    def __init__(self, run_dir: Path, run_id: str, *, tensorboard: bool) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.run_id = run_id
        self._tb = None
        self._checked = False  # whether the file's last line was checked for a tear
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise ConfigError(
                    "logger.tensorboard is true but tensorboardX is not installed",
                    field="logger.tensorboard",
                    remedy="pip install 'rollkeep[tb]', or set logger.tensorboard=false",
                ) from None
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, step: int, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            if self._torn():
                f.write("\n")  # a killed writer tore its last line: end it there
            f.write(json.dumps({"t": time.time(), "run_id": self.run_id, "step": step, **record}) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def _torn(self) -> bool:
        if self._checked:
            return False
        self._checked = True
        if not self.path.exists() or self.path.stat().st_size == 0:
            return False
        with open(self.path, "rb") as f:
            f.seek(-1, 2)
            return f.read(1) != b"\n"

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def step_record(batch: Any, metrics: dict[str, float], *, train_seconds: float, step_seconds: float,
                generated_per_s: float, counts: dict[str, int]) -> dict[str, Any]:
    """One `metrics.jsonl` line for a committed step (the keys are listed in the README)."""
    rows = [r for g in batch.groups for r in g.rows]
    tokens = sum(r.tokens for r in rows)
    trainer_version = batch.step - 1
    age = float(sum(int((trainer_version - r.versions).sum()) for r in rows) / tokens) if tokens else 0.0
    return {
        "weight_version": batch.step,
        "groups": len(batch.groups),
        "tokens": tokens,
        "reward_mean": float(np.mean([r.reward for r in rows])) if rows else 0.0,
        "batch_age": age,
        "train_seconds": train_seconds,
        "step_seconds": step_seconds,
        "tokens_generated_per_s": generated_per_s,
        **{f"trainer/{k}": float(v) for k, v in metrics.items()},
        **{f"custody/{k}": v for k, v in counts.items()},
    }


def progress_fields(record: dict[str, Any], last_eval: dict[str, float]) -> dict[str, Any]:
    """What the progress bar shows of a step record."""
    return {
        "reward": record["reward_mean"],
        "acc": last_eval.get("eval/accuracy"),
        "age": record["batch_age"],
        "tok/s": round(record["tokens_generated_per_s"]),
        "gen": record["custody/generating"] + record["custody/reserved"],
        "ready": record["custody/ready"],
        "trained": record["custody/trained"],
        "dropped": record["custody/dropped"],
    }

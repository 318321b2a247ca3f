"""Per-step metrics: `RUN_DIR/metrics.jsonl` always (one JSON object per line, with `t`,
`run_id` and `step`), and TensorBoard event files in `RUN_DIR/tensorboard` with
`logger.tensorboard: true` (needs the `tb` extra: tensorboardX)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

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

"""The toy trainer: its "weights" are a running sha256 over the canonical encoding of
every batch it trained (keys in order, completions, rewards, advantages). Two runs end
with equal `weights_sha256` iff they trained the same batches in the same order — a cheap
proof of resume equivalence for the control plane."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ..core.checkpoint.cut import STEP_KEY, save_files
from ..core.errors import CheckpointError
from ..core.io.untrusted import loads_json, read_regular
from .base import Batch, check_step

STATE_FILE = "toy_trainer.json"


def canonical(batch: Batch) -> bytes:
    return msgspec.msgpack.encode(
        [
            batch.step,
            [
                [g.epoch, g.ordinal, g.idx, list(g.advantages),
                 [[r.completion_ids.tolist(), r.reward, r.versions.tolist()] for r in g.rows]]
                for g in batch.groups
            ],
        ]
    )


@dataclass(frozen=True)
class ToySnapshot:
    digest: str
    step: int  # optimizer steps taken = the weight version this state is of

    def state(self) -> bytes:
        """The one file's bytes (the simulated disk writes them through its own `fs`)."""
        return json.dumps({"digest": self.digest, STEP_KEY: self.step}).encode()

    def save(self, dir: Path) -> None:
        save_files({STATE_FILE: self.state()})(dir)


class ToyTrainer:
    name = "toy"

    def __init__(self, *, step_sleep_ms: float = 0.0) -> None:
        self.step_sleep_ms = step_sleep_ms
        self._digest = hashlib.sha256(b"rollkeep toy trainer").hexdigest()
        self._steps = 0

    def train_step(self, batch: Batch) -> dict[str, float]:
        if self.step_sleep_ms > 0:
            time.sleep(self.step_sleep_ms / 1000.0)
        self._digest = hashlib.sha256(self._digest.encode() + canonical(batch)).hexdigest()
        self._steps += 1
        rewards = [r.reward for g in batch.groups for r in g.rows]
        return {"loss": 0.0, "reward_mean": sum(rewards) / max(1, len(rewards))}

    def snapshot(self) -> ToySnapshot:
        return ToySnapshot(self._digest, self._steps)

    def load(self, dir: Path, *, step: int | None = None) -> None:
        try:
            data = read_regular(Path(dir) / STATE_FILE)
        except OSError as e:
            raise CheckpointError(
                "the toy trainer state cannot be read",
                path=f"trainer/{STATE_FILE}",
                expected="a regular file",
                found=e.strerror or str(e),
                remedy="restore from another checkpoint",
            ) from None
        self.load_state(data, step=step)

    def load_state(self, data: bytes, *, step: int | None = None) -> None:
        """`load` from the file's bytes (the simulated disk reads them through its `fs`)."""
        try:
            state = loads_json(data)
            # Before the step binding the same count was called "steps".
            digest, steps = state["digest"], state.get(STEP_KEY, state.get("steps"))
            if not (isinstance(digest, str) and len(digest) == 64 and type(steps) is int and steps >= 0):
                raise ValueError("bad field types")
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise CheckpointError(
                "the toy trainer state is unreadable",
                path=f"trainer/{STATE_FILE}",
                expected=f'{{"digest": <64 hex>, "{STEP_KEY}": <int>}}',
                found=str(e),
                remedy="restore from another checkpoint",
            ) from None
        check_step(STATE_FILE, steps, step)
        self._digest, self._steps = digest, steps

    def weights(self) -> str:
        return self._digest

    def weights_sha256(self) -> str:
        return self._digest

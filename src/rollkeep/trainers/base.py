"""The trainer interface: what the train pump asks of an optimizer backend.

`train_step` runs in a worker thread while the rollout pump keeps going; it reads only its
batch (rows are immutable). `snapshot` runs on the loop thread at a step boundary — the
cut — and must be quick (copy tensors); the snapshot's `files()` serialises on the
checkpoint writer's thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.rows import Row


@dataclass(frozen=True)
class TrainGroup:
    group_id: str
    epoch: int
    ordinal: int
    idx: int
    task: str
    advantages: tuple[float, ...]
    rows: tuple[Row, ...]  # by generation index


@dataclass(frozen=True)
class Batch:
    step: int  # the optimizer step this batch makes; it trains from weight version step - 1
    groups: tuple[TrainGroup, ...]  # sorted by key (deterministic order)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for g in self.groups for r in g.rows)


class TrainerSnapshot(Protocol):
    def files(self) -> dict[str, bytes]:
        """The trainer's checkpoint files (names relative to `trainer/`). Off-loop."""
        ...


class Trainer(Protocol):
    name: str

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer update on `batch`; returns metrics. Blocking (worker thread)."""
        ...

    def snapshot(self) -> TrainerSnapshot:
        """State at this step boundary, copied so later steps cannot change it."""
        ...

    def load(self, files: Mapping[str, bytes]) -> None:
        """Restore from the files of a snapshot. Raises CheckpointError if they are bad."""
        ...

    def weights(self) -> Any:
        """What the engine's `update_weights` takes."""
        ...

    def weights_sha256(self) -> str:
        """Digest of the current weights: equal iff the weights are byte-identical."""
        ...

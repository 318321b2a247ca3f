"""The trainer interface: what the train pump asks of an optimizer backend.

`train_step` runs in a worker thread while the rollout pump keeps going; it reads only its
batch (rows are immutable). `snapshot` runs on the loop thread at a step boundary — the
cut — and must be quick (copy tensors); the snapshot's `files()` serialises on the
checkpoint writer's thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from ..core.batch import Batch, TrainGroup
from ..core.errors import CheckpointError

__all__ = ["Batch", "TrainGroup", "Trainer", "TrainerSnapshot", "check_step"]


class TrainerSnapshot(Protocol):
    step: int  # optimizer steps taken = the weight version the state is of

    def files(self) -> dict[str, bytes]:
        """The trainer's checkpoint files (names relative to `trainer/`). Off-loop.

        Each file declares `step` (`rollkeep_step`: a top-level key of a JSON file, a
        safetensors `__metadata__` entry), so the restore chain can refuse a file copied
        in from another checkpoint (docs/design.md §5, step 5)."""
        ...


class Trainer(Protocol):
    name: str

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer update on `batch`; returns metrics. Blocking (worker thread)."""
        ...

    def snapshot(self) -> TrainerSnapshot:
        """State at this step boundary, copied so later steps cannot change it."""
        ...

    def load(self, files: Mapping[str, bytes], *, step: int | None = None) -> None:
        """Restore from the files of a snapshot. Raises CheckpointError if they are bad or,
        with `step`, if they are not of that step (the controller always passes it)."""
        ...

    def weights(self) -> Any:
        """What the engine's `update_weights` takes."""
        ...

    def weights_sha256(self) -> str:
        """Digest of the current weights: equal iff the weights are byte-identical."""
        ...


def check_step(file: str, found: int | None, step: int | None) -> None:
    """Refuse a trainer file whose declared step is not `step` (None: no check)."""
    if step is not None and found != step:
        raise CheckpointError(
            f"the trainer file {file} holds the state of step {found}, not of step {step}",
            path=f"trainer/{file}",
            field="rollkeep_step",
            expected=f"step {step} (the ledger's version)",
            found=f"step {found}",
            remedy="restore from another checkpoint; this one mixes files of different steps",
        )

"""The trainer interface: what the train pump asks of an optimizer backend.

`train_step` runs in a worker thread while the rollout pump keeps going; it reads only its
batch (rows are immutable). `snapshot` runs on the loop thread at a step boundary — the
cut — and must be quick (copy tensors); the snapshot's `save(dir)` writes the files on the
checkpoint writer's thread, into a directory the store gives it; `load(dir, step=)` reads
them back from the checkpoint's verified `trainer/` directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..core.errors import CheckpointError
from ..core.rollout.batch import Batch, TrainGroup

__all__ = ["Batch", "TrainGroup", "Trainer", "TrainerSnapshot", "check_step"]


class TrainerSnapshot(Protocol):
    step: int  # optimizer steps taken = the weight version the state is of

    def save(self, dir: Path) -> None:
        """Write the trainer's checkpoint files into `dir` (an empty directory, the
        checkpoint's `trainer/` before it is published), on the checkpoint writer's thread.
        Subdirectories are allowed (a sharded state); only regular files and directories,
        with names of letters, digits, '.', '_' and '-'. The store hashes and fsyncs them.

        Record `step` in the files (`rollkeep_step`: a top-level key of a JSON file, a
        safetensors `__metadata__` entry), so the restore chain can refuse a file copied in
        from another checkpoint (docs/design.md §5, step 5). Files the core cannot read (a
        `.distcp` shard) need a JSON file beside them that records the step."""
        ...


class Trainer(Protocol):
    name: str

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer update on `batch`; returns metrics. Blocking (worker thread)."""
        ...

    def snapshot(self) -> TrainerSnapshot:
        """State at this step boundary, copied so later steps cannot change it (loop
        thread: a copy, no serialisation)."""
        ...

    def load(self, dir: Path, *, step: int | None = None) -> None:
        """Restore from a directory a snapshot's `save` wrote (its files verified against
        the manifest); read it, never modify it. Raises CheckpointError if the files are
        bad or, with `step`, if they are not of that step (the controller always passes it)."""
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

"""The engine interface: what the rollout pump asks of a generation backend.

An engine generates one sibling per `generate` call; backends batch concurrent calls
themselves. Cancelling the awaiting task aborts the request. Sampling randomness must be
a pure function of `GenRequest.seed` (and the weights), never of timing or batch
composition, so a regenerated rollout can reproduce the lost one (docs/design.md §2).
"""

from __future__ import annotations

from typing import Any, Protocol

from ..core.generation import Completion, DataError, GenRequest, InfraError, sampling_seed

__all__ = ["Completion", "DataError", "Engine", "GenRequest", "InfraError", "sampling_seed"]


class Engine(Protocol):
    name: str

    @property
    def version(self) -> int:
        """The weight version generation currently runs under."""
        ...

    async def generate(self, request: GenRequest) -> Completion:
        """One sibling. Raises InfraError or DataError; cancel the task to abort."""
        ...

    async def update_weights(self, weights: Any, version: int) -> None:
        """Load new weights. In fast mode engines may apply them between decoding steps."""
        ...

    async def close(self) -> None: ...

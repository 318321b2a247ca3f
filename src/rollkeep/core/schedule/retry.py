"""Failure budgets and backoff (docs/design.md §6): after a failed attempt, retry the sibling
later or, once its budget for that kind of failure is spent, drop the group."""

from __future__ import annotations

from dataclasses import dataclass

from ..custody.events import INFRA
from ..custody.ledger import GroupRecord


@dataclass(frozen=True)
class RetryPolicy:
    max_infra_attempts: int
    max_data_attempts: int
    backoff_ms: float  # first retry delay; doubles per failure of the sibling
    backoff_max_ms: float

    def spent(self, rec: GroupRecord, generation: int, kind: str) -> bool:
        """Whether the sibling's budget for `kind` is spent (its failure is counted)."""
        if kind == INFRA:
            return rec.infra_failures[generation] >= self.max_infra_attempts
        return rec.data_failures[generation] >= self.max_data_attempts

    def retry_at(self, rec: GroupRecord, generation: int, now: float) -> float:
        """When the sibling may be dispatched again (seconds, on the caller's clock)."""
        failures = rec.infra_failures[generation] + rec.data_failures[generation]
        delay_ms = min(self.backoff_ms * 2 ** (failures - 1), self.backoff_max_ms)
        return now + delay_ms / 1000.0


def budget_reason(kind: str, error: str) -> str:
    """The DROPPED reason of a group whose `kind` budget is spent."""
    return f"{kind} budget spent ({error[:200]})"

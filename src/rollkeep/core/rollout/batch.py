"""A train step's batch: the claimed groups with their rows and advantages, in key order.

Built by the scheduler from the ledger and the row store when it claims a step; read by a
trainer in a worker thread (rows are immutable)."""

from __future__ import annotations

from dataclasses import dataclass

from .rows import Row


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

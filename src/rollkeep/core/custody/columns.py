"""A captured ledger's group records sorted by key, with their per-sibling arrays as columns.

A checkpoint lists every sealed sibling's row and encodes every record, both in key order.
`GroupColumns` sorts once (numpy `lexsort` over two columns read in C-level passes, not a
Python key function per record) and flattens the statuses and attempt numbers in a few
joins; the row listing (`checkpoint.cut.sealed_columns`) and the codec's canonical order
(`codec.encode(..., ordered=)`) both read it, so the codec no longer sorts again (issue 29:
its encoding at 100 k groups 0.05 -> 0.02 s).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from itertools import chain
from operator import attrgetter

import numpy as np

from .records import GroupRecord

_EPOCH, _ORDINAL, _STATUS, _ATTEMPTS = (attrgetter(f) for f in ("epoch", "ordinal", "status", "attempts"))


class GroupColumns:
    """The records of `groups` (group id -> record), sorted by key (epoch, ordinal; ties in
    the mapping's order, as `sorted` would): position i is `records[i]`, stored under
    `ids[i]`. Per-sibling columns are flat: group i's siblings are at
    `starts[i]:starts[i] + sizes[i]`, read as the records hold them (a record whose
    arrays disagree in length, which the audit refuses, misaligns them)."""

    def __init__(self, groups: Mapping[str, GroupRecord]) -> None:
        ids, records = list(groups), list(groups.values())
        epoch, ordinal = list(map(_EPOCH, records)), list(map(_ORDINAL, records))
        try:
            order = np.lexsort((np.array(ordinal, np.int64), np.array(epoch, np.int64)))
        except OverflowError:  # a key past int64 (a damaged state): Python's sort, same order
            order = np.array(sorted(range(len(records)), key=lambda i: (epoch[i], ordinal[i])), np.int64)
        if not np.array_equal(order, np.arange(len(records))):
            take = order.tolist()
            ids, records = list(map(ids.__getitem__, take)), list(map(records.__getitem__, take))
        self.ids: list[str] = ids
        self.records: list[GroupRecord] = records

    def __len__(self) -> int:
        return len(self.records)

    @cached_property
    def sizes(self) -> np.ndarray:
        """Siblings per group (int64): the length of its status array."""
        return np.fromiter(map(len, self._statuses), np.int64, len(self))

    @cached_property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.sizes) - self.sizes

    @cached_property
    def status(self) -> np.ndarray:
        """Every sibling's current attempt's `AttemptStatus`, flat (uint8)."""
        return np.frombuffer(b"".join(self._statuses), np.uint8)

    @cached_property
    def attempts(self) -> np.ndarray:
        """Every sibling's current attempt number, flat (int64). Most groups never retried:
        only those with a nonzero attempt are copied sibling by sibling."""
        col, total = list(map(_ATTEMPTS, self.records)), int(self.sizes.sum())
        retried = np.flatnonzero(np.fromiter(map(any, col), bool, len(col))).tolist()
        if len(retried) > len(col) // 8:  # many: one pass over them all
            return np.fromiter(chain.from_iterable(col), np.int64, total)
        out, starts = np.zeros(total, np.int64), self.starts
        for i in retried:
            out[starts[i]:starts[i] + len(col[i])] = col[i]
        return out

    @cached_property
    def _statuses(self) -> list[bytearray]:
        return list(map(_STATUS, self.records))

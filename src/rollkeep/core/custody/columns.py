"""A captured ledger's group records as columns, for the passes that read every record.

A checkpoint audits, lists and encodes every group record; at 100 k groups, done record by
record in Python, that was most of its write (issue 29). `GroupColumns` takes the records
apart field by field, each in one C-level pass (`map(attrgetter)`, byte joins), and sorts
them by key once: the audit's fast path (`audit.check_records`), the rows a checkpoint
names (`checkpoint.cut.sealed_columns`) and the codec's canonical order all read it. Columns are built lazily, each the first time it is read.

Nothing here decides whether a record is valid: a column of a malformed record (a
per-sibling array of the wrong length, an integer past int64) is whatever the pass makes
of it, and `regular` says whether the per-sibling columns line up at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from itertools import chain
from operator import attrgetter

import numpy as np

from .records import GroupRecord

_EPOCH, _ORDINAL = attrgetter("epoch"), attrgetter("ordinal")


class GroupColumns:
    """The records of `groups` (group id -> record), sorted by key (epoch, ordinal; ties in
    the mapping's order, as `sorted` would). Position i is `records[i]`, stored under
    `ids[i]`, the `order[i]`-th item of the mapping. Per-sibling columns are flat: group
    i's siblings are at `starts[i]:starts[i] + sizes[i]`."""

    def __init__(self, groups: Mapping[str, GroupRecord]) -> None:
        ids, records = list(groups), list(groups.values())
        epoch, ordinal = list(map(_EPOCH, records)), list(map(_ORDINAL, records))
        n = len(records)
        try:
            order = np.lexsort((np.array(ordinal, np.int64), np.array(epoch, np.int64)))
        except OverflowError:  # a key past int64 (a damaged file): Python's sort, same order
            order = np.array(sorted(range(n), key=lambda i: (epoch[i], ordinal[i])), np.int64)
        if n and not np.array_equal(order, np.arange(n)):
            take = order.tolist()
            ids, records, epoch, ordinal = ([*map(col.__getitem__, take)] for col in (ids, records, epoch, ordinal))
        self.ids: list[str] = ids
        self.records: list[GroupRecord] = records
        self.order: np.ndarray = order
        self._columns: dict[str, list] = {"epoch": epoch, "ordinal": ordinal}

    def __len__(self) -> int:
        return len(self.records)

    def column(self, name: str) -> list:
        """One field of every record, in key order, as the records hold it."""
        col = self._columns.get(name)
        if col is None:
            col = self._columns[name] = list(map(attrgetter(name), self.records))
        return col

    def ints(self, name: str) -> np.ndarray:
        """An int field as int64; OverflowError for a value past int64."""
        return np.array(self.column(name), np.int64)

    def optional(self, name: str) -> np.ndarray:
        """An `int | None` field as float64, None as NaN (exact below 2**53)."""
        return np.array(self.column(name), np.float64)

    @cached_property
    def sizes(self) -> np.ndarray:
        """Siblings per group (the length of its status array)."""
        return np.fromiter(map(len, self.column("status")), np.int64, len(self))

    @cached_property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.sizes) - self.sizes

    @cached_property
    def regular(self) -> bool:
        """Every group has at least one sibling and its four per-sibling arrays agree in
        length: the flat columns line up."""
        sizes = self.sizes
        return bool(len(self) == 0 or sizes.min() >= 1) and all(
            np.array_equal(np.fromiter(map(len, self.column(name)), np.int64, len(self)), sizes)
            for name in ("attempts", "infra_failures", "data_failures"))

    def flat(self, name: str) -> np.ndarray:
        """A bytearray field (status, infra_failures, data_failures), flat, as uint8."""
        return np.frombuffer(b"".join(self.column(name)), np.uint8)

    @cached_property
    def status(self) -> np.ndarray:
        return self.flat("status")

    @cached_property
    def attempts(self) -> np.ndarray:
        """Every sibling's current attempt number, flat (int64). Most groups never retried:
        only the groups with a nonzero attempt are read sibling by sibling."""
        col, total = self.column("attempts"), int(self.sizes.sum())
        retried = np.flatnonzero(np.fromiter(map(any, col), bool, len(col))).tolist()
        if len(retried) > len(col) // 8:  # many: one pass over them all
            return np.fromiter(chain.from_iterable(col), np.int64, total)
        out, starts = np.zeros(total, np.int64), self.starts
        for i in retried:
            out[starts[i]:starts[i] + len(col[i])] = col[i]
        return out

"""The prompt source: a map-style dataset visited in a seeded permutation per epoch.

A prompt's identity is its key `(epoch, ordinal)`; the row it names is
`idx = permutation(seed, epoch, n_rows)[ordinal]`. The source keeps no cursor of its own
(the ledger owns it, docs/design.md §1), so its whole state is `(seed, epoch, ordinal)` and any
cursor resumes exactly the sequence an uninterrupted run would have visited.

Three values are part of the checkpoint format and must never change: the permutation
formula (`rollkeep.core.rollout.permutation`), `row_fingerprint` (`rollkeep.core.rollout.datasets`), and
`PromptSource.fingerprint`. Tests pin them.

The datasets themselves (rows, readers, their checks) are `rollkeep.core.rollout.datasets`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import msgspec
import numpy as np
import xxhash

from rollkeep.core.custody.keys import Key, exhausted, group_id, next_key
from rollkeep.core.errors import CustodyError, DatasetError, UserInputError
from rollkeep.core.rollout.datasets import (  # SequenceDataset, load_dataset: public, long imported from here
    DEFAULT_TASK,
    Dataset,
    SequenceDataset,
    check_row,
    load_dataset,
    row_fingerprint,
    short,
)
from rollkeep.core.rollout.permutation import MAX_SEED, permutation

__all__ = [
    "DatasetId",
    "Prompt",
    "PromptRef",
    "PromptSource",
    "SequenceDataset",
    "load_dataset",
]


# --- records -------------------------------------------------------------------------------


class PromptRef(msgspec.Struct, frozen=True):
    """What a group record stores about its prompt, and what restore step 7 re-checks."""

    key: Key
    group_id: str
    idx: int
    task: str
    row_fingerprint: int


class DatasetId(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    """What a run records of its dataset (a checkpoint's manifest `dataset`, the journal's
    restart markers) and a restore checks (step 7): its size, the permutation seed, the
    epochs and the content fingerprint (`PromptSource.fingerprint`)."""

    n_rows: int
    seed: int
    epochs: int | None
    fingerprint: str


class Prompt(msgspec.Struct, frozen=True):
    """A rehydrated prompt. `row` is a read-only view of the dataset row."""

    key: Key
    group_id: str
    idx: int
    task: str
    row: Mapping[str, Any]
    row_fingerprint: int
    prompt: str


# --- the source ----------------------------------------------------------------------------


class PromptSource:
    """Maps keys to dataset rows and walks keys in visit order; holds no cursor.

    A cursor is the key of the next prompt to hand out. Past the last epoch of a bounded
    source it is `Key(epochs, 0)` (or any later key): the source is exhausted there.
    """

    _CACHED_EPOCHS = 2  # in-flight groups straddle at most one epoch boundary

    def __init__(self, dataset: Dataset, *, seed: int, epochs: int | None) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
            raise UserInputError(
                "Invalid prompt source seed",
                expected="an int with 0 <= seed < 2**63",
                found=short(seed),
                field="seed",
            )
        if epochs is not None and (
            isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0
        ):
            raise UserInputError(
                "Invalid number of epochs",
                expected="None (unbounded) or an int >= 0",
                found=short(epochs),
                field="epochs",
            )
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise UserInputError(
                "Dataset is not map-style",
                expected="an object with __len__ and __getitem__",
                found=type(dataset).__name__,
            )
        n_rows = len(dataset)
        if n_rows == 0:
            raise DatasetError("Dataset is empty", expected="at least one row", found="0 rows")
        self._dataset = dataset
        self._n_rows = n_rows
        self._seed = seed
        self._epochs = epochs
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()
        self._fingerprint: str | None = None

    @property
    def n_rows(self) -> int:
        return self._n_rows

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def epochs(self) -> int | None:
        """Number of epochs, or None for unbounded."""
        return self._epochs

    # keys and visit order

    def _key_problem(self, key: tuple[int, int]) -> str | None:
        epoch, ordinal = key
        if not (isinstance(epoch, int) and isinstance(ordinal, int)):
            return f"key {key!r} is not a pair of ints"
        if epoch < 0 or (self._epochs is not None and epoch >= self._epochs):
            return f"key {group_id(key)}: epoch {epoch} is outside 0..{self._epochs_text()}"
        if not 0 <= ordinal < self._n_rows:
            return f"key {group_id(key)}: ordinal {ordinal} is outside 0..{self._n_rows - 1} (n_rows={self._n_rows})"
        return None

    def _epochs_text(self) -> str:
        return "unbounded" if self._epochs is None else str(self._epochs - 1)

    def _check_key(self, key: tuple[int, int]) -> Key:
        problem = self._key_problem(key)
        if problem is not None:
            raise CustodyError(
                "Key is not a prompt of this source",
                expected=f"epoch in 0..{self._epochs_text()} and ordinal in 0..{self._n_rows - 1}",
                found=problem,
            )
        return Key(*key)

    def _check_cursor(self, cursor: tuple[int, int]) -> Key:
        epoch, ordinal = cursor
        if (
            not (isinstance(epoch, int) and isinstance(ordinal, int))
            or epoch < 0
            or not 0 <= ordinal < self._n_rows
        ):
            raise CustodyError(
                "Cursor is not a position of this source",
                expected=f"epoch >= 0 and ordinal in 0..{self._n_rows - 1}",
                found=repr(tuple(cursor)),
            )
        return Key(epoch, ordinal)

    def idx(self, key: tuple[int, int]) -> int:
        """The dataset row `key` names. Keeps the last two epochs' permutations."""
        epoch, ordinal = self._check_key(key)
        perm = self._perms.get(epoch)
        if perm is None:
            perm = permutation(self._seed, epoch, self._n_rows)
            self._perms[epoch] = perm
            while len(self._perms) > self._CACHED_EPOCHS:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return int(perm[ordinal])

    def keys_from(self, cursor: tuple[int, int]) -> Iterator[Key]:
        """Every key at or after `cursor`, in visit order (endless if epochs is None): the
        sequence the ledger's cursor walks (`keys.next_key`), for tools and tests."""
        key = self._check_cursor(cursor)
        while not exhausted(key, self._epochs):
            yield key
            key = next_key(key, self._n_rows)

    # rows

    def _row(self, idx: int) -> Mapping[str, Any]:
        row = self._dataset[idx]
        # Loaded datasets were validated already; this catches a raw user dataset.
        check_row(row, f"index {idx}", None)
        return row

    def describe(self, key: tuple[int, int]) -> PromptRef:
        """The reference a group record stores for `key`."""
        key = self._check_key(key)
        idx = self.idx(key)
        row = self._row(idx)
        return PromptRef(
            key, group_id(key), idx, row.get("task", DEFAULT_TASK), row_fingerprint(row)
        )

    def rehydrate(self, key: tuple[int, int]) -> Prompt:
        """Rebuild the prompt for `key`; the same key always gives the same prompt."""
        key = self._check_key(key)
        idx = self.idx(key)
        row = self._row(idx)
        return Prompt(
            key=key,
            group_id=group_id(key),
            idx=idx,
            task=row.get("task", DEFAULT_TASK),
            row=MappingProxyType(dict(row)),
            row_fingerprint=row_fingerprint(row),
            prompt=row["prompt"],
        )

    # identity of the dataset

    def fingerprint(self) -> str:
        """`"{n_rows}:{hex}"`: xxh3-64 over every row fingerprint (8 bytes, little-endian)
        in idx order. Detects an edited, reordered, grown or shrunk dataset. Computed once
        (it reads every row) and cached."""
        if self._fingerprint is None:
            hasher = xxhash.xxh3_64()
            for i in range(self._n_rows):
                hasher.update(row_fingerprint(self._row(i)).to_bytes(8, "little"))
            self._fingerprint = f"{self._n_rows}:{hasher.hexdigest()}"
        return self._fingerprint

    def identity(self) -> DatasetId:
        return DatasetId(self._n_rows, self._seed, self._epochs, self.fingerprint())

    def check_ref(
        self, ref_key: tuple[int, int], idx: int, task: str, row_fingerprint: int
    ) -> str | None:
        """None if the dataset still gives `idx`, `task` and `row_fingerprint` for `ref_key`,
        else a one-line description of the first difference (restore step 7)."""
        problem = self._key_problem(ref_key)
        if problem is not None:
            return problem
        now = self.describe(ref_key)
        gid = now.group_id
        if now.idx != idx:
            return f"{gid}: idx is {now.idx}, recorded {idx} (the row count or seed changed)"
        diffs = []
        if now.task != task:
            diffs.append(f"task is {now.task!r}, recorded {task!r}")
        if now.row_fingerprint != row_fingerprint:
            diffs.append(
                f"row_fingerprint is {now.row_fingerprint:016x}, recorded {row_fingerprint:016x} "
                "(the row was edited)"
            )
        return (f"{gid} (idx {idx}): " + "; ".join(diffs)) if diffs else None

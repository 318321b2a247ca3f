"""The prompt source: a map-style dataset visited in a seeded permutation per epoch.

A prompt's identity is its key `(epoch, ordinal)`; the row it names is
`idx = permutation(seed, epoch, n_rows)[ordinal]`. The source keeps no cursor of its own
(the ledger owns it, docs/design.md §1), so its whole state is `(seed, epoch, ordinal)` and any
cursor resumes exactly the sequence an uninterrupted run would have visited.

Three values here are part of the checkpoint format and must never change: the
permutation formula, `row_fingerprint`, and `PromptSource.fingerprint`. Tests pin them.

Rows are mappings with a string `prompt`, an optional string `task` (default
`"default"`), and any other fields, passed through untouched for reward functions.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import msgspec
import numpy as np
import xxhash

from rollkeep.core.errors import CustodyError, DatasetError, UserInputError
from rollkeep.core.keys import Key, exhausted, group_id, next_key
from rollkeep.core.untrusted import loads_json, read_regular

DEFAULT_TASK = "default"
MAX_SEED = 2**63


class Dataset(Protocol):
    """Anything map-style: a length and rows by index."""

    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> Mapping[str, Any]: ...


# --- rows ----------------------------------------------------------------------------------


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _row_problem(row: Any) -> tuple[str, str, str, str | None] | None:
    """What is wrong with a row, as (what, expected, found, field), or None if it is fine."""
    if not isinstance(row, Mapping):
        return (
            "row is not an object",
            "a JSON object",
            f"{type(row).__name__} {_short(row)}",
            None,
        )
    if "prompt" not in row:
        return ("row has no `prompt`", "a `prompt` field", f"fields {sorted(row)}", "prompt")
    if not isinstance(row["prompt"], str):
        prompt = row["prompt"]
        return (
            "`prompt` is not a string",
            "a string",
            f"{type(prompt).__name__} {_short(prompt)}",
            "prompt",
        )
    if "task" in row and not isinstance(row["task"], str):
        task = row["task"]
        return (
            "`task` is not a string",
            "a string (or no `task` field)",
            f"{type(task).__name__} {_short(task)}",
            "task",
        )
    return None


def _check_row(row: Any, where: str, path: str | None) -> None:
    """Raise a DatasetError naming `where` if the row is malformed."""
    problem = _row_problem(row)
    if problem is None:
        return
    what, expected, found, field = problem
    raise DatasetError(
        f"Malformed dataset row at {where}: {what}",
        expected=expected,
        found=found,
        remedy="fix the row so it is an object with a string `prompt` and, optionally, a string `task`.",
        path=path,
        field=field,
    )


def row_fingerprint(row: Mapping[str, Any]) -> int:
    """xxh3-64 of the row's canonical JSON (sorted keys, no spaces, UTF-8).

    Recorded with every group so a restore detects a row edited under the same idx: the
    idx alone would silently train the edited row as if it were the recorded one.
    Part of the checkpoint format: the encoding must never change.
    """
    try:
        encoded = json.dumps(dict(row), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as err:
        raise DatasetError(
            "Dataset row cannot be fingerprinted: it is not JSON-serializable",
            expected="JSON values only (str, number, bool, null, list, object with string keys)",
            found=str(err),
            remedy="convert the row's values to JSON types before building the dataset.",
        ) from err
    return xxhash.xxh3_64_intdigest(encoded.encode("utf-8"))


class SequenceDataset:
    """An in-memory sequence of rows, validated once at construction.

    The outer sequence is copied (so its length cannot change under the source); the rows
    themselves are not, and must not be mutated afterwards.
    """

    def __init__(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self._rows = tuple(rows)
        if not self._rows:
            raise DatasetError("Dataset is empty", expected="at least one row", found="0 rows")
        for i, row in enumerate(self._rows):
            _check_row(row, f"index {i}", None)
            try:
                row_fingerprint(row)
            except DatasetError as err:
                raise DatasetError(
                    f"Dataset row at index {i} is not JSON-serializable",
                    expected=err.expected,
                    found=err.found,
                    remedy=err.remedy,
                ) from err

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, idx: int) -> Mapping[str, Any]:
        return self._rows[idx]


class JsonlDataset:
    """One JSON object per line, all parsed and validated at load.

    Lines are split on `\\n` only: U+2028 and friends may appear inside JSON strings.
    Blank lines at the end of the file are ignored; a blank line anywhere else is an error,
    because it usually means a row was lost in an edit.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            data = read_regular(self.path, follow_symlinks=True)  # a FIFO is refused, not waited on
        except OSError as err:
            raise DatasetError(
                "Cannot read the dataset file",
                found=f"{type(err).__name__}: {err.strerror or err}",
                remedy="check the dataset path.",
                path=str(self.path),
            ) from err
        lines = data.split(b"\n")
        while lines and not lines[-1].strip():
            lines.pop()
        rows: list[dict[str, Any]] = []
        for lineno, raw in enumerate(lines, start=1):
            rows.append(self._parse(lineno, raw))
        if not rows:
            raise DatasetError(
                "Dataset is empty", expected="at least one row", found="0 rows", path=str(self.path)
            )
        self._rows = rows

    def _parse(self, lineno: int, raw: bytes) -> dict[str, Any]:
        where = f"line {lineno} of {self.path}"

        def fail(what: str, expected: str, found: str) -> DatasetError:
            return DatasetError(
                f"Malformed dataset row at {where}: {what}",
                expected=expected,
                found=found,
                remedy="write one JSON object per line, with no blank lines between rows.",
                path=str(self.path),
            )

        if not raw.strip():
            raise fail("blank line", "one JSON object per line", "an empty line")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise fail("not UTF-8", "UTF-8 text", str(err)) from err
        try:
            row = loads_json(text)  # strict: a duplicate key or NaN is refused, not guessed
        except json.JSONDecodeError as err:
            raise fail("not JSON", "a JSON object", f"{err.msg} at column {err.colno}") from err
        except ValueError as err:  # a duplicate key, NaN/Infinity, or nesting too deep
            raise fail(str(err), "a JSON object with distinct keys and finite numbers", str(err)) from err
        _check_row(row, where, str(self.path))
        return row

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, idx: int) -> Mapping[str, Any]:
        return self._rows[idx]


def load_dataset(path: str | Path) -> Dataset:
    """Load `.jsonl` natively, or `.parquet` and directories through HF `datasets`."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return JsonlDataset(path)
    if path.suffix == ".parquet" or path.is_dir():
        return _load_hf(path)
    raise UserInputError(
        "Unknown dataset format",
        expected="a .jsonl file, a .parquet file, or a directory readable by `datasets`",
        found=f"suffix {path.suffix!r}" if path.suffix else "no suffix and not a directory",
        remedy="convert the dataset to JSONL or Parquet.",
        path=str(path),
    )


def _load_hf(path: Path) -> Dataset:
    try:
        import datasets
    except ImportError as err:
        raise UserInputError(
            "Reading Parquet files and dataset directories needs the `datasets` library",
            found="`datasets` is not installed",
            remedy="pip install 'rollkeep[data]', or convert the dataset to JSONL.",
            path=str(path),
        ) from err
    if path.is_dir() and (path / "state.json").exists():
        ds = datasets.load_from_disk(str(path))
    elif path.is_dir():
        ds = datasets.load_dataset(str(path), split="train")
    else:
        ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    if len(ds) == 0:
        raise DatasetError(
            "Dataset is empty", expected="at least one row", found="0 rows", path=str(path)
        )
    # The same checks as a JSONL row, read column-wise: fetching every row is slow.
    if "prompt" not in ds.column_names:
        _check_row(ds[0], "index 0", str(path))
    for column in ("prompt", "task"):
        if column in ds.column_names:
            for i, value in enumerate(ds[column]):
                if not isinstance(value, str):
                    _check_row(ds[i], f"index {i}", str(path))
    return ds


# --- the permutation -----------------------------------------------------------------------

_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK = 2**64 - 1


def _mix_int(z: int) -> int:
    """The splitmix64 finalizer on a Python int (mod 2**64)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def _mix_array(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on a uint64 array; numpy array arithmetic wraps mod 2**64."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The visit order of epoch `epoch`: `perm[ordinal] = idx`, int64, length `n`.

    Part of the checkpoint format, so it uses no numpy RNG (whose streams may change
    between versions). With `mix` the splitmix64 finalizer

        mix(z) = z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
                 z ^= z >> 27; z *= 0x94D049BB133111EB;
                 z ^ (z >> 31)                                  (all mod 2**64)

    and G = 0x9E3779B97F4A7C15:

        stream = mix(mix(seed) + G * (epoch + 1))
        hash_i = mix(stream + G * (i + 1))                      for i in 0..n-1
        perm   = argsort(hash, kind="stable")

    `mix` is a bijection and G is odd, so the n hashes are distinct (for n < 2**64) and
    the order has no ties; the stable sort only makes that explicit.
    """
    if not 0 <= seed < MAX_SEED:
        raise UserInputError(
            "Permutation seed out of range", expected="0 <= seed < 2**63", found=str(seed)
        )
    if epoch < 0 or n < 0:
        raise UserInputError(
            "Permutation epoch and size must be >= 0", found=f"epoch={epoch}, n={n}"
        )
    stream = _mix_int(_mix_int(seed) + _GOLDEN * (epoch + 1))
    positions = np.arange(1, n + 1, dtype=np.uint64)
    hashes = _mix_array(np.uint64(stream) + positions * np.uint64(_GOLDEN))
    return np.argsort(hashes, kind="stable").astype(np.int64, copy=False)


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
                found=_short(seed),
                field="seed",
            )
        if epochs is not None and (
            isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0
        ):
            raise UserInputError(
                "Invalid number of epochs",
                expected="None (unbounded) or an int >= 0",
                found=_short(epochs),
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
        _check_row(row, f"index {idx}", None)
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

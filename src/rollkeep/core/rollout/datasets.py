"""Dataset readers: a map-style dataset of prompt rows, read and validated once.

Rows are mappings with a string `prompt`, an optional string `task` (default
`"default"`), and any other fields, passed through untouched for reward functions.
JSONL is read natively; Parquet files and dataset directories through HF `datasets`.

`row_fingerprint` is part of the checkpoint format and must never change: tests pin it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import xxhash

from rollkeep.core.errors import DatasetError, UserInputError
from rollkeep.core.io.untrusted import loads_json, read_regular

__all__ = [
    "DEFAULT_TASK",
    "Dataset",
    "JsonlDataset",
    "SequenceDataset",
    "check_row",
    "load_dataset",
    "row_fingerprint",
]

DEFAULT_TASK = "default"


class Dataset(Protocol):
    """Anything map-style: a length and rows by index."""

    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> Mapping[str, Any]: ...


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _row_problem(row: Any) -> tuple[str, str, str, str | None] | None:
    """What is wrong with a row, as (what, expected, found, field), or None if it is fine."""
    if not isinstance(row, Mapping):
        return (
            "row is not an object",
            "a JSON object",
            f"{type(row).__name__} {short(row)}",
            None,
        )
    if "prompt" not in row:
        return ("row has no `prompt`", "a `prompt` field", f"fields {sorted(row)}", "prompt")
    if not isinstance(row["prompt"], str):
        prompt = row["prompt"]
        return (
            "`prompt` is not a string",
            "a string",
            f"{type(prompt).__name__} {short(prompt)}",
            "prompt",
        )
    if "task" in row and not isinstance(row["task"], str):
        task = row["task"]
        return (
            "`task` is not a string",
            "a string (or no `task` field)",
            f"{type(task).__name__} {short(task)}",
            "task",
        )
    return None


def check_row(row: Any, where: str, path: str | None) -> None:
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
            check_row(row, f"index {i}", None)
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
        check_row(row, where, str(self.path))
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
        check_row(ds[0], "index 0", str(path))
    for column in ("prompt", "task"):
        if column in ds.column_names:
            for i, value in enumerate(ds[column]):
                if not isinstance(value, str):
                    check_row(ds[i], f"index {i}", str(path))
    return ds

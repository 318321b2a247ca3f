"""The codec of `rows.safetensors`, a checkpoint's rows (docs/design.md §4).

`encode_rows` / `decode_rows` write and read flat token arrays indexed by offset arrays,
per-row scalar arrays, and the group ids as JSON metadata. No pickle. Decoding trusts
nothing and names the file and field of every problem.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
from safetensors.numpy import load as _st_load
from safetensors.numpy import save as _st_save

from rollkeep.core.errors import RowsMismatch
from rollkeep.core.io.untrusted import loads_json, safetensors_header
from rollkeep.core.rollout.rows import (
    ENV_VERSION,
    FINISH_CODE,
    FINISH_REASONS,
    Row,
    RowId,
    check_row_id,
)

__all__ = ["ROWS_SCHEMA", "decode_rows", "encode_rows"]

ROWS_SCHEMA = "1"


# name -> (safetensors dtype, numpy dtype); every tensor is 1-D.
_TENSORS: dict[str, tuple[str, np.dtype]] = {
    "prompt_ids": ("I32", np.dtype(np.int32)),
    "completion_ids": ("I32", np.dtype(np.int32)),
    "logprobs": ("F32", np.dtype(np.float32)),
    "versions": ("I32", np.dtype(np.int32)),
    "prompt_offsets": ("I64", np.dtype(np.int64)),
    "completion_offsets": ("I64", np.dtype(np.int64)),
    "reward": ("F64", np.dtype(np.float64)),
    "finish_reason": ("U8", np.dtype(np.uint8)),
    "generation": ("I32", np.dtype(np.int32)),
    "attempt": ("I32", np.dtype(np.int32)),
}
_METADATA_KEYS = ("rows_schema", "group_ids")
_REMEDY = (
    "the rows file of this checkpoint is corrupt or was not written by this rollkeep; "
    "restore from an older checkpoint, or start the run fresh."
)


def encode_rows(rows: Iterable[tuple[RowId, Row]]) -> bytes:
    """Serialise rows, in the order given, to safetensors bytes. Duplicate ids raise
    ValueError."""
    items = list(rows)
    ids = [check_row_id(rid) for rid, _ in items]
    rs: list[Row] = [row for _, row in items]
    for row in rs:
        if not isinstance(row, Row):
            raise ValueError(f"encode_rows needs Row values, got {type(row).__name__}")
    if len(set(ids)) != len(ids):
        dup = next(rid for rid, c in Counter(ids).items() if c > 1)
        raise ValueError(f"encode_rows got row id {tuple(dup)} more than once")
    prompts = [r.prompt_ids for r in rs]
    completions = [r.completion_ids for r in rs]

    def flat(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype)

    def offsets(parts: list[np.ndarray]) -> np.ndarray:
        out = np.zeros(len(parts) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, parts), np.int64, len(parts)), out=out[1:])
        return out

    # Zero-size tensors are valid safetensors; the offset arrays always hold >= 1 value.
    tensors = {
        "prompt_ids": flat(prompts, np.dtype(np.int32)),
        "completion_ids": flat(completions, np.dtype(np.int32)),
        "logprobs": flat([r.logprobs for r in rs], np.dtype(np.float32)),
        "versions": flat([r.versions for r in rs], np.dtype(np.int32)),
        "prompt_offsets": offsets(prompts),
        "completion_offsets": offsets(completions),
        "reward": np.array([r.reward for r in rs], np.float64),
        "finish_reason": np.array([FINISH_CODE[r.finish_reason] for r in rs], np.uint8),
        "generation": np.array([rid.generation for rid in ids], np.int32),
        "attempt": np.array([rid.attempt for rid in ids], np.int32),
    }
    metadata = {
        "rows_schema": ROWS_SCHEMA,
        "group_ids": json.dumps([rid.group_id for rid in ids], separators=(",", ":")),
    }
    return _st_save(tensors, metadata=metadata)


def _header(data: bytes, path: str) -> dict[str, Any]:
    """The JSON header of a safetensors file, or RowsMismatch if there is none."""

    def not_safetensors(found: str) -> RowsMismatch:
        return RowsMismatch(
            "The rows file is not a safetensors file",
            expected="an 8-byte little-endian header length followed by a JSON header",
            found=found,
            remedy=_REMEDY,
            path=path,
        )

    try:
        return safetensors_header(data)
    except ValueError as err:
        raise not_safetensors(str(err)) from None


def _bad(
    path: str, what: str, field: str, *, expected: str | None = None, found: str | None = None
) -> RowsMismatch:
    return RowsMismatch(what, expected=expected, found=found, remedy=_REMEDY, path=path, field=field)


def decode_rows(data: bytes, *, path: str = "rows.safetensors") -> dict[RowId, Row]:
    """Decode and validate `encode_rows` output. Every problem raises RowsMismatch naming
    `path` and the field at fault; nothing is repaired."""
    header = _header(data, path)
    metadata = _check_metadata(header, path)  # 1. the header
    _check_tensor_headers(header, path)
    t = _load_tensors(data, path)  # 2. the tensor data
    gids = _group_ids(metadata, path)  # 3. group_ids metadata
    n = _row_count(t, gids, path)  # 4. row count
    _check_offsets(t, path)  # 5. offsets
    _check_values(t, path)  # 6. values
    return _build_rows(t, gids, n, path)  # 7. rows


def _check_metadata(header: dict[str, Any], path: str) -> dict[str, Any]:
    """1a. The metadata: a map, the schema this rollkeep writes, known keys only."""
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise _bad(path, "The safetensors metadata is not a map", "__metadata__")
    schema = metadata.get("rows_schema")
    if schema != ROWS_SCHEMA:
        raise _bad(
            path,
            "Unsupported rows schema" if schema is not None else "The rows schema is missing",
            "rows_schema",
            expected=repr(ROWS_SCHEMA),
            found=repr(schema),
        )
    for key in metadata:
        if key not in _METADATA_KEYS:
            raise _bad(path, f"Unknown metadata key {key!r}", key, expected=str(list(_METADATA_KEYS)))
    return metadata


def _check_tensor_headers(header: dict[str, Any], path: str) -> None:
    """1b. The tensors: every name present and known, each dtype and rank right."""
    names = [k for k in header if k != "__metadata__"]
    for name in _TENSORS:
        if name not in header:
            raise _bad(path, f"Tensor {name!r} is missing", name)
    for name in names:
        if name not in _TENSORS:
            raise _bad(path, f"Unknown tensor {name!r}", name, expected=str(list(_TENSORS)))
    for name, (st_dtype, _) in _TENSORS.items():
        info = header[name]
        dtype = info.get("dtype") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if dtype != st_dtype:
            raise _bad(
                path, f"Tensor {name!r} has the wrong dtype", name, expected=st_dtype, found=repr(dtype)
            )
        if not isinstance(shape, list) or len(shape) != 1:
            raise _bad(
                path, f"Tensor {name!r} has the wrong rank", name, expected="1-D", found=f"shape {shape}"
            )


def _load_tensors(data: bytes, path: str) -> dict[str, np.ndarray]:
    """2. The tensor data (safetensors checks the byte ranges cover the file exactly),
    copied into owned, read-only arrays."""
    try:
        loaded = _st_load(bytes(data))
    except Exception as err:  # SafetensorError, or anything a malformed header provokes
        raise RowsMismatch(
            "The rows file is not a valid safetensors file",
            expected="tensor byte ranges that exactly cover the data section",
            found=str(err),
            remedy=_REMEDY,
            path=path,
        ) from None
    t: dict[str, np.ndarray] = {}
    for name, (_, dtype) in _TENSORS.items():
        arr = np.array(loaded[name], dtype=dtype, copy=True)  # own the memory, then freeze
        arr.flags.writeable = False
        t[name] = arr
    return t


def _group_ids(metadata: dict[str, Any], path: str) -> list[str]:
    """3. group_ids metadata: a JSON list of non-empty str."""
    raw = metadata.get("group_ids")
    if raw is None:
        raise _bad(path, "The group_ids metadata is missing", "group_ids")
    try:
        gids = loads_json(raw) if isinstance(raw, str) else None
    except ValueError:
        gids = None
    if not isinstance(gids, list) or not all(isinstance(g, str) and g for g in gids):
        raise _bad(
            path,
            "The group_ids metadata is not a JSON list of group id strings",
            "group_ids",
            found=repr(raw)[:200],
        )
    return gids


def _row_count(t: dict[str, np.ndarray], gids: list[str], path: str) -> int:
    """4. Row count: every per-row source must agree; the odd one out is named."""
    counts = [
        ("reward", len(t["reward"])),
        ("finish_reason", len(t["finish_reason"])),
        ("generation", len(t["generation"])),
        ("attempt", len(t["attempt"])),
        ("group_ids", len(gids)),
        ("prompt_offsets", len(t["prompt_offsets"]) - 1),
        ("completion_offsets", len(t["completion_offsets"]) - 1),
    ]
    n = Counter(c for _, c in counts).most_common(1)[0][0]
    for field, count in counts:
        if count != n:
            what = "n + 1 values" if field.endswith("_offsets") else "n values"
            raise _bad(
                path,
                f"{field} does not match the row count n = {n}",
                field,
                expected=what,
                found=f"{count + 1 if field.endswith('_offsets') else count} values",
            )
    if n < 0:  # both offset arrays are empty
        raise _bad(path, "The offset arrays are empty", "prompt_offsets", expected="n + 1 >= 1 values")
    return n


def _check_offsets(t: dict[str, np.ndarray], path: str) -> None:
    """5. Offsets: start at 0, never decrease, end at the flat length."""
    flats = {
        "prompt_offsets": ["prompt_ids"],
        "completion_offsets": ["completion_ids", "logprobs", "versions"],
    }
    for off_name, flat_names in flats.items():
        off = t[off_name]
        if off[0] != 0:
            raise _bad(
                path, f"{off_name} does not start at 0", off_name, expected="0", found=str(int(off[0]))
            )
        steps = np.diff(off)
        if steps.size and steps.min() < 0:
            i = int(np.argmax(steps < 0))
            raise _bad(
                path,
                f"{off_name} decreases at row {i}",
                off_name,
                expected="non-decreasing offsets",
                found=f"{int(off[i])} then {int(off[i + 1])}",
            )
        _check_flat_lengths(t, off_name, flat_names, path)


def _check_flat_lengths(
    t: dict[str, np.ndarray], off_name: str, flat_names: list[str], path: str
) -> None:
    """5b. The end of the offsets and each flat length vote; ties trust the offsets."""
    sizes = [(off_name, int(t[off_name][-1]))] + [(f, len(t[f])) for f in flat_names]
    total = Counter(s for _, s in sizes).most_common(1)[0][0]
    for field, size in sizes:
        if size != total:
            if field == off_name:
                raise _bad(
                    path,
                    f"{off_name} does not end at the flat length",
                    field,
                    expected=f"last offset {total}",
                    found=f"last offset {size}",
                )
            raise _bad(
                path,
                f"{field} has the wrong length for {off_name}",
                field,
                expected=f"{total} values ({off_name}[-1], one per token)",
                found=f"{size} values",
            )


def _check_values(t: dict[str, np.ndarray], path: str) -> None:
    """6. Values: finish codes known, ids non-negative, versions too (or ENV_VERSION)."""
    fin = t["finish_reason"]
    if fin.size and fin.max() >= len(FINISH_REASONS):
        raise _bad(
            path,
            "Unknown finish_reason code",
            "finish_reason",
            expected=f"codes {dict(enumerate(FINISH_REASONS))}",
            found=str(int(fin.max())),
        )
    for field in ("prompt_ids", "completion_ids", "versions", "generation", "attempt"):
        arr, low = t[field], ENV_VERSION if field == "versions" else 0
        if arr.size and arr.min() < low:
            raise _bad(
                path, f"{field} has a negative value", field, expected=f">= {low}", found=str(int(arr.min()))
            )


def _build_rows(t: dict[str, np.ndarray], gids: list[str], n: int, path: str) -> dict[RowId, Row]:
    """7. Rows, keyed by their attempt; ids must be unique."""
    po = t["prompt_offsets"].tolist()
    co = t["completion_offsets"].tolist()
    prompt, completion, logprobs, versions = (
        t["prompt_ids"],
        t["completion_ids"],
        t["logprobs"],
        t["versions"],
    )
    ids = list(map(RowId, gids, t["generation"].tolist(), t["attempt"].tolist()))
    if len(set(ids)) != n:
        dup = next(rid for rid, c in Counter(ids).items() if c > 1)
        raise _bad(
            path,
            "Duplicate row id",
            "group_ids",
            expected="each (group_id, generation, attempt) once",
            found=f"{tuple(dup)} more than once",
        )
    reasons = [FINISH_REASONS[c] for c in t["finish_reason"].tolist()]
    rewards = t["reward"].tolist()
    # Rows are built from read-only views of the frozen flat arrays, skipping the
    # per-row checks above already made in bulk. (The views keep the flat arrays alive.)
    new, init = object.__new__, object.__setattr__
    out: dict[RowId, Row] = {}
    for i, rid in enumerate(ids):
        c0, c1 = co[i], co[i + 1]
        row = new(Row)
        init(row, "prompt_ids", prompt[po[i] : po[i + 1]])
        init(row, "completion_ids", completion[c0:c1])
        init(row, "logprobs", logprobs[c0:c1])
        init(row, "versions", versions[c0:c1])
        init(row, "reward", rewards[i])
        init(row, "finish_reason", reasons[i])
        out[rid] = row
    return out

"""Finished sibling rows: the immutable `Row`, the embedded `RowStore`, and its codec.

A row is everything one finished generation produced: prompt and completion token ids,
behaviour log-probabilities, the weight version of every token, the reward and the finish
reason. A sealed attempt's row is named by the attempt itself, `RowId(group_id, generation,
attempt)`, so the ledger needs no separate reference (docs/design.md §1).

Rows are immutable: their arrays are read-only, and `RowStore.put` refuses a different row
under an id it already holds. That is what lets the checkpoint cut (docs/design.md §3) hold
references instead of copies.

Threading (docs/design.md §2, §3)
----------------------------
`put`, `put_ref`, `locate`, `delete`, `pin`, `ids`, `len` and `in` run on the controller's
loop thread. A checkpoint writer on a background thread holds a `RowPin` taken during the
cut and calls only `location` and `get` (or the pin's) with ids it knows were present when
the pin was taken (`RowPin.locations`, `RowPin.get`), and `get` only for rows without a location, which are in memory. While
any pin is held, `delete` is deferred: the row leaves the store's logical view at once but
stays readable by `get` and `location`, and is removed when the last pin is released.

Why the writer's reads are safe: in CPython a plain `d[key]` lookup runs under the GIL as
one C call, and a dict resize caused by the loop thread inserting other keys happens inside
another such call, so the lookup never sees a half-resized table. (Free-threaded CPython
locks each dict for the same effect.) Only *iterating* a dict that another thread mutates
can fail ("dictionary changed size during iteration"), so the writer never iterates the
live dict: `ids()` returns a snapshot and is for the loop thread. The pin count and the set
of deferred deletes are guarded by a lock, so `RowPin.release()` may also be called from the
writer thread when it finishes.

Codec
-----
`encode_rows` / `decode_rows` write `rows.safetensors` (docs/design.md §4): flat token arrays
indexed by offset arrays, per-row scalar arrays, and the group ids as JSON metadata. No
pickle. Decoding trusts nothing and names the file and field of every problem.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from safetensors.numpy import load as _st_load
from safetensors.numpy import save as _st_save

from rollkeep.core.errors import CustodyError, RowsMismatch
from rollkeep.core.untrusted import loads_json, safetensors_header

__all__ = [
    "FINISH_REASONS",
    "ROWS_SCHEMA",
    "Row",
    "RowId",
    "RowPin",
    "RowStore",
    "decode_rows",
    "encode_rows",
]

ROWS_SCHEMA = "1"
ENV_VERSION = -1  # the `versions` entry of a token an environment wrote (rollkeep.envs.base)
FINISH_REASONS: tuple[str, ...] = ("stop", "length")  # index = code in the file
_FINISH_CODE = {name: code for code, name in enumerate(FINISH_REASONS)}
_INT32_MAX = 2**31 - 1


class RowId(NamedTuple):
    """A sealed attempt, which names its row: `(group_id, generation index, attempt)`."""

    group_id: str
    generation: int
    attempt: int


def _check_row_id(row_id: object) -> RowId:
    """Return `row_id` as a RowId, or raise ValueError saying what is wrong."""
    if type(row_id) is RowId:  # fast path: the common, already well-formed case
        gid, gen, att = row_id
        if (
            type(gid) is str
            and gid
            and type(gen) is int
            and type(att) is int
            and 0 <= gen <= _INT32_MAX
            and 0 <= att <= _INT32_MAX
        ):
            return row_id
    if not isinstance(row_id, tuple) or len(row_id) != 3:
        raise ValueError(f"row id must be a RowId(group_id, generation, attempt), got {row_id!r}")
    gid, gen, att = row_id
    if not isinstance(gid, str) or not gid:
        raise ValueError(f"row id group_id must be a non-empty str, got {gid!r}")
    for name, value in (("generation", gen), ("attempt", att)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"row id {name} must be an int, got {value!r}")
        if not 0 <= int(value) <= _INT32_MAX:
            raise ValueError(f"row id {name} must be in [0, 2**31), got {value}")
    return RowId(gid, int(gen), int(att))


# ---------------------------------------------------------------------------------------
# Row
# ---------------------------------------------------------------------------------------

_ARRAY_DTYPES: dict[str, np.dtype] = {
    "prompt_ids": np.dtype(np.int32),
    "completion_ids": np.dtype(np.int32),
    "logprobs": np.dtype(np.float32),
    "versions": np.dtype(np.int32),
}


def _frozen(arr: np.ndarray) -> np.ndarray:
    """`arr` if nothing can write to its memory, else a read-only copy."""
    if arr.flags.writeable:  # the common case (an engine's fresh array): copy at once
        out = arr.copy()
        out.flags.writeable = False
        return out
    base: Any = arr
    while True:
        if isinstance(base, np.ndarray):
            if base.flags.writeable:
                break
            if base.base is None:
                return arr
            base = base.base
        elif isinstance(base, bytes):
            return arr
        else:  # bytearray, mmap, a writable buffer: someone could still change it
            break
    out = np.array(arr, copy=True, order="C")
    out.flags.writeable = False
    return out


@dataclass(frozen=True, slots=True, eq=False)
class Row:
    """One finished generation. Immutable: its arrays are read-only.

    prompt_ids      int32 [P]   prompt token ids
    completion_ids  int32 [C]   generated token ids (C may be 0)
    logprobs        float32 [C] behaviour log-probability of each completion token
    versions        int32 [C]   weight version each completion token was generated under, or
                                ENV_VERSION (-1) for a token an environment wrote (a multi-turn
                                trajectory: masked out of the loss, log-prob 0)
    reward          float       the reward of the whole completion
    finish_reason   "stop" | "length"
    """

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    finish_reason: str

    def __post_init__(self) -> None:
        # Runs once per generation, so it is written for speed: one pass over the four
        # arrays, and a message only once something is wrong.
        arrays = (self.prompt_ids, self.completion_ids, self.logprobs, self.versions)
        for (name, dtype), arr in zip(_ARRAY_DTYPES.items(), arrays, strict=True):
            if type(arr) is not np.ndarray or arr.dtype != dtype or arr.ndim != 1:
                if not isinstance(arr, np.ndarray):
                    raise ValueError(
                        f"Row.{name} must be a numpy array of {dtype}, got {type(arr).__name__}"
                    )
                if arr.dtype != dtype:
                    raise ValueError(f"Row.{name} must have dtype {dtype}, got {arr.dtype}")
                if arr.ndim != 1:
                    raise ValueError(f"Row.{name} must be 1-D, got shape {arr.shape}")
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            name = "logprobs" if len(self.logprobs) != n else "versions"
            raise ValueError(
                f"Row.{name} has length {len(getattr(self, name))}, "
                f"but completion_ids has length {n}: one value per completion token"
            )
        for name, arr in (("prompt_ids", arrays[0]), ("completion_ids", arrays[1])):
            if arr.size and arr.min() < 0:
                raise ValueError(f"Row.{name} must be non-negative, found {int(arr.min())}")
        if arrays[3].size and arrays[3].min() < ENV_VERSION:
            raise ValueError(f"Row.versions must be >= 0 (or {ENV_VERSION}, an environment's token), "
                             f"found {int(arrays[3].min())}")
        reward = self.reward
        if isinstance(reward, bool) or not isinstance(
            reward, (int, float, np.integer, np.floating)
        ):
            raise ValueError(f"Row.reward must be a float, got {type(reward).__name__}")
        if not isinstance(self.finish_reason, str) or self.finish_reason not in _FINISH_CODE:
            raise ValueError(
                f"Row.finish_reason must be one of {list(FINISH_REASONS)}, "
                f"got {self.finish_reason!r}"
            )
        object.__setattr__(self, "reward", float(reward))
        for name, arr in zip(_ARRAY_DTYPES, arrays, strict=True):
            object.__setattr__(self, name, _frozen(arr))

    @property
    def tokens(self) -> int:
        """Number of completion tokens."""
        return len(self.completion_ids)

    def equal(self, other: Row) -> bool:
        """Same content, bit for bit (a NaN equals the same NaN; 0.0 differs from -0.0)."""
        if self is other:
            return True
        return (
            self.finish_reason == other.finish_reason
            and np.float64(self.reward).tobytes() == np.float64(other.reward).tobytes()
            and all(
                getattr(self, name).shape == getattr(other, name).shape
                and getattr(self, name).tobytes() == getattr(other, name).tobytes()
                for name in _ARRAY_DTYPES
            )
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Row):
            return NotImplemented
        return self.equal(other)

    __hash__ = None  # type: ignore[assignment]  # arrays are not hashable

    def __repr__(self) -> str:
        return (
            f"Row(prompt={len(self.prompt_ids)} tokens, completion={self.tokens} tokens, "
            f"reward={self.reward!r}, finish_reason={self.finish_reason!r})"
        )


# ---------------------------------------------------------------------------------------
# RowStore
# ---------------------------------------------------------------------------------------


class RowPin:
    """Holds deletions back while a checkpoint writer reads rows. Release exactly once
    (further calls are no-ops); use it as a context manager."""

    __slots__ = ("_store", "_released")

    def __init__(self, store: RowStore) -> None:
        self._store = store
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def get(self, row_id: RowId) -> Row:
        """`store.get(row_id)`, refused once this pin is released."""
        if self._released:
            raise CustodyError(
                "A row was read through a RowPin after the pin was released",
                expected="reads only while the pin is held",
                found=f"get({row_id!r}) after release()",
                remedy="release the pin after the checkpoint writer has read every row.",
            )
        return self._store.get(row_id)

    @property
    def locations(self) -> Callable[[RowId], Any]:
        """`store.location`, for a checkpoint naming 100 k rows without two calls per row:
        the row log's map's own `get` (plain lookups: safe from the writer's thread)."""
        return self._store._where.get

    def release(self) -> None:
        """Drop this pin; the last one out applies the deferred deletes. Idempotent, and
        callable from the checkpoint writer thread."""
        self._store._unpin(self)

    def __enter__(self) -> RowPin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RowStore:
    """The row store of a run. See the module docstring for the threading rules.

    A row is held in memory, or by reference: its `RowLocation` in the row log
    (`rollkeep.core.rowlog`), read on its first `get` by the `reader` the store was made
    with, verified, and kept in memory from then on. A row the journal appended to the row
    log has both (`locate`); a checkpoint then names it by its location instead of copying
    it (docs/design.md §5.2).

    The logical view (`in`, `len`, `ids`) drops a row as soon as it is deleted; `get` and
    `location` keep serving a deleted row while a pin defers its removal.
    """

    def __init__(self, reader: Callable[[RowId, Any], Row] | None = None) -> None:
        self._rows: dict[RowId, Row] = {}  # rows in memory
        self._where: dict[RowId, Any] = {}  # RowLocation of rows in the row log
        self._deferred: set[RowId] = set()  # deleted while pinned; still held
        self._pins = 0
        self._n = 0  # rows of the logical view
        self._reader = reader
        self._lock = threading.Lock()

    def _held(self, rid: RowId) -> bool:
        return rid in self._rows or rid in self._where

    def put(self, row_id: RowId, row: Row) -> None:
        """Store `row` under `row_id`. The same content again is a no-op; a different row
        under a held id raises CustodyError and changes nothing."""
        rid = _check_row_id(row_id)
        if not isinstance(row, Row):
            raise ValueError(f"RowStore.put needs a Row, got {type(row).__name__}")
        if not self._held(rid):
            with self._lock:
                self._rows[rid] = row
                self._n += 1
            return
        existing = self.get(rid)
        if not existing.equal(row):
            raise CustodyError(
                f"Conflicting seal: row {tuple(rid)} is already stored with different content",
                expected=f"the stored {existing!r} again (a duplicate seal is a no-op)",
                found=repr(row),
                remedy="an attempt is sealed once; a new rollout needs a new attempt.",
            )
        with self._lock:
            if rid in self._deferred:  # deleted while pinned, now stored again
                self._deferred.remove(rid)
                self._n += 1

    def put_ref(self, row_id: RowId, location: Any) -> None:
        """Hold the row under `row_id` by reference: read at `location` on its first `get`.
        The id must be new (a restore puts each row once)."""
        rid = _check_row_id(row_id)
        if self._reader is None:
            raise ValueError("RowStore.put_ref needs a store made with a reader")
        if self._held(rid):
            raise ValueError(f"row {tuple(rid)} is already held")
        with self._lock:
            self._where[rid] = location
            self._n += 1

    def locate(self, row_id: RowId, location: Any) -> None:
        """Record where a held row was appended in the row log (the journal, at its seal)."""
        if row_id not in self._rows:
            raise KeyError(row_id)
        self._where[row_id] = location

    def location(self, row_id: RowId) -> Any:
        """The row's `RowLocation` in the row log, or None if it is held in memory only.
        Safe from the checkpoint writer thread, as `get`."""
        return self._where.get(row_id)

    def get(self, row_id: RowId) -> Row:
        """The row under `row_id` (KeyError if absent); a row held by reference is read and
        verified now (the reader's errors: `RowSegmentCorrupt`, exit 3). Safe from the
        checkpoint writer thread for ids present when its pin was taken."""
        row = self._rows.get(row_id)
        if row is not None:
            return row
        row = self._reader(row_id, self._where[row_id])  # type: ignore[misc]  # KeyError if absent
        self._rows[row_id] = row  # one dict store: atomic under the GIL
        return row

    def delete(self, row_id: RowId) -> None:
        """Remove a row (KeyError if absent). Deferred while any pin is held."""
        with self._lock:
            if not self._held(row_id) or row_id in self._deferred:
                raise KeyError(row_id)
            self._n -= 1
            if self._pins:
                self._deferred.add(_check_row_id(row_id))
            else:
                self._rows.pop(row_id, None)
                self._where.pop(row_id, None)

    def pin(self) -> RowPin:
        """O(1). Until the returned pin is released, deletes are deferred."""
        with self._lock:
            self._pins += 1
        return RowPin(self)

    def _unpin(self, pin: RowPin) -> None:
        with self._lock:
            if pin._released:
                return
            pin._released = True
            self._pins -= 1
            if self._pins == 0 and self._deferred:
                for rid in self._deferred:
                    self._rows.pop(rid, None)
                    self._where.pop(rid, None)
                self._deferred.clear()

    @property
    def pins(self) -> int:
        """Pins currently held."""
        return self._pins

    def __contains__(self, row_id: object) -> bool:
        return self._held(row_id) and row_id not in self._deferred  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self._n

    def ids(self) -> Iterator[RowId]:
        """A snapshot of the stored ids (in memory first, then by reference). Loop thread only."""
        with self._lock:
            snapshot = [rid for rid in self._rows if rid not in self._deferred]
            snapshot += [rid for rid in self._where if rid not in self._rows and rid not in self._deferred]
        return iter(snapshot)

    def restore(self, rows: Mapping[RowId, Any]) -> None:
        """Fill an empty store with what a restore produced (`Restored.rows`, a replay's rows:
        ids already checked by their decoders): a `Row` in memory, anything else (a
        `RowLocation`) by reference. O(rows) dict updates, no read."""
        if self._rows or self._where:
            raise ValueError("RowStore.restore fills an empty store")
        refs = {rid: row for rid, row in rows.items() if not isinstance(row, Row)}
        if refs and self._reader is None:
            raise ValueError("RowStore.restore of rows by reference needs a store made with a reader")
        with self._lock:
            self._where.update(refs)
            self._rows.update((rid, row) for rid, row in rows.items() if rid not in refs)
            self._n = len(rows)

    def resident(self) -> int:
        """Rows held in memory (the rest are read on their first `get`)."""
        return len(self._rows)


# ---------------------------------------------------------------------------------------
# Codec: rows.safetensors
# ---------------------------------------------------------------------------------------

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
    ids = [_check_row_id(rid) for rid, _ in items]
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
        "finish_reason": np.array([_FINISH_CODE[r.finish_reason] for r in rs], np.uint8),
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


def decode_rows(data: bytes, *, path: str = "rows.safetensors") -> dict[RowId, Row]:
    """Decode and validate `encode_rows` output. Every problem raises RowsMismatch naming
    `path` and the field at fault; nothing is repaired."""

    def bad(what: str, field: str, *, expected: str | None = None, found: str | None = None):
        return RowsMismatch(
            what, expected=expected, found=found, remedy=_REMEDY, path=path, field=field
        )

    # 1. The header: schema, metadata keys, tensor names, dtypes and ranks.
    header = _header(data, path)
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise bad("The safetensors metadata is not a map", "__metadata__")
    schema = metadata.get("rows_schema")
    if schema != ROWS_SCHEMA:
        raise bad(
            "Unsupported rows schema" if schema is not None else "The rows schema is missing",
            "rows_schema",
            expected=repr(ROWS_SCHEMA),
            found=repr(schema),
        )
    for key in metadata:
        if key not in _METADATA_KEYS:
            raise bad(f"Unknown metadata key {key!r}", key, expected=str(list(_METADATA_KEYS)))
    names = [k for k in header if k != "__metadata__"]
    for name in _TENSORS:
        if name not in header:
            raise bad(f"Tensor {name!r} is missing", name)
    for name in names:
        if name not in _TENSORS:
            raise bad(f"Unknown tensor {name!r}", name, expected=str(list(_TENSORS)))
    for name, (st_dtype, _) in _TENSORS.items():
        info = header[name]
        dtype = info.get("dtype") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if dtype != st_dtype:
            raise bad(
                f"Tensor {name!r} has the wrong dtype", name, expected=st_dtype, found=repr(dtype)
            )
        if not isinstance(shape, list) or len(shape) != 1:
            raise bad(
                f"Tensor {name!r} has the wrong rank", name, expected="1-D", found=f"shape {shape}"
            )

    # 2. The tensor data (safetensors checks the byte ranges cover the file exactly).
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

    # 3. group_ids metadata: a JSON list of non-empty str.
    raw = metadata.get("group_ids")
    if raw is None:
        raise bad("The group_ids metadata is missing", "group_ids")
    try:
        gids = loads_json(raw) if isinstance(raw, str) else None
    except ValueError:
        gids = None
    if not isinstance(gids, list) or not all(isinstance(g, str) and g for g in gids):
        raise bad(
            "The group_ids metadata is not a JSON list of group id strings",
            "group_ids",
            found=repr(raw)[:200],
        )

    # 4. Row count: every per-row source must agree; the odd one out is named.
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
            raise bad(
                f"{field} does not match the row count n = {n}",
                field,
                expected=what,
                found=f"{count + 1 if field.endswith('_offsets') else count} values",
            )
    if n < 0:  # both offset arrays are empty
        raise bad("The offset arrays are empty", "prompt_offsets", expected="n + 1 >= 1 values")

    # 5. Offsets: start at 0, never decrease, end at the flat length.
    flats = {
        "prompt_offsets": ["prompt_ids"],
        "completion_offsets": ["completion_ids", "logprobs", "versions"],
    }
    for off_name, flat_names in flats.items():
        off = t[off_name]
        if off[0] != 0:
            raise bad(
                f"{off_name} does not start at 0", off_name, expected="0", found=str(int(off[0]))
            )
        steps = np.diff(off)
        if steps.size and steps.min() < 0:
            i = int(np.argmax(steps < 0))
            raise bad(
                f"{off_name} decreases at row {i}",
                off_name,
                expected="non-decreasing offsets",
                found=f"{int(off[i])} then {int(off[i + 1])}",
            )
        # The end of the offsets and each flat length vote; ties trust the offsets.
        sizes = [(off_name, int(off[-1]))] + [(f, len(t[f])) for f in flat_names]
        total = Counter(s for _, s in sizes).most_common(1)[0][0]
        for field, size in sizes:
            if size != total:
                if field == off_name:
                    raise bad(
                        f"{off_name} does not end at the flat length",
                        field,
                        expected=f"last offset {total}",
                        found=f"last offset {size}",
                    )
                raise bad(
                    f"{field} has the wrong length for {off_name}",
                    field,
                    expected=f"{total} values ({off_name}[-1], one per token)",
                    found=f"{size} values",
                )

    # 6. Values: finish codes known, ids non-negative, versions too (or ENV_VERSION).
    fin = t["finish_reason"]
    if fin.size and fin.max() >= len(FINISH_REASONS):
        raise bad(
            "Unknown finish_reason code",
            "finish_reason",
            expected=f"codes {dict(enumerate(FINISH_REASONS))}",
            found=str(int(fin.max())),
        )
    for field in ("prompt_ids", "completion_ids", "versions", "generation", "attempt"):
        arr, low = t[field], ENV_VERSION if field == "versions" else 0
        if arr.size and arr.min() < low:
            raise bad(
                f"{field} has a negative value", field, expected=f">= {low}", found=str(int(arr.min()))
            )

    # 7. Rows, keyed by their attempt; ids must be unique.
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
        raise bad(
            "Duplicate row id",
            "group_ids",
            expected="each (group_id, generation, attempt) once",
            found=f"{tuple(dup)} more than once",
        )
    reasons = [FINISH_REASONS[c] for c in fin.tolist()]
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

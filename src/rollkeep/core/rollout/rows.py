"""The finished-generation record: the immutable `Row` and the `RowId` that names it.

A row is everything one finished generation produced: prompt and completion token ids,
behaviour log-probabilities, the weight version of every token, the reward and the finish
reason. A sealed attempt's row is named by the attempt itself, `RowId(group_id, generation,
attempt)`, so the ledger needs no separate reference (docs/design.md §1).

Rows are immutable: their arrays are read-only, and `RowStore.put` refuses a different row
under an id it already holds. That is what lets the checkpoint cut (docs/design.md §3) hold
references instead of copies.

The store of a run's rows is `rollkeep.core.rollout.rowstore`; their checkpoint file,
`rows.safetensors`, is `rollkeep.core.checkpoint.rowcodec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "ENV_VERSION",
    "FINISH_REASONS",
    "Row",
    "RowId",
    "check_row_id",
    "row_id_of",
]

ENV_VERSION = -1  # the `versions` entry of a token an environment wrote (rollkeep.envs.base)
FINISH_REASONS: tuple[str, ...] = ("stop", "length")  # index = code in the file
FINISH_CODE = {name: code for code, name in enumerate(FINISH_REASONS)}
_INT32_MAX = 2**31 - 1


class RowId(NamedTuple):
    """A sealed attempt, which names its row: `(group_id, generation index, attempt)`."""

    group_id: str
    generation: int
    attempt: int


#: The RowId of a `(group_id, generation, attempt)` tuple, built in C: a NamedTuple's own
#: constructor is Python (~0.5 µs against ~0.3), and the scheduler builds four per sibling.
row_id_of: Callable[[tuple[str, int, int]], RowId] = partial(tuple.__new__, RowId)


def check_row_id(row_id: object) -> RowId:
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


_I32, _F32 = np.dtype(np.int32), np.dtype(np.float32)


def _frozen(arr: np.ndarray) -> np.ndarray:
    """`arr` if nothing can write to its memory, else a read-only copy. (`Row` copies a
    writable array itself, into `bytes`: nothing can write those, and it is cheaper than a
    copy made read-only after.)"""
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


def _refuse(*fields: Any) -> float:
    """Raise ValueError naming the first thing wrong with a row's fields; else (a valid row
    that missed the fast path: a reward of another number type) the reward as a float."""
    arrays, (reward, finish_reason) = fields[:4], fields[4:]
    for (name, dtype), arr in zip(_ARRAY_DTYPES.items(), arrays, strict=True):
        if not isinstance(arr, np.ndarray):
            raise ValueError(f"Row.{name} must be a numpy array of {dtype}, got {type(arr).__name__}")
        if arr.dtype != dtype:
            raise ValueError(f"Row.{name} must have dtype {dtype}, got {arr.dtype}")
        if arr.ndim != 1:
            raise ValueError(f"Row.{name} must be 1-D, got shape {arr.shape}")
    n = len(arrays[1])
    for name, arr in (("logprobs", arrays[2]), ("versions", arrays[3])):
        if len(arr) != n:
            raise ValueError(f"Row.{name} has length {len(arr)}, "
                             f"but completion_ids has length {n}: one value per completion token")
    for name, arr in (("prompt_ids", arrays[0]), ("completion_ids", arrays[1])):
        if arr.size and arr.min() < 0:
            raise ValueError(f"Row.{name} must be non-negative, found {int(arr.min())}")
    if arrays[3].size and arrays[3].min() < ENV_VERSION:
        raise ValueError(f"Row.versions must be >= 0 (or {ENV_VERSION}, an environment's token), "
                         f"found {int(arrays[3].min())}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float, np.integer, np.floating)):
        raise ValueError(f"Row.reward must be a float, got {type(reward).__name__}")
    if not isinstance(finish_reason, str) or finish_reason not in FINISH_CODE:
        raise ValueError(f"Row.finish_reason must be one of {list(FINISH_REASONS)}, got {finish_reason!r}")
    return float(reward)


@dataclass(frozen=True, slots=True, eq=False, init=False)
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

    def __init__(self, prompt_ids: np.ndarray, completion_ids: np.ndarray, logprobs: np.ndarray,
                 versions: np.ndarray, reward: float, finish_reason: str) -> None:
        # Runs once per generation (the scheduler's hot path), so the common case is a few
        # identity tests, one reduction per id array and one read-only copy per array of an
        # engine's (fresh, writable) arrays; `_refuse` has the messages.
        # Written out, not helpers (~0.1 µs a call): an id array's least element by `argmin`
        # (a third of the time of a ufunc reduction on tens to thousands of tokens), and
        # `_frozen`'s common case.
        p, c, lp, v = prompt_ids, completion_ids, logprobs, versions
        n = len(c) if type(c) is np.ndarray else -1
        if not (type(p) is np.ndarray and p.dtype is _I32 and p.ndim == 1
                and n >= 0 and c.dtype is _I32 and c.ndim == 1
                and type(lp) is np.ndarray and lp.dtype is _F32 and lp.ndim == 1 and len(lp) == n
                and type(v) is np.ndarray and v.dtype is _I32 and v.ndim == 1 and len(v) == n
                and (not p.size or p.item(p.argmin()) >= 0)
                and (not n or (c.item(c.argmin()) >= 0 and v.item(v.argmin()) >= ENV_VERSION))
                and type(reward) is float and finish_reason in FINISH_CODE):
            reward = _refuse(p, c, lp, v, reward, finish_reason)
        fix, fb = object.__setattr__, np.frombuffer
        fix(self, "prompt_ids", fb(p.tobytes(), _I32) if p.flags.writeable else _frozen(p))
        fix(self, "completion_ids", fb(c.tobytes(), _I32) if c.flags.writeable else _frozen(c))
        fix(self, "logprobs", fb(lp.tobytes(), _F32) if lp.flags.writeable else _frozen(lp))
        fix(self, "versions", fb(v.tobytes(), _I32) if v.flags.writeable else _frozen(v))
        fix(self, "reward", reward)
        fix(self, "finish_reason", finish_reason)

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

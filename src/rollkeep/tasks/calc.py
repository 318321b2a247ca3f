"""A tool-use task: multi-digit multiplication with a calculator, e.g. "374*485=" → "181390".

The built-in GPT (~0.4M parameters) cannot multiply three-digit numbers in its head
(measured: 1000 supervised steps of 64 prompt -> answer pairs leave held-out accuracy at
0.0, training rows at 0.002). With the
calculator environment (`rollkeep.envs.calc`) the task becomes copying: the model writes
the tool call, the environment answers, the model copies the value out.

    prompt   "374*485="
    turn 1   "CALC(374*485)"         the model calls the tool (EOS ends the turn)
    env      "=181390;"              the calculator's response (masked out of the loss)
    turn 2   "181390"                the answer (EOS): the episode ends, reward 1.0

Rows carry that demonstration as `turns` (the model's turn texts), which the warm start
trains on (`controller.warmup`); with `tool_share` below 1 (`data.generated.tool_share`),
the other rows' demonstration is the answer written at once (`["181390"]`), as a
demonstrator who can multiply would write it. Operands have exactly `digits` digits, so every prompt
has the same token length (greedy evaluation and the engine batch by length). Rows are
generated from a seed, so no download is needed. Every product has 2 x `digits` digits
(`_bounds` says why), so every demonstration has the same token length too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .held_out import distinct_pairs

TASK = "calc"
_INTEGER = re.compile(r"-?\d+")


def problem(a: int, b: int, *, tool: bool = True) -> dict:
    """The row of problem a * b, with its demonstration: the tool call and the copied value,
    or (`tool` false) the answer written at once, as a demonstrator who can multiply would."""
    turns = [f"CALC({a}*{b})", str(a * b)] if tool else [str(a * b)]
    return {"prompt": f"{a}*{b}=", "answer": str(a * b), "turns": turns, "task": TASK}


def operands(row: dict) -> tuple[int, int]:
    """(a, b) of a row's prompt "a*b="."""
    a, b = str(row["prompt"]).rstrip("=").split("*")
    return int(a), int(b)


def _bounds(digits: int) -> tuple[int, int]:
    """[lo, hi) of the operands: `digits` digits, and at least sqrt(10**(2 digits - 1)) so
    that every product has 2 x digits digits (317..999 for 3 digits).

    Why the floor: with every product of one length, every trajectory has one shape, and
    the tiny GPT's position-based copying covers every row. With all 3-digit operands,
    17% of products have 5 digits; measured (an offline GRPO loop, since removed), GRPO then stalls at
    ~0.80 held-out accuracy: it never learns to copy the shorter answers."""
    if digits < 1:
        raise ValueError(f"calc: digits must be >= 1, got {digits}")
    lo = math.isqrt(10 ** (2 * digits - 1) - 1) + 1  # the least n with n * n >= 10**(2d-1)
    return lo, 10**digits


def make_rows(n_rows: int, *, digits: int, seed: int, tool_share: float = 1.0) -> list[dict]:
    """`n_rows` problems a * b, operands of `digits` digits whose product has 2 x digits
    digits (`_bounds`); repeats possible. A `tool_share` of the demonstrations (drawn per
    row from a stream of its own: the problems do not depend on it) call the calculator;
    the others answer at once, which the model cannot learn to do: a warm start on them
    uses the tool on only some problems, and RL has to learn to use it on all."""
    lo, hi = _bounds(digits)
    rng = np.random.default_rng([seed, 0xCA1C])
    a = rng.integers(lo, hi, n_rows)
    b = rng.integers(lo, hi, n_rows)
    tool = np.random.default_rng([seed, 0x7001]).random(n_rows) < tool_share
    return [problem(int(x), int(y), tool=bool(t)) for x, y, t in zip(a, b, tool, strict=True)]


def held_out_rows(n_rows: int, *, digits: int, seed: int, exclude: list[dict]) -> list[dict]:
    """`n_rows` distinct problems, none of which is the problem of a row of `exclude` (the
    training rows). Drawn from their own seeded stream, so they depend on the training
    rows only through which problems those hold. Raises ValueError when fewer than
    `n_rows` problems with such operands are left."""
    lo, hi = _bounds(digits)
    seen = {operands(r) for r in exclude}
    left = (hi - lo) ** 2 - len({p for p in seen if lo <= p[0] < hi and lo <= p[1] < hi})
    if n_rows > left:
        raise ValueError(f"calc: only {left} problems with operands of {digits} digit(s) are not "
                         f"in the training rows; {n_rows} held-out rows were asked for")
    return [problem(x, y) for x, y in distinct_pairs(np.random.default_rng([seed, 0xCA1E]), lo, hi, n_rows, seen)]


def reward(text: str, row: Mapping[str, Any]) -> float:
    """1.0 if the first integer in the text equals the answer, else 0.0. As a single-turn
    reward (no environment) the model must answer in its head; the environment scores its
    final turn with this same function."""
    m = _INTEGER.search(text)
    return float(m is not None and m.group(0) == str(row["answer"]))

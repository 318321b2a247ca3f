"""The calculator environment of the `calc` task (`rollkeep.tasks.calc`).

Each model turn is either a tool call or the answer:

    "CALC(374*485)"   tool call → response "=181390;", the episode goes on
    "CALC(4071)"      a bare number is an expression too → "=4071;"
    "CALC(3*/4)"      a malformed call (any text starting "CALC(" that is not a valid
                      expression in parentheses) → "=?;", the episode goes on
    "181390"          anything else is the answer → done, reward = tasks.calc.reward

An expression is non-negative integers joined by `+`, `-` and `*` (`*` binds tighter),
at most `max_expr_chars` characters: nothing else, and it is evaluated here by hand,
never by `eval`. The responses use only digits and `=;?-`, so a tokenizer of digits plus
`CALC()+-*=;?` (the toy engine's) can write and read every turn.

The environment is a pure function of (row, turns): `recovery = "replay"` reproduces an
episode by stepping a fresh one through the recorded turns.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..tasks.calc import reward
from .base import REPLAY, Step

__all__ = ["CalcEnv", "evaluate", "is_tool_call", "make"]

_CALL = "CALC("
_EXPR = re.compile(r"\d+(?:[+\-*]\d+)*")
_TERM = re.compile(r"[+\-]")
MALFORMED = "=?;"


def is_tool_call(text: str) -> bool:
    """Whether a turn is addressed to the calculator (well-formed or not)."""
    return text.strip().startswith(_CALL)


def evaluate(expr: str, *, max_chars: int = 32) -> int | None:
    """The value of `expr` (non-negative integers joined by + - *, `*` first), or None if
    it is not such an expression or is longer than `max_chars`. The length bound also
    bounds the value (at most 10**max_chars), so no call can exhaust memory."""
    if len(expr) > max_chars or _EXPR.fullmatch(expr) is None:
        return None
    total, sign, start = 0, 1, 0
    for m in [*_TERM.finditer(expr), None]:
        end = len(expr) if m is None else m.start()
        product = 1
        for factor in expr[start:end].split("*"):
            product *= int(factor)
        total += sign * product
        if m is not None:
            sign, start = (1 if m.group() == "+" else -1), m.end()
    return total


class CalcEnv:
    """One episode of the calc task (the `Environment` protocol, replay recovery)."""

    recovery = REPLAY

    def __init__(self, *, max_expr_chars: int = 32) -> None:
        if max_expr_chars < 1:
            raise ValueError(f"calc env: max_expr_chars must be >= 1, got {max_expr_chars}")
        self.max_expr_chars = max_expr_chars
        self._row: Mapping[str, Any] | None = None

    def reset(self, row: Mapping[str, Any], seed: int) -> None:
        """Start on `row` (it needs `answer`); the seed is unused: nothing here is random."""
        if "answer" not in row:
            raise ValueError(f"calc env: row {dict(row)!r} has no `answer` to score the final turn against")
        self._row = row

    def step(self, text: str) -> Step:
        if self._row is None:
            raise RuntimeError("calc env: step() before reset()")
        call = text.strip()
        if not call.startswith(_CALL):
            return Step(done=True, reward=reward(text, self._row))
        value = evaluate(call[len(_CALL):-1], max_chars=self.max_expr_chars) if call.endswith(")") else None
        return Step(response=MALFORMED if value is None else f"={value};")


def make(**kwargs: Any) -> CalcEnv:
    """The factory (`env.name: calc`): `env.kwargs` are CalcEnv's (max_expr_chars)."""
    return CalcEnv(**kwargs)

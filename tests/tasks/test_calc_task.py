"""The calc task: rows, demonstrations, held-out rows, the reward."""

from __future__ import annotations

import pytest

from rollkeep.tasks import calc, reward_fn


def test_rows_are_a_function_of_the_seed_with_demonstrations() -> None:
    rows = calc.make_rows(50, digits=3, seed=7)
    assert rows == calc.make_rows(50, digits=3, seed=7)
    assert rows != calc.make_rows(50, digits=3, seed=8)
    for r in rows:
        a, b = calc.operands(r)
        assert 317 <= a <= 999 and 317 <= b <= 999 and len(r["answer"]) == 6  # one trajectory length
        assert r["prompt"] == f"{a}*{b}=" and r["answer"] == str(a * b) and r["task"] == "calc"
        assert r["turns"] == [f"CALC({a}*{b})", str(a * b)]


def test_held_out_rows_avoid_the_training_problems() -> None:
    train = calc.make_rows(200, digits=2, seed=0)
    held = calc.held_out_rows(100, digits=2, seed=0, exclude=train)
    problems = [calc.operands(r) for r in held]
    assert len(set(problems)) == 100
    assert not set(problems) & {calc.operands(r) for r in train}
    assert held == calc.held_out_rows(100, digits=2, seed=0, exclude=train)


def test_held_out_rows_refuse_when_too_few_are_left() -> None:
    train = [calc.problem(a, b) for a in range(10) for b in range(10)]  # every 1-digit problem but none
    with pytest.raises(ValueError, match="only 0 problems"):
        calc.held_out_rows(1, digits=1, seed=0, exclude=train)
    with pytest.raises(ValueError, match="digits must be >= 1"):
        calc.make_rows(1, digits=0, seed=0)


def test_reward_is_the_first_integer() -> None:
    row = calc.problem(37, 48)
    assert calc.reward("1776", row) == 1.0
    assert calc.reward(" 1776 and 5", row) == 1.0
    assert calc.reward("CALC(37*48)", row) == 0.0  # a tool call is not the answer
    assert calc.reward("1777", row) == 0.0
    assert calc.reward("", row) == 0.0
    assert reward_fn("calc") is calc.reward  # the single-turn reward is registered


def test_a_tool_share_changes_only_which_demonstrations_call_the_calculator() -> None:
    full = calc.make_rows(2000, digits=3, seed=4)
    part = calc.make_rows(2000, digits=3, seed=4, tool_share=0.25)
    assert [r["prompt"] for r in part] == [r["prompt"] for r in full]
    calls = [r["turns"][0].startswith("CALC(") for r in part]
    assert 0.2 < sum(calls) / len(calls) < 0.3
    assert all(r["turns"] == [r["answer"]] for r, c in zip(part, calls, strict=True) if not c)
    assert all(r["turns"][0].startswith("CALC(") for r in full)

"""The calculator environment: tool calls, malformed calls, answers, determinism."""

from __future__ import annotations

import pytest

from rollkeep.envs.base import REPLAY, Environment, Step
from rollkeep.envs.calc import CalcEnv, evaluate, is_tool_call, make
from rollkeep.tasks import calc

ROW = calc.problem(37, 48)


def episode(turns: list[str], **kwargs) -> list[Step]:
    env = make(**kwargs)
    env.reset(ROW, 0)
    return [env.step(t) for t in turns]


def test_it_is_an_environment_with_replay_recovery() -> None:
    env = make()
    assert isinstance(env, CalcEnv) and isinstance(env, Environment)
    assert env.recovery == REPLAY


def test_demonstration_episode() -> None:
    assert episode(ROW["turns"]) == [Step(response="=1776;"), Step(done=True, reward=1.0)]


@pytest.mark.parametrize(
    ("call", "response"),
    [
        ("CALC(37*48)", "=1776;"),
        ("CALC(4071)", "=4071;"),  # a bare number (the toy engine's calls)
        ("CALC(1+2*3-10)", "=-3;"),  # * before + and -, left to right
        ("CALC(007*2)", "=14;"),
        (" CALC(2*3) ", "=6;"),
        ("CALC(3*/4)", "=?;"),
        ("CALC()", "=?;"),
        ("CALC(", "=?;"),
        ("CALC(2**8)", "=?;"),
        ("CALC(-2)", "=?;"),  # non-negative operands only
        ("CALC(1e5)", "=?;"),
        ("CALC(__import__('os'))", "=?;"),  # never eval()
        ("CALC(2*3)x", "=?;"),
        ("CALC(" + "9" * 33 + ")", "=?;"),  # longer than 32 characters
    ],
)
def test_tool_calls(call: str, response: str) -> None:
    assert is_tool_call(call)
    step = episode([call])[0]
    assert step == Step(response=response, done=False, reward=0.0)
    assert set(step.response) <= set("0123456789=;?-")  # the toy engine's tokenizer reads it


def test_expression_bound_and_values() -> None:
    assert evaluate("9" * 32) == int("9" * 32)
    assert evaluate("9" * 33) is None
    assert evaluate("1" * 10, max_chars=9) is None
    assert evaluate("12-30+4*5*2") == 12 - 30 + 4 * 5 * 2
    assert episode(["CALC(1234)"], max_expr_chars=3) == [Step(response="=?;")]


def test_any_other_text_is_the_answer() -> None:
    assert episode(["1776"]) == [Step(done=True, reward=1.0)]  # answered in its head
    assert episode(["1775"]) == [Step(done=True, reward=0.0)]
    assert episode(["calc(37*48)"]) == [Step(done=True, reward=0.0)]
    assert episode([""]) == [Step(done=True, reward=0.0)]


def test_deterministic_replay() -> None:
    turns = ["CALC(37*48)", "CALC(9*)", "1776"]
    assert episode(turns) == episode(turns)
    env = make()
    env.reset(ROW, 123)  # the seed changes nothing
    assert [env.step(t) for t in turns] == episode(turns)


def test_errors() -> None:
    with pytest.raises(RuntimeError, match="before reset"):
        make().step("1")
    with pytest.raises(ValueError, match="no `answer`"):
        make().reset({"prompt": "1*1="}, 0)
    with pytest.raises(ValueError, match="max_expr_chars"):
        make(max_expr_chars=0)

"""Rewards, the built-in task, and group-relative advantages (hand-computed values)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from rollkeep.advantages import group_advantages
from rollkeep.core.errors import UserInputError
from rollkeep.tasks import arith, check_tasks, reward_fn


def test_group_advantages_by_hand() -> None:
    # rewards 1, 0, 0, 1: mean 0.5, population std 0.5 -> (r - 0.5) / 0.5 = +-1
    assert group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0) == (1.0, -1.0, -1.0, 1.0)
    # rewards 3, 1, 2: mean 2, std sqrt(2/3) -> (1, -1, 0) / 0.8165
    adv = group_advantages([3.0, 1.0, 2.0], eps=0.0)
    assert adv == pytest.approx((1 / math.sqrt(2 / 3), -1 / math.sqrt(2 / 3), 0.0))
    # all equal: no signal, zero advantages (eps keeps it finite)
    assert group_advantages([0.7, 0.7, 0.7]) == (0.0, 0.0, 0.0)
    assert group_advantages([2.0, 0.0], normalize_std=False) == (1.0, -1.0)


def test_arith_rewards() -> None:
    row = {"prompt": "37+45=", "answer": "82"}
    assert arith.reward("82", row) == 1.0
    assert arith.reward(" 82 and more", row) == 1.0  # the first number counts
    assert arith.reward("83", row) == 0.0
    assert arith.reward("no number", row) == 0.0
    # partial credit: digits in the right place from the right, scaled by 0.5
    assert arith.reward("72", row, partial_credit=True) == pytest.approx(0.25)
    assert arith.reward("82", row, partial_credit=True) == 1.0
    assert reward_fn("arith_partial")("72", row) == pytest.approx(0.25)


def test_arith_rows_are_a_function_of_the_seed() -> None:
    a = arith.make_rows(50, digits=2, seed=3)
    assert a == arith.make_rows(50, digits=2, seed=3) != arith.make_rows(50, digits=2, seed=4)
    for r in a:
        x, y = r["prompt"][:-1].split("+")
        assert int(x) + int(y) == int(r["answer"]) and max(int(x), int(y)) < 100


def test_unknown_task_is_refused_with_the_known_ones() -> None:
    with pytest.raises(UserInputError) as err:
        check_tasks(["arith", "poetry"])
    assert "'poetry'" in str(err.value) and "arith" in err.value.expected


@pytest.mark.slow
def test_unknown_task_stops_the_run_at_start_up(tmp_path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "task": "poetry"}) + "\n")
    out = subprocess.run([sys.executable, "-m", "rollkeep", "train", str(tmp_path / "none.yaml"),
                          f"data.path={data}", f"run_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    out = subprocess.run([sys.executable, "-m", "rollkeep", "train", "tests/data/defaults.yaml",
                          f"data.path={data}", f"run_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "no reward function for task 'poetry'" in out.stderr
    assert not (tmp_path / "run").exists()


def test_held_out_rows_are_distinct_and_never_training_problems() -> None:
    train = arith.make_rows(3000, digits=2, seed=5)
    held = arith.held_out_rows(300, digits=2, seed=5, exclude=train)
    prompts = [r["prompt"] for r in held]
    assert len(set(prompts)) == 300
    assert not set(prompts) & {r["prompt"] for r in train}
    assert held == arith.held_out_rows(300, digits=2, seed=5, exclude=train)  # seeded
    assert all(str(sum(map(int, r["prompt"][:-1].split("+")))) == r["answer"] for r in held)
    # one-digit operands: 100 problems in all
    with pytest.raises(ValueError, match="only 0 problems"):
        arith.held_out_rows(1, digits=1, seed=0, exclude=arith.make_rows(2000, digits=1, seed=0))


def test_builtin_eval_rows_are_held_out() -> None:
    from rollkeep.config import load_config
    from rollkeep.controller.build import build_data
    from rollkeep.core.errors import ConfigError

    cfg = load_config(None, ["data.generated.n_rows=4000", "data.generated.eval_rows=200"])
    dataset, held = build_data(cfg)
    train = {dataset[i]["prompt"] for i in range(len(dataset))}
    assert len(held) == 200 and not train & {r["prompt"] for r in held}
    with pytest.raises(ConfigError) as err:
        build_data(load_config(None, ["data.generated.digits=1", "data.generated.eval_rows=100"]))
    assert err.value.field == "data.generated.eval_rows"


def test_arith_formats() -> None:
    assert arith.problem(7, 45, digits=2) == {"prompt": "7+45=", "answer": "52", "task": "arith"}
    assert arith.problem(7, 45, digits=2, fmt="padded")["prompt"] == "07+45="
    assert arith.problem(7, 45, digits=2, fmt="padded")["answer"] == "052"
    assert arith.problem(7, 45, digits=2, fmt="reversed")["answer"] == "250"
    assert arith.problem(99, 99, digits=2, fmt="reversed") == {"prompt": "99+99=", "answer": "891",
                                                               "task": "arith"}
    for fmt in arith.FORMATS:
        row = arith.problem(3, 60, digits=2, fmt=fmt)
        assert arith.operands(row) == (3, 60)
        assert arith.reward(row["answer"], row) == 1.0
    assert arith.reward("52", arith.problem(7, 45, digits=2, fmt="padded")) == 0.0  # the width counts
    # The plain format is what make_rows always wrote (runs of older versions resume).
    assert arith.make_rows(3, digits=2, seed=0) == [
        {"prompt": "6+88=", "answer": "94", "task": "arith"},
        {"prompt": "92+43=", "answer": "135", "task": "arith"},
        {"prompt": "93+40=", "answer": "133", "task": "arith"},
    ]
    # Every format writes the same problems.
    same = [arith.operands(r) for r in arith.make_rows(50, digits=2, seed=4)]
    for fmt in arith.FORMATS:
        assert [arith.operands(r) for r in arith.make_rows(50, digits=2, seed=4, fmt=fmt)] == same
    with pytest.raises(ValueError, match="unknown format"):
        arith.problem(1, 2, digits=2, fmt="roman")

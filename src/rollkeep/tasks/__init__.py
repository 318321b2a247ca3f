"""Tasks: datasets and the reward functions looked up by each row's `task` field."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..core.errors import UserInputError
from . import arith

RewardFn = Callable[[str, Mapping[str, Any]], float]


def _exact(text: str, row: Mapping[str, Any]) -> float:
    """Generic task: 1.0 if the completion (stripped) equals the row's `answer`."""
    return float(text.strip() == str(row.get("answer", "")).strip())


REWARDS: dict[str, RewardFn] = {
    arith.TASK: arith.reward,
    arith.TASK_PARTIAL: lambda text, row: arith.reward(text, row, partial_credit=True),
    "exact": _exact,
    "default": _exact,
}


def reward_fn(task: str) -> RewardFn:
    try:
        return REWARDS[task]
    except KeyError:
        raise UserInputError(
            f"no reward function for task {task!r}",
            field="task",
            expected="one of " + ", ".join(sorted(REWARDS)),
            found=repr(task),
            remedy="fix the rows' `task` field, or register a reward function in rollkeep.tasks.REWARDS",
        ) from None


def check_tasks(tasks: Iterable[str]) -> None:
    """Start-up check: every task in the dataset has a reward function."""
    for t in sorted(set(tasks)):
        reward_fn(t)

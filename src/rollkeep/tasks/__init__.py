"""Tasks: datasets and the reward functions looked up by each row's `task` field.

    reward_fn(task)       the reward function of a task: the run's `reward.fn` if it
                          covers the task, else the built-in one (`REWARDS`)
    use_rewards(spec)     install a run's `reward.fn` (called when a run is built; it
                          replaces whatever an earlier run in this process installed)
    check_tasks(tasks)    start-up check: every task has a reward function

Every reward function is called as `fn(completion: str, row: dict) -> float` (see
`rollkeep.tasks.custom` for what a user's function must do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..core.errors import UserInputError
from . import arith, calc

RewardFn = Callable[[str, Mapping[str, Any]], float]


def _exact(text: str, row: Mapping[str, Any]) -> float:
    """Generic task: 1.0 if the completion (stripped) equals the row's `answer`."""
    return float(text.strip() == str(row.get("answer", "")).strip())


REWARDS: dict[str, RewardFn] = {
    arith.TASK: arith.reward,
    arith.TASK_PARTIAL: lambda text, row: arith.reward(text, row, partial_credit=True),
    calc.TASK: calc.reward,
    "exact": _exact,
    "default": _exact,
}

# The run's `reward.fn`, resolved: task -> function, and `None` -> the function of every
# task (`reward.fn` given as one string). Empty: the built-in rewards only.
_CONFIGURED: dict[str | None, RewardFn] = {}


def use_rewards(spec: str | Mapping[str, str] | None, fns: Sequence[Any] | None = None) -> None:
    """Resolve a run's `reward.fn`, or its `reward.fns` (`fns`: the weighted sum of several,
    `rollkeep.tasks.weighted`), importing their modules (a UserInputError, exit 2, names
    what is wrong), and install it for `reward_fn`. All of it resolves before anything is
    installed; None installs nothing and removes an earlier run's functions."""
    from .custom import resolve
    from .weighted import resolve_all

    if fns:
        table: dict[str | None, RewardFn] = {None: resolve_all(fns)}
    elif spec is None:
        table = {}
    elif isinstance(spec, str):
        table = {None: resolve(spec)}
    else:
        table = {task: resolve(s, field=f"reward.fn.{task}") for task, s in spec.items()}
    _CONFIGURED.clear()
    _CONFIGURED.update(table)


def reward_fn(task: str) -> RewardFn:
    configured = _CONFIGURED.get(task) or _CONFIGURED.get(None)
    if configured is not None:
        return configured
    try:
        return REWARDS[task]
    except KeyError:
        raise UserInputError(
            f"no reward function for task {task!r}",
            field="task",
            expected="one of " + ", ".join(sorted(set(REWARDS) | {t for t in _CONFIGURED if t})),
            found=repr(task),
            remedy="fix the rows' `task` field, or give the task a reward function with "
            f"`reward.fn: {{{task}: \"package.module:function\"}}`",
        ) from None


def check_tasks(tasks: Iterable[str]) -> None:
    """Start-up check: every task in the dataset has a reward function."""
    for t in sorted(set(tasks)):
        reward_fn(t)

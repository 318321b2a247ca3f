"""Multi-turn environments (docs/design.md §5.4).

    Environment, Step, ENV_VERSION, REPLAY, SNAPSHOT   the protocol (`base`)
    resolve(env_cfg)      the run's environment factory from `env.name` / `env.factory`,
                          checked at start-up (any problem: UserInputError, exit 2); None
                          when the run has no environment (single-turn)
    BUILT_IN              the built-in environments by name

A run without an environment is the single-turn case: one model turn rewarded by the
task's reward function (`reward.fn`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import UserInputError
from . import calc
from .base import (
    ENV_VERSION,
    LEASE,
    RECOVERY_METHODS,
    RECOVERY_MODES,
    REPLAY,
    SNAPSHOT,
    EnvFactory,
    Environment,
    Step,
)

__all__ = ["BUILT_IN", "ENV_VERSION", "LEASE", "REPLAY", "SNAPSHOT", "EnvSpec", "Environment", "Step", "resolve"]


BUILT_IN: dict[str, EnvFactory] = {"calc": calc.make}


@dataclass(frozen=True)
class EnvSpec:
    """The run's environment: how to make one per episode, and the `env.*` limits."""

    factory: Callable[[], Environment]  # a fresh environment, kwargs applied
    recovery: str  # REPLAY, SNAPSHOT or LEASE, as the environment declares it
    max_turns: int
    timeout_s: float
    max_snapshot_bytes: int
    label: str  # `env.name` or `env.factory`, for messages
    max_turn_tokens: int | None = None  # env.max_turn_tokens: most new tokens in one model turn
    max_response_bytes: int = 1 << 16  # env.max_response_bytes (its default): the longest step response, UTF-8
    chat_template: bool = False  # data.chat_template: each response joins as a chat turn (`models.chat`)


def resolve(env: Any) -> EnvSpec | None:
    """`env` is the config's `env` section. Imports a factory, builds one environment to
    check it (a class or function that cannot be called with `env.kwargs`, raises or takes
    longer than `env.timeout_s`, returns something without `reset` and `step`, or declares
    an unknown `recovery`, is a start-up error), and returns its spec. The sample is built
    on a thread of its own (`controller.usercode.call_sync`), so a factory that never
    returns is an error too, not a hung start-up."""
    from ..controller.usercode import UserStop, call_sync

    if env.name is None and env.factory is None:
        return None
    kwargs = dict(env.kwargs)
    field = "env.name" if env.name is not None else "env.factory"
    if env.name is not None:
        factory, label = BUILT_IN[env.name], env.name
    else:
        from ..tasks.custom import find

        factory, _ = find(env.factory, field=field, what="environment class or factory")
        label = env.factory
        _check_kwargs(factory, kwargs, label)
    try:
        sample = call_sync(env.timeout_s, lambda: factory(**kwargs))
    except TimeoutError:
        raise UserInputError(
            f"{field} {label!r}: building an environment took longer than env.timeout_s={env.timeout_s:g} s",
            field=field, expected=f"{label}(**env.kwargs) to return an environment within env.timeout_s",
            found="no result (the call was abandoned)",
            remedy="fix what the constructor waits on, or raise env.timeout_s") from None
    except (Exception, UserStop) as e:  # UserStop: the constructor raised SystemExit or KeyboardInterrupt
        raise UserInputError(
            f"{field} {label!r}: building an environment failed", field=field,
            expected=f"{label}(**env.kwargs) to return an environment",
            found=f"{type(e).__name__}: {e}",
            remedy="fix the environment's constructor or env.kwargs") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(sample, m, None))]
    recovery = getattr(sample, "recovery", REPLAY)
    missing += [m for m in RECOVERY_METHODS.get(recovery, ()) if not callable(getattr(sample, m, None))]
    if missing or recovery not in RECOVERY_MODES:
        raise UserInputError(
            f"{field} {label!r} does not build an environment", field=field,
            expected="an object with reset(row, seed) and step(text) (and snapshot() and restore(data) "
                     f"if its `recovery` is {SNAPSHOT!r}; commit(), resume(handle) and release() if it is "
                     f"{LEASE!r}), `recovery` one of {list(RECOVERY_MODES)}",
            found=(f"no {', '.join(missing)}" if missing else f"recovery {recovery!r}")
                  + f" on {type(sample).__name__}",
            remedy="see docs/multiturn.md for the protocol")
    return EnvSpec(lambda: factory(**kwargs), recovery, env.max_turns, env.timeout_s, env.max_snapshot_bytes, label,
                   env.max_turn_tokens, env.max_response_bytes)


def _check_kwargs(factory: Callable[..., Any], kwargs: Mapping[str, Any], label: str) -> None:
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the sample build below tries it
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        raise UserInputError(
            f"env.factory {label!r} cannot be called with env.kwargs", field="env.kwargs",
            expected=f"{label}{sig} to accept {sorted(kwargs) or 'no arguments'}", found=str(e),
            remedy="change env.kwargs or the factory's parameters") from None

"""Several reward functions, weighted, as TRL users write them: `reward.fns`.

    resolve_all(entries)   the `reward.fns` entries resolved (imported and checked at
                           start-up: a UserInputError, exit 2, names what is wrong)
    Weighted               the run's reward: the weighted sum of its parts. Called as any
                           reward function, `(completion, row) -> float` (the evaluator
                           does); the run's loop calls `parts(...)` instead, so that each
                           part runs where it must and is logged as `reward/<name>`

Two signatures, told apart by the parameters:

    def f(completion, row) -> float                          per sample (rollkeep's own)
    def f(prompts, completions, **row_fields) -> list[float] batched (TRL's reward_funcs):
                                                             a parameter named `completions`
                                                             or `prompts` makes it batched

A batched function is called with one sample per call (lists of length 1: rollkeep rewards
each completion as it comes in, so that a finished sibling is sealed at once); its row
fields go as keywords, each a one-element list, as TRL passes the dataset's columns (only
those the function accepts, unless it takes `**kwargs`). A None in its result means it
gives no reward to that sample (it adds 0 and is left out of its metric). Either kind may
be `async def`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.errors import UserInputError
from .custom import checked_number, find

__all__ = ["Part", "Weighted", "resolve_all"]

_BATCHED_NAMES = ("completions", "prompts")


@dataclass(frozen=True)
class Part:
    name: str  # its metric is reward/<name>
    spec: str  # "package.module:function"
    weight: float
    fn: Callable[..., Any]
    batched: bool
    is_async: bool
    accepts: frozenset[str] | None  # the keywords a batched fn takes (None: any, it has **kwargs)

    def call(self, completion: str, row: Mapping[str, Any]) -> Any:
        """Its call on one sample: a value, or an awaitable of one if it is async."""
        if not self.batched:
            return self.fn(completion, row)
        fields = {k: [v] for k, v in row.items() if k not in ("prompt", "completion", "prompts", "completions")}
        kwargs = {"prompts": [row.get("prompt")], "completions": [completion], **fields}
        if self.accepts is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self.accepts}
        return self.fn(**kwargs)

    def value(self, result: Any) -> float | None:
        """Its result checked: a finite number (None: no reward from this part)."""
        if self.batched:
            if not isinstance(result, Sequence) or isinstance(result, str | bytes) or len(result) != 1:
                shown = repr(result)[:60]
                raise TypeError(f"{self.spec} returned {shown} ({type(result).__name__}), not a list of 1 reward "
                                "(a batched reward function returns one reward per completion)")
            result = result[0]
            if result is None:
                return None
        return checked_number(result, self.spec)


class Weighted:
    """The weighted sum of `parts`; `(completion, row) -> float` like any reward function."""

    def __init__(self, parts: tuple[Part, ...]) -> None:
        self.parts = parts
        self.__qualname__ = self.__name__ = "reward.fns"
        self.__module__ = __name__

    def __call__(self, completion: str, row: Mapping[str, Any]) -> float:
        values = {}
        for p in self.parts:
            result = p.call(completion, row)
            values[p.name] = p.value(asyncio.run(result) if inspect.isawaitable(result) else result)
        return self.total(values)

    async def parts_of(self, completion: str, row: Mapping[str, Any],
                       run: Callable[[Part], Awaitable[Any]]) -> dict[str, float | None]:
        """Each part's value; `run(part)` makes its call (on a worker thread, or awaited)."""
        return {p.name: p.value(await run(p)) for p in self.parts}

    def total(self, values: Mapping[str, float | None]) -> float:
        return sum(p.weight * v for p in self.parts if (v := values[p.name]) is not None)


def resolve_all(entries: Sequence[Any]) -> Weighted:
    """`reward.fns` (its config entries: `fn`, `weight`, `name`) resolved, checked at start-up."""
    parts: list[Part] = []
    for i, e in enumerate(entries):
        field = f"reward.fns[{i}].fn"
        fn, module = find(e.fn, field=field, what="function")
        path = getattr(module, "__file__", None)
        batched, accepts = _kind(fn, e.fn, field, path)
        name = e.name or e.fn.partition(":")[2].rsplit(".", 1)[-1]
        if any(p.name == name for p in parts):
            raise UserInputError(
                f"two reward.fns entries are named {name!r}", field=f"reward.fns[{i}].name",
                expected="a distinct name per entry (its metric is reward/<name>)", found=f"{e.fn} and an earlier entry",
                remedy=f"give one of them `name:` (e.g. name: {name}_{i})")
        parts.append(Part(name, e.fn, float(e.weight), fn, batched, inspect.iscoroutinefunction(fn), accepts))
    return Weighted(tuple(parts))


def _kind(fn: Callable[..., Any], spec: str, field: str, path: str | None) -> tuple[bool, frozenset[str] | None]:
    """(batched?, the keywords a batched fn accepts, None for any)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False, None  # a builtin without a signature: per sample, tried at the first call
    params = sig.parameters
    if any(n in params for n in _BATCHED_NAMES):
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return True, None
        return True, frozenset(n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
    try:
        sig.bind("completion", {"prompt": ""})
    except TypeError as e:
        raise UserInputError(
            f"{field} {spec!r} cannot be called with (completion, row) nor batched (prompts, completions, **kwargs)",
            path=path, field=field,
            expected="fn(completion, row) -> float, or fn(prompts, completions, **kwargs) -> list[float] (a parameter "
            "named `completions` makes it batched)",
            found=f"{getattr(fn, '__name__', spec)}{sig} ({e})",
            remedy="change the function's parameters to one of the two",
        ) from None
    return False, None

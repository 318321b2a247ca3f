"""Reward functions from the user's own code: `reward.fn: "package.module:function"`.

    resolve(spec, field)   import `package.module`, fetch `function`, check it can be
                           called as fn(completion, row); any problem is a UserInputError
                           (exit 2) naming the module, the attribute and the remedy
    checked(fn, spec)      the function, wrapped so that a result that is not a real
                           number raises (the run loop turns any exception of a reward
                           function into a data failure of that attempt)

The signature every reward function has (the built-in ones too):

    def reward(completion: str, row: dict) -> float
    async def reward(completion: str, row: dict) -> float     (awaited on the run's loop:
                                                              a judge over HTTP, docs/effects.md)

`completion` is the decoded completion text (without the prompt, EOS ended), `row` the
dataset row with every field (`prompt`, `task`, `answer`, ...). The result must be a
finite number; NaN and infinities are data failures as well.

Modules are imported from the Python path with the current directory in front of it (as
`python -m` would), so a `my_rewards.py` next to the config works as `my_rewards:score`.
"""

from __future__ import annotations

import importlib
import inspect
import numbers
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from ..core.errors import UserInputError

RewardFn = Callable[[str, Mapping[str, Any]], float]

_SIGNATURE = "fn(completion: str, row: dict) -> float"


def resolve(spec: str, *, field: str = "reward.fn") -> RewardFn:
    """The function `spec` ("package.module:function", attribute paths allowed after the
    colon) names, checked to accept (completion, row), and wrapped by `checked`."""
    obj, module = find(spec, field=field, what="function")
    _check_signature(obj, spec, field, getattr(module, "__file__", None))
    return checked(obj, spec)


def find(spec: str, *, field: str, what: str) -> tuple[Callable[..., Any], Any]:
    """The callable `spec` ("package.module:attr.path") names and its module; any problem
    is a UserInputError (exit 2). `what` names what the user meant it to be."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise UserInputError(
            f"{field} {spec!r} does not name a {what}",
            field=field,
            expected=f"`package.module:{what}`, e.g. `my_module:name`",
            found=repr(spec),
            remedy=f"write {field} as the module's import path, a colon, and the {what}'s name",
        )
    module = _import(module_name, spec, field)
    obj: Any = module
    for i, part in enumerate(attr_path.split(".")):
        if not hasattr(obj, part):
            owner = module_name + "".join(f".{p}" for p in attr_path.split(".")[:i])
            names = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise UserInputError(
                f"{field} {spec!r}: {owner} has no attribute {part!r}",
                path=getattr(module, "__file__", None),
                field=field,
                expected=f"a {what} {attr_path} in module {module_name}",
                found=f"its callables: {', '.join(names[:20]) or 'none'}",
                remedy="fix the function name after the colon",
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserInputError(
            f"{field} {spec!r} is not callable",
            path=getattr(module, "__file__", None),
            field=field,
            expected=f"a {what}" + (f" {_SIGNATURE}" if what == "function" else ""),
            found=f"{repr(obj)[:60]} (of type {type(obj).__name__})",
            remedy=f"point {field} at a {what}",
        )
    return obj, module


def checked(fn: Callable[..., Any], spec: str) -> RewardFn:
    """`fn`, refusing a result that is not a real number (a string, None, a list, a
    tensor): `float()` would quietly accept "0.5" or a one-element tensor. An `async def`
    function stays one (the run awaits it on its loop)."""
    if inspect.iscoroutinefunction(fn):
        async def reward(completion: str, row: Mapping[str, Any]) -> float:
            return checked_number(await fn(completion, row), spec)
    else:
        def reward(completion: str, row: Mapping[str, Any]) -> float:  # type: ignore[misc]
            return checked_number(fn(completion, row), spec)

    reward.__name__ = getattr(fn, "__name__", "reward")
    reward.__qualname__ = f"checked({spec})"
    reward.__doc__ = getattr(fn, "__doc__", None)
    return reward  # type: ignore[return-value]


def checked_number(value: Any, spec: str) -> float:
    """`value` as a float if it is a real number, else TypeError naming `spec`."""
    if not isinstance(value, numbers.Real):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TypeError(f"{spec} returned {shown} ({type(value).__name__}), not a number")
    return float(value)


def _import(module_name: str, spec: str, field: str) -> Any:
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        raise UserInputError(
            f"{field} {spec!r}: module {module_name!r} cannot be imported"
            + (f" (no module named {missing!r})" if missing != module_name else ""),
            field=field,
            expected=f"module {module_name} importable from the current directory ({cwd}) or "
            "the Python path",
            found=f"ModuleNotFoundError: {e}",
            remedy="check the module's name, run from the directory that holds it, or add its "
            "directory to PYTHONPATH (or install its package)",
        ) from None
    except Exception as e:  # the module itself failed while importing: its author's to fix
        raise UserInputError(
            f"{field} {spec!r}: importing module {module_name!r} failed",
            field=field,
            expected=f"module {module_name} to import cleanly",
            found=f"{type(e).__name__}: {e}",
            remedy=f"fix the module (try `python -c 'import {module_name}'` to see the traceback)",
        ) from None
    finally:
        if added:
            sys.path.remove(cwd)


def _check_signature(fn: Callable[..., Any], spec: str, field: str, path: str | None) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: it is tried at the first call
    try:
        sig.bind("completion", {"prompt": ""})
    except TypeError as e:
        raise UserInputError(
            f"{field} {spec!r} cannot be called with (completion, row)",
            path=path,
            field=field,
            expected=f"a function {_SIGNATURE}: two positional parameters, any others optional",
            found=f"{getattr(fn, '__name__', spec)}{sig} ({e})",
            remedy="change the function's parameters to (completion, row)",
        ) from None

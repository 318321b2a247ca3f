"""Config problems: the rules that tie keys together, and the wording of every error
(all problems of a config are collected into one `ConfigError`)."""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import (
    BaseModel,
)

from ..core.errors import ConfigError

# ------------------------------------------------------------------------ cross-field

_DEFER_CROSS_FIELD = "rollkeep.config.defer_cross_field"
_BROKEN = object()  # a value that is absent, invalid, or already reported


def _under(path: str, prefixes: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class _Problem:
    path: str
    line: str  # one readable line naming the dotted path, what was expected and found


def _cross_field_problems(get: Callable[[str], Any]) -> list[_Problem]:
    """Rules that tie keys together. `get(dotted_path)` returns the value (its default when
    absent) or `_BROKEN`, in which case the rule is skipped: that key is reported already."""
    problems: list[_Problem] = []

    if get("deterministic") is True:
        sampler = get("sampler.name")
        if isinstance(sampler, str) and sampler != "in_order":
            problems.append(
                _Problem(
                    "sampler.name",
                    f"`deterministic: true` needs `sampler.name: in_order`; found `{sampler}` "
                    "(only in_order pins which weight version generates each step)",
                )
            )
        if get("rollout.on_dropped_prompt") == "replace":
            problems.append(
                _Problem(
                    "rollout.on_dropped_prompt",
                    "`deterministic: true` needs `rollout.on_dropped_prompt: shrink`; found "
                    "`replace` (which prompt refills a step depends on how far generation ran "
                    "ahead when the drop happened, which is timing)",
                )
            )
        if get("engine.name") == "torch" and get("engine.update_weights_in_flight") is True:
            problems.append(
                _Problem(
                    "engine.update_weights_in_flight",
                    "`deterministic: true` needs `engine.update_weights_in_flight: false`; found "
                    "true (a weight update inside a generation depends on timing)",
                )
            )
        dtype = get("engine.dtype")
        if get("engine.name") == "hf" and isinstance(dtype, str) and dtype != "auto":
            problems.append(
                _Problem(
                    "engine.dtype",
                    f"`deterministic: true` samples the hf engine in float64 and needs `engine.dtype: auto`; "
                    f"found `{dtype}` (a batch of another size must not flip a token on a last-bit difference)",
                )
            )

    engine, trainer = get("engine.name"), get("trainer.name")
    pairs = {"toy": ("toy",), "torch": ("torch", "custom"), "hf": ("hf",), "vllm": ("hf",), "remote": ("hf",)}
    if isinstance(engine, str) and isinstance(trainer, str) and engine in pairs and trainer not in pairs[engine]:
        problems.append(
            _Problem(
                "trainer.name",
                f"`engine.name: {engine}` needs `trainer.name: {' or '.join(pairs[engine])}`; found "
                f"`{trainer}` (the trainer's weights must load into the engine's model)",
            )
        )

    if get("data.chat_template") is True and engine in ("toy", "torch"):
        problems.append(_Problem("data.chat_template", "`data.chat_template: true` renders prompts and episodes with "
                                                       "the model tokenizer's chat template: it needs `engine.name: "
                                                       f"hf`, `vllm` or `remote` (a Hugging Face tokenizer); found "
                                                       f"`engine.name: {engine}`, whose tokenizer has no chat "
                                                       "template (set data.chat_template=false, or use a Hugging "
                                                       "Face model)"))

    key_env = get("engine.api_key_env")
    if engine == "remote" and isinstance(key_env, str) and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env):
        # (never echoed: a token pasted here by mistake must not reach a log)
        problems.append(_Problem("engine.api_key_env", "the NAME of an environment variable holding the token "
                                                       "([A-Za-z_][A-Za-z0-9_]*); found something else (not shown: "
                                                       "it may be the token itself)"))
    replicas, backend = get("engine.replicas"), get("cluster.backend")
    if engine == "remote" and (replicas != 1 or backend != "local"):
        key = "engine.replicas" if replicas != 1 else "cluster.backend"
        problems.append(_Problem(key, "`engine.name: remote` drives the servers of `engine.servers` from the "
                                      f"controller: it needs `engine.replicas: 1` and `cluster.backend: local`; found "
                                      f"`engine.replicas: {replicas}`, `cluster.backend: {backend}`"))
    elif isinstance(replicas, int) and replicas > 1 and backend == "local":
        problems.append(_Problem("engine.replicas", f"`engine.replicas: {replicas}` needs `cluster.backend=ray` "
                                                    "(the local backend runs one engine inside the controller); "
                                                    "found `cluster.backend: local`"))

    lo, hi = get("rollout.backoff_ms"), get("rollout.backoff_max_ms")
    if _is_number(lo) and _is_number(hi) and hi < lo:
        problems.append(
            _Problem(
                "rollout.backoff_max_ms",
                f"`rollout.backoff_max_ms` must be >= `rollout.backoff_ms` ({lo}); found {hi}",
            )
        )

    name, factory = get("env.name"), get("env.factory")
    if isinstance(name, str) and isinstance(factory, str):
        problems.append(_Problem("env.factory", f"set `env.name` or `env.factory`, not both; found "
                                                f"`env.name: {name}` and `env.factory: {factory}`"))
    from ..envs import (
        BUILT_IN,  # at call time: the environments import the core, which imports the config's errors
    )

    if isinstance(name, str) and name not in BUILT_IN:
        problems.append(_Problem("env.name", f"`env.name` must be a built-in environment ({', '.join(BUILT_IN)}) "
                                             f"or null; found `{name}` (your own environment goes in `env.factory`)"))

    if get("trainer.name") in ("torch", "custom"):
        embd, head = get("trainer.model.n_embd"), get("trainer.model.n_head")
        if _is_int(embd) and _is_int(head) and head > 0 and embd % head:
            problems.append(
                _Problem(
                    "trainer.model.n_embd",
                    f"`trainer.model.n_embd` must be a multiple of `trainer.model.n_head` ({head}); "
                    f"found {embd}",
                )
            )
    return problems


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _model_getter(cfg: Any) -> Callable[[str], Any]:
    def get(path: str) -> Any:
        node: Any = cfg
        for part in path.split("."):
            node = getattr(node, part, _BROKEN)
            if node is _BROKEN:
                return _BROKEN
        return node

    return get


def _raw_getter(raw: Mapping[str, Any], reported: set[str], root: type[BaseModel]) -> Callable[[str], Any]:
    """Read a dotted path from the unvalidated dict, falling back to the model default of
    the variant the dict names (from `root`, the config's model); `_BROKEN` if the path was
    reported or does not resolve."""

    def get(path: str) -> Any:
        if any(_under(path, [r]) or _under(r, [path]) for r in reported):
            return _BROKEN
        node: Any = raw
        model: type[BaseModel] | None = root
        for part in path.split("."):
            field = model.model_fields.get(part) if model is not None else None
            if field is None:
                return _BROKEN
            value = node.get(part, _BROKEN) if isinstance(node, Mapping) else _BROKEN
            variants = _variants(field.annotation)
            if variants:
                name = value.get("name", "toy") if isinstance(value, Mapping) else "toy"
                model = variants.get(name)
                node = value if isinstance(value, Mapping) else {}
            elif _is_model(field.annotation):
                model = field.annotation
                node = value if isinstance(value, Mapping) else {}
            else:
                model = None
                if value is _BROKEN:
                    if field.is_required():
                        return _BROKEN
                    value = field.get_default(call_default_factory=True)
                node = value
        return node

    return get


# ------------------------------------------------------------------- error messages


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _variants(annotation: Any) -> dict[str, type[BaseModel]]:
    """For a union of models chosen by `name`: {name: model}; else {}."""
    if typing.get_origin(annotation) not in (Union, types.UnionType):
        return {}
    out = {}
    for model in typing.get_args(annotation):
        if _is_model(model) and "name" in model.model_fields:
            out[model.model_fields["name"].default] = model
    return out


def _resolve(
    loc: tuple[Any, ...], root: type[BaseModel]
) -> tuple[str, type[BaseModel] | None, str | None]:
    """Pydantic's error location under the model `root` -> (dotted path without union
    tags, the model at the end of it or None, the union section's chosen variant name if
    the path crossed one)."""
    shown: list[str] = []
    model: type[BaseModel] | None = root
    variant: str | None = None
    i = 0
    while i < len(loc):
        part = loc[i]
        i += 1
        if isinstance(part, int):
            shown[-1:] = [f"{shown[-1]}[{part}]"] if shown else [f"[{part}]"]
            model = None
            continue
        shown.append(str(part))
        field = model.model_fields.get(part) if model is not None else None
        model = None
        if field is None:
            continue
        variants = _variants(field.annotation)
        if variants:
            if i < len(loc) and loc[i] in variants:
                variant = loc[i]
                model = variants[variant]
                i += 1
        elif _is_model(field.annotation):
            model = field.annotation
    return ".".join(shown), model, variant


_KINDS = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "tuple_type": "a list",
    "model_type": "a section (a mapping of keys to values)",
    "model_attributes_type": "a section (a mapping of keys to values)",
    "dict_type": "a section (a mapping of keys to values)",
}
_BOUNDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def _problem_from_pydantic(e: Mapping[str, Any], root: type[BaseModel]) -> _Problem:
    """One pydantic error of validating the model `root`, in our wording."""
    kind, loc, ctx, value = e["type"], tuple(e["loc"]), e.get("ctx") or {}, e.get("input")
    if kind == "extra_forbidden":
        parent_path, parent, variant = _resolve(loc[:-1], root)
        return _Problem(_resolve(loc, root)[0], _unknown_key(parent_path, parent, variant, loc[-1], root))
    path, _, _ = _resolve(loc, root)
    if kind == "missing":
        return _Problem(path, f"`{path}` is required and has no default; set it")
    if kind == "union_tag_invalid":
        names = ", ".join(ctx.get("expected_tags", "").replace("'", "").split(", "))
        return _Problem(
            f"{path}.name",
            f"`{path}.name` must be one of {names}; found {_show(ctx.get('tag'))}",
        )
    if kind == "literal_error":
        expected = f"one of {ctx.get('expected', '').replace(chr(39), '')}"
    elif kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        expected = f"a value {op} {ctx.get(key)}"
    elif kind in _KINDS:
        expected = _KINDS[kind]
    else:
        expected = str(e["msg"]).removeprefix("Input should be ").rstrip(".")
    line = f"`{path}`: expected {expected}; found {_show(value)}"
    if kind == "string_type" and isinstance(value, (int, float, bool)):
        line += "; YAML reads it as a number or boolean, so quote it"
    elif kind in ("int_type", "float_type", "bool_type") and isinstance(value, str) and _quoted(value, kind):
        line += "; remove the quotes"
    return _Problem(path, line)


def _unknown_key(
    parent_path: str, parent: type[BaseModel] | None, variant: str | None, key: Any,
    root: type[BaseModel],
) -> str:
    full = f"{parent_path}.{key}" if parent_path else str(key)
    line = f"unknown key `{full}`"
    if parent is None:
        return line
    valid = list(parent.model_fields)
    close = difflib.get_close_matches(str(key), valid, n=1)
    prefix = f"{parent_path}." if parent_path else ""
    if close:
        line += f"; did you mean `{prefix}{close[0]}`?"
    else:
        line += f"; valid keys here: {', '.join(valid)}"
    if variant is not None:
        # The key may belong to another variant: the commonest slip after `engine.name=...`.
        section = parent_path.split(".")[-1]
        field = root.model_fields.get(section)
        others = _variants(field.annotation if field else None)
        keys = {k for model in others.values() for k in model.model_fields} - set(valid)
        meant = difflib.get_close_matches(str(key), sorted(keys), n=1)
        if meant:
            owners = [name for name, model in others.items() if meant[0] in model.model_fields]
            line += (
                f" (`{meant[0]}` is a setting of {section} {', '.join(owners)}; "
                f"this {section} is `{variant}`)"
            )
    return line


def _quoted(text: str, kind: str) -> bool:
    """A string that YAML reads as the expected type once unquoted ("4" for an integer):
    it was quoted. "four" was not, and "remove the quotes" would not fix it."""
    try:
        unquoted = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    if kind == "bool_type":
        return isinstance(unquoted, bool)
    if isinstance(unquoted, bool):
        return False
    return isinstance(unquoted, int) or (kind == "float_type" and isinstance(unquoted, float))


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    kind = {
        str: "a string",
        int: "an integer",
        float: "a number",
        list: "a list",
        dict: "a mapping",
    }.get(type(value))
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({kind})" if kind in ("a string", "a list", "a mapping") else text


def _config_error(
    problems: Sequence[_Problem],
    *,
    path: str | Path | None,
    overrides: Sequence[str],
    source: str | None = None,
) -> ConfigError:
    if source is None:
        source = f"config file {path}" if path is not None else "the default config"
    if overrides:
        source += " with overrides " + " ".join(overrides)
    n = len(problems)
    given = [o.partition("=")[0].strip() for o in overrides]
    lines = "\n".join(f"  - {p.line}" + (" (from the command line)" if _from_overrides(p.path, given) else "")
                      for p in problems)
    return ConfigError(
        f"{n} problem{'s' if n > 1 else ''} in {source}:\n{lines}\nNothing was run",
        path=None if path is None else str(path),
        field=", ".join(dict.fromkeys(p.path for p in problems)),
        remedy="fix every key listed above, in the file or in the overrides; "
        "configs/toy.yaml is a valid example",
    )


def _from_overrides(path: str, given: Sequence[str]) -> bool:
    """The problem's key was set (or set inside) by a `key=value` override."""
    return any(key == path or path.startswith(key + ".") or key.startswith(path + ".") for key in given if key)

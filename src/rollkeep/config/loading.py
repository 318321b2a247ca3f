"""Reading a config: YAML (safe, YAML 1.2 floats, duplicate keys refused), dotted
overrides, backend switches by override, validation into `Config`."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    ValidationError,
)

from ..core.errors import ConfigError
from .problems import (
    _DEFER_CROSS_FIELD,
    _config_error,
    _cross_field_problems,
    _model_getter,
    _Problem,
    _problem_from_pydantic,
    _raw_getter,
    _show,
    _variants,
)
from .sections import Config

# ------------------------------------------------------------------------------ loading


class _Loader(yaml.SafeLoader):
    """`yaml.SafeLoader` with two fixes: YAML 1.2 floats (`3e-4` is a number, not the
    string PyYAML's YAML 1.1 rules make it) and an error on a duplicate key (PyYAML keeps
    the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"duplicate key {key!r} (first defined on line {seen[key].line + 1})",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _parse_yaml(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader: no arbitrary objects
    except RecursionError:  # PyYAML recurses per nesting level; no config nests that deep
        raise yaml.YAMLError("nested too deeply to be a config") from None


def load_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    *,
    warn: Callable[[str], None] | None = None,
) -> Config:
    """Read the YAML file at `path` (None = defaults only), apply dotted overrides
    (`train.total_steps=50`, `engine.name=torch`, `data.path=null`; each value is read as
    YAML), and validate. Every problem is raised together as one `ConfigError`.

    An override that changes the `name` of the file's `engine` or `trainer` section
    switches backend: the section starts from the new backend's defaults and keeps the
    file's keys the new backend has; `warn` (default: a `warning:` line on stderr) is told
    which file keys were dropped. Keys given as overrides are never dropped: one the new
    backend does not have is an error, like any unknown key."""
    raw = _read_file(path) if path is not None else {}
    for line in _switch_backends(raw, overrides, path):
        (warn or _warn_stderr)(line)
    problems: list[_Problem] = []
    for text in overrides:
        problem = _apply_override(raw, text)
        if problem is not None:
            problems.append(problem)

    cfg: Config | None = None
    try:
        cfg = Config.model_validate(raw, context={_DEFER_CROSS_FIELD: True})
    except ValidationError as err:
        problems.extend(_problem_from_pydantic(e, Config) for e in err.errors())

    reported = {p.path for p in problems}
    getter = _model_getter(cfg) if cfg is not None else _raw_getter(raw, reported, Config)
    problems.extend(_cross_field_problems(getter))

    if problems:
        raise _config_error(problems, path=path, overrides=overrides)
    assert cfg is not None
    return cfg


def _warn_stderr(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr)


def _switch_backends(raw: dict[str, Any], overrides: Sequence[str], path: str | Path | None) -> list[str]:
    """Where an override gives a union section (`engine`, `trainer`) another backend `name`
    than the file's, rebuild that section of `raw` from the file's keys the new backend
    accepts (its other keys take the new backend's defaults). Returns one line per section
    that lost keys. Malformed overrides are left for `_apply_override` to report."""
    notes = []
    for section, field in Config.model_fields.items():
        variants = _variants(field.annotation)
        old = raw.get(section)
        if not variants or not isinstance(old, dict):
            continue
        new_name = None
        for text in overrides:
            key, sep, value = text.partition("=")
            if sep and key.strip() == f"{section}.name":
                try:
                    new_name = _parse_yaml(value)
                except yaml.YAMLError:
                    new_name = None
        old_name = old.get("name", "toy")
        if not isinstance(new_name, str) or new_name not in variants or new_name == old_name:
            continue
        accepted = variants[new_name].model_fields
        kept = {k: v for k, v in old.items() if k in accepted and k != "name"}
        dropped = [str(k) for k in old if k not in accepted and k != "name"]
        raw[section] = {"name": new_name, **kept}
        if dropped:
            where = f"config file {path}" if path is not None else "the config"
            notes.append(
                f"`{section}.name={new_name}` replaces `{section}.name: {old_name}` of {where}: "
                f"{section} starts from the {new_name} defaults and drops the file's "
                + ", ".join(f"`{section}.{k}`" for k in dropped)
                + f" (not settings of {section} {new_name})"
                + (f"; kept {', '.join(f'`{section}.{k}`' for k in kept)}" if kept else "")
            )
    return notes


def _read_file(path: str | Path) -> dict[str, Any]:
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"config file {where} does not exist",
            path=where,
            expected="a readable YAML file",
            found="no such file",
            remedy="check the path, or give no config file to run with the defaults",
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"config file {where} cannot be read",
            path=where,
            expected="a readable UTF-8 YAML file",
            found=f"{type(err).__name__}: {err}",
            remedy="check the path and the file's permissions and encoding",
        ) from None
    try:
        data = _parse_yaml(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        found = err.problem or err.context or "a syntax error"
        if err.problem and err.context and err.context_mark is not None:
            found += f" ({err.context}, which starts at line {err.context_mark.line + 1})"
        raise ConfigError(
            f"config file {where} is not valid YAML{at}: {err.problem or err.context}",
            path=where,
            expected="valid YAML",
            found=found,
            remedy=f"fix the YAML{at}",
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(
            f"config file {where} is not valid YAML: {err}",
            path=where,
            expected="valid YAML",
            found=str(err),
            remedy="fix the YAML",
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {where} must be a mapping of keys to values",
            path=where,
            expected="a mapping at the top level (`key: value` lines)",
            found=_show(data),
            remedy="write the config as `section:` / `  key: value` lines",
        )
    return data


def _apply_override(raw: dict[str, Any], text: str) -> _Problem | None:
    """Set one `a.b.c=value` in `raw` (creating sections on the way); a problem or None."""
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep:
        return _Problem(
            text,
            f"override `{text}` has no `=`; expected `key.sub=value`, e.g. `train.total_steps=50`",
        )
    parts = key.split(".")
    if not key or any(not p for p in parts):
        return _Problem(text, f"override `{text}` has an empty key; expected `key.sub=value`")
    try:
        value = _parse_yaml(value_text)
    except yaml.YAMLError as err:
        detail = " ".join(str(getattr(err, "problem", None) or err).split())
        return _Problem(key, f"override `{text}`: the value is not valid YAML ({detail}); quote it")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            section = ".".join(parts[: i + 1])
            return _Problem(
                section,
                f"override `{text}`: `{section}` is {_show(child)}, not a section, so it has "
                f"no key `{parts[i + 1]}`",
            )
        node = child
    node[parts[-1]] = value
    return None



"""Config fingerprints and dotted-path diffs (restore step 8, docs/design.md §5).

A run's semantic config is the part that changes what it trains on (dataset, seed, group
size, prompts per step, sampler, ...). The checkpoint stores it; a resume compares it with
the new run's and refuses any difference the user did not name.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ConfigMismatch


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1}. Lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, path + "."))
        else:
            out[path] = v
    return out


def fingerprint(tree: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a config tree."""
    blob = json.dumps(tree, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


_MISSING = "<absent>"


def diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every dotted path whose value differs, as (path, old, new), sorted by path."""
    a, b = flatten(old), flatten(new)
    return [
        (k, a.get(k, _MISSING), b.get(k, _MISSING))
        for k in sorted(a.keys() | b.keys())
        if a.get(k, _MISSING) != b.get(k, _MISSING)
    ]


def format_diff(changes: Iterable[tuple[str, Any, Any]]) -> str:
    return "\n".join(f"  {path}: {old!r} -> {new!r}" for path, old, new in changes)


def is_allowed(path: str, allow: Iterable[str]) -> bool:
    """Whether `--allow-config-change` keys `allow` cover the dotted key `path` (a key
    allows itself and everything under it)."""
    return any(path == a or path.startswith(a + ".") for a in allow)


def check_compatible(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    allow: Iterable[str] = (),
    path: str | None = None,
    added: Mapping[str, Any] | None = None,
) -> list[tuple[str, Any, Any]]:
    """Raise `ConfigMismatch` unless every differing key is in `allow` (a key allows
    itself and everything under it). Returns the allowed differences.

    `added` maps keys that later versions added to the value that reproduces what runs
    did before the key existed: a checkpoint without such a key is compatible with that
    value (and only with it)."""
    allowed = tuple(allow)
    added = added or {}
    changes = [
        c for c in diff(saved, current)
        if not (c[1] == _MISSING and c[0] in added and c[2] == added[c[0]])
    ]
    refused = [c for c in changes if not is_allowed(c[0], allowed)]
    if refused:
        keys = " ".join(f"--allow-config-change {c[0]}" for c in refused)
        raise ConfigMismatch(
            "the config changes keys that change what the run trains on:\n" + format_diff(refused),
            diff=refused,
            path=path,
            field=", ".join(c[0] for c in refused),
            expected="the values the checkpoint was written with",
            found="the values listed above",
            remedy=f"restore the old values, start a new run_dir, or accept the change with {keys}",
        )
    return changes

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


#: Keys whose change makes a run_dir another job's: its remedy is a new run_dir, not a list
#: of --allow-config-change flags (which still accept the change, key by key).
OTHER_JOB_KEYS = frozenset({"engine.name", "trainer.name"})


def format_diff(changes: Iterable[tuple[str, Any, Any]]) -> str:
    """One `  - key: old -> new` line per key (the CLI prints each on its own line)."""
    return "\n".join(f"  - {path}: {old!r} -> {new!r}" for path, old, new in changes)


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
        other = [c for c in refused if c[0] in OTHER_JOB_KEYS]
        if other:  # a different engine or trainer: another job, not a change to this one
            what = ", ".join(f"{k} {o!r} -> {n!r}" for k, o, n in other)
            raise ConfigMismatch(
                f"this run_dir belongs to another job ({what}): use a new run_dir. The config "
                f"differs in {len(refused)} key(s) that change what the run trains on:\n"
                + format_diff(refused) + "\nNothing was run or written",
                diff=refused, path=path, field=", ".join(c[0] for c in refused),
                expected="the job the checkpoint was written by", found="the values listed above",
                remedy="give this config a run_dir of its own (run_dir=runs/NEW), or rerun the old job "
                "with the config it was started with",
            )
        keys = " ".join(f"--allow-config-change {c[0]}" for c in refused)
        raise ConfigMismatch(
            "the config changes keys that change what the run trains on:\n" + format_diff(refused)
            + "\nNothing was run or written",
            diff=refused,
            path=path,
            field=", ".join(c[0] for c in refused),
            expected="the values the checkpoint was written with",
            found="the values listed above",
            remedy=f"restore the old values, start a new run_dir, or accept the change with {keys}",
        )
    return changes

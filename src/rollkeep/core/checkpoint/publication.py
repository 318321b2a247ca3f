"""What a checkpoint publication writes, checked before anything is on disk.

`CheckpointStore.publish` (`rollkeep.core.checkpoint.store`, steps P1-P9 of its protocol) takes its
content from here: the caller's files (`check_files`), the manifest's fields
(`manifest_fields`, P1), and what a trainer's `save(dir)` wrote into its directory
(`saved_files`, P3). Each refuses what a manifest could not list or `open` would refuse.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollkeep.core.checkpoint.manifest import (
    MANIFEST_SCHEMA,
    RESERVED_KEYS,
    _canonical_compact,
    _relpath_problem,
    ancestors,
)
from rollkeep.core.errors import CheckpointError
from rollkeep.core.io.fs import DIR, FILE, FS, SYMLINK

__all__ = ["check_files", "manifest_fields", "saved_files"]


def saved_files(fs: FS, tmp: Path, top: str) -> tuple[list[tuple[str, int, str]], list[str]]:
    """What a `save` wrote into `tmp/top/`: (relative path, size, sha256) of every regular
    file, sorted, and every directory (`top` included). Nothing is followed: a symlink
    could point outside the checkpoint, a FIFO would block a reader, and neither can be
    verified by a sha256 of its bytes, so anything but a regular file or a directory is
    refused, as is an empty directory (the manifest lists files, so `open` would refuse
    it as unlisted) and a name the manifest cannot list."""

    def refuse(rel: str, what: str, expected: str, found: str) -> CheckpointError:
        return CheckpointError(
            f"the trainer's save wrote {what} into the checkpoint; nothing was published",
            path=str(tmp / rel), expected=expected, found=found,
            remedy="make the trainer's save(dir) write only regular files (and directories "
            "holding them) with plain names into dir, and record its step in one of them",
        )

    files: list[tuple[str, int, str]] = []
    dirs: list[str] = []

    def walk(rel: str) -> None:
        dirs.append(rel)
        entries = fs.listdir(tmp / rel)
        if not entries:
            raise refuse(rel, "an empty directory", "at least one file in every directory",
                         "an empty directory")
        for name, kind in entries:
            sub = f"{rel}/{name}"
            problem = _relpath_problem(sub)
            if problem is not None:
                raise refuse(sub, f"a name the manifest cannot list ({name!r})", problem, repr(sub))
            if kind == DIR:
                walk(sub)
            elif kind == FILE:
                size, digest = fs.hash(tmp / sub)  # streamed; never the whole file in memory
                files.append((sub, size, digest))
            else:
                what = "a symlink" if kind == SYMLINK else "a special file (FIFO, socket or device)"
                raise refuse(sub, f"{what} {name!r}", "only regular files and directories",
                             fs.describe(tmp / sub))

    walk(top)
    return sorted(files), dirs


def check_files(files: Mapping[str, bytes]) -> list[tuple[str, memoryview]]:
    """`files` (relative path -> bytes) as sorted (path, byte view) pairs; a name the
    manifest cannot list, content that is not bytes, or a file that is also a directory
    raises ValueError (TypeError for the content)."""
    entries: list[tuple[str, memoryview]] = []
    for rel, data in files.items():
        problem = _relpath_problem(rel)
        if problem is not None:
            raise ValueError(f"checkpoint file name {rel!r}: {problem}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"checkpoint file {rel!r}: expected bytes, got {type(data).__name__}")
        entries.append((rel, memoryview(data).cast("B")))
    entries.sort()
    names = {rel for rel, _ in entries}
    for d in sorted(ancestors(names) & names):
        raise ValueError(f"checkpoint file {d!r} is also a directory")
    return entries


def manifest_fields(
    name: str, step: int, entries: list[tuple[str, memoryview]], meta: Mapping[str, Any]
) -> dict[str, Any]:
    """MANIFEST.json's fields for `entries` and `meta` (P1), before any saved file is
    added; a reserved or non-string `meta` key, or `meta` that is not JSON, raises
    ValueError."""
    for key in meta:
        if not isinstance(key, str):
            raise ValueError(f"meta keys must be strings, got {key!r}")
        if key in RESERVED_KEYS:
            raise ValueError(
                f"meta key {key!r} is reserved by the store "
                f"(reserved: {', '.join(sorted(RESERVED_KEYS))})"
            )
    fields: dict[str, Any] = {
        "manifest_schema": MANIFEST_SCHEMA,
        "name": name,
        "step": step,
        "created": time.time(),
        "files": {
            rel: {"size": len(view), "sha256": hashlib.sha256(view).hexdigest()}
            for rel, view in entries
        },
        **meta,
    }
    try:
        _canonical_compact(fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be JSON-serialisable (no NaN): {e}") from e
    return fields

"""A trainer's files as bytes, for tests that compare or corrupt them: `files_of` saves a
snapshot into a fresh directory and reads it back; `as_dir` writes bytes into one for
`Trainer.load`. The directories live until the test process ends."""

from __future__ import annotations

import atexit
import itertools
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_root = tempfile.TemporaryDirectory(prefix="rollkeep-trainer-files-")
atexit.register(_root.cleanup)
_n = itertools.count()


def fresh_dir() -> Path:
    d = Path(_root.name) / str(next(_n))
    d.mkdir()
    return d


def read_dir(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def files_of(snapshot: Any) -> dict[str, bytes]:
    d = fresh_dir()
    snapshot.save(d)
    return read_dir(d)


def as_dir(files: Mapping[str, bytes]) -> Path:
    d = fresh_dir()
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return d

"""`trace.jsonl`: one JSON object per line, appended by every run of a run directory.

Every line has `t` (unix seconds), `run_id` (new per process) and `event`; ledger events
carry their own fields (group id, generation, attempt, version, ...). Lines are buffered
and flushed every few milliseconds by the controller, and at once for the events a
resume or an audit depends on (`FLUSH_NOW`), so a SIGKILL loses at most the last few
milliseconds of per-rollout events and never a step commit.

The trace is data: tests and `rollkeep trace` read it, nothing parses log text.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import IO, Any

import msgspec

from .core.events import Event

FLUSH_NOW = frozenset(
    {"run_started", "restored", "step_committed", "checkpoint_published", "dropped", "run_finished"}
)

_json = msgspec.json.Encoder()


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


class Trace:
    def __init__(self, path: Path, run_id: str | None = None) -> None:
        self.path = Path(path)
        self.run_id = run_id or new_run_id()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        if self._file.tell() > 0 and not _ends_with_newline(self.path):
            self._file.write(b"\n")  # a killed writer tore its last line: end it there
        self._prefix = b'{"t":%.6f,"run_id":"' + self.run_id.encode() + b'",'
        self._dirty = False

    def emit(self, event: str, **fields: Any) -> None:
        """A controller event (run_started, checkpoint_published, ...)."""
        body = _json.encode({"event": event, **fields})
        self._write(body, flush=event in FLUSH_NOW)

    def ledger_event(self, ev: Event) -> None:
        """Ledger sink: every ledger event becomes a line."""
        self._write(_json.encode(ev), flush=ev.__struct_config__.tag in FLUSH_NOW)  # type: ignore[attr-defined]

    def _write(self, body: bytes, *, flush: bool) -> None:
        # body is b'{...}': splice the common prefix in front of its fields.
        self._file.write(self._prefix % time.time() + body[1:] + b"\n")
        self._dirty = True
        if flush:
            self.flush()

    def flush(self) -> None:
        if self._dirty:
            self._file.flush()
            self._dirty = False

    def sync(self) -> None:
        self.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self.flush()
        self._file.close()


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def read_trace(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(complete lines, number of torn lines skipped). A line is torn only when a writer
    was killed mid-write: the last line of a live or killed run, or a line the next run
    terminated when it appended."""
    out, torn = [], 0
    for line in Path(path).read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            torn += 1
            continue
        if isinstance(obj, dict) and "event" in obj:
            out.append(obj)
        else:
            torn += 1
    return out, torn

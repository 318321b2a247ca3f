"""`trace.jsonl`: one JSON object per line, appended by every run of a run directory.

Every line has `t` (unix seconds), `run_id` (new per process) and `event`; ledger events
carry their own fields (group id, generation, attempt, version, ...). Lines are buffered
and flushed every few milliseconds by the controller, and at once for the events a
resume or an audit depends on (`FLUSH_NOW`), so a SIGKILL loses at most the last few
milliseconds of per-rollout events and never a step commit.

The trace is data: tests and `rollkeep trace` read it, nothing parses log text.
"""

from __future__ import annotations

import mmap
import os
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import msgspec

from .core.errors import FilesystemError
from .core.events import Event
from .core.trace_schema import FLUSH_NOW, RunEvent
from .core.untrusted import end_torn_line, loads_json, open_append, read_regular

__all__ = ["FLUSH_NOW", "Trace", "event_lines", "read_trace", "scan_trace"]

_json = msgspec.json.Encoder()


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


class Trace:
    def __init__(self, path: Path, run_id: str | None = None) -> None:
        self.path = Path(path)
        self.run_id = run_id or new_run_id()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file: IO[bytes] = open_append(self.path)  # closed by close()
            end_torn_line(self._file)
        except OSError as e:
            raise FilesystemError.of(e, "opening the trace", self.path) from None
        self._prefix = b'{"t":%.6f,"run_id":"' + self.run_id.encode() + b'",'
        self._dirty = False

    def emit(self, ev: RunEvent | Event) -> None:
        """One event of the schema (`rollkeep.core.trace_schema`) becomes a line. Also the
        ledger's sink: every ledger event is traced as it is applied."""
        self._write(_json.encode(ev), flush=ev.__struct_config__.tag in FLUSH_NOW)  # type: ignore[attr-defined]

    ledger_event = emit

    def _write(self, body: bytes, *, flush: bool) -> None:
        # body is b'{...}': splice the common prefix in front of its fields.
        try:
            self._file.write(self._prefix % time.time() + body[1:] + b"\n")
        except OSError as e:  # the buffer spilled to a full or read-only disk
            raise FilesystemError.of(e, "writing the trace", self.path) from None
        self._dirty = True
        if flush:
            self.flush()

    def flush(self) -> None:
        if self._dirty:
            try:
                self._file.flush()
            except OSError as e:
                raise FilesystemError.of(e, "writing the trace", self.path) from None
            self._dirty = False

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._file.close()


def read_trace(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(complete lines, number of unreadable lines skipped). A line is torn when a writer
    was killed mid-write (the last line of a live or killed run, or a line the next run
    terminated when it appended); a line that is not a JSON event object (damaged, or
    nested too deeply to parse) is skipped the same way and counted. Raises OSError if
    the path is not a readable regular file."""
    out, torn = [], 0
    for line in read_regular(path, follow_symlinks=True).split(b"\n"):
        if not line.strip():
            continue
        try:
            obj = loads_json(line, strict=False)
        except ValueError:
            torn += 1
            continue
        if isinstance(obj, dict) and "event" in obj:
            out.append(obj)
        else:
            torn += 1
    return out, torn


def scan_trace(path: Path, search: Callable[[mmap.mmap | None], Any]) -> Any:
    """`search(m)` over the trace's bytes, memory-mapped: for the few lines a start-up or
    an end-of-run summary needs, found by a byte search instead of parsing the whole
    trace. `m` is None for an empty file or one that is not regular (a FIFO is never waited
    on); None without a trace. Raises FilesystemError if it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise FilesystemError.of(e, "reading the trace", path) from None
    try:
        st = os.fstat(fd)
        if st.st_size == 0 or not stat.S_ISREG(st.st_mode):
            return search(None)
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m:
            return search(m)
    finally:
        os.close(fd)


def event_lines(m: mmap.mmap | None, event: str, *, reverse: bool = False) -> Iterator[tuple[int, dict[str, Any]]]:
    """(offset, line) of each readable line of `event` in a mapped trace, in file order
    or from the end; a torn or damaged line is passed over. (The tag's bytes cannot occur
    inside another line's string field: JSON escapes the quotes.)"""
    if m is None:
        return
    tag = b'"event":"%s"' % event.encode()
    at = m.rfind(tag) if reverse else m.find(tag)
    while at >= 0:
        start = m.rfind(b"\n", 0, at) + 1
        stop = m.find(b"\n", at)
        stop = len(m) if stop < 0 else stop
        try:
            obj = loads_json(m[start:stop], strict=False)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and obj.get("event") == event:
            yield start, obj
        at = m.rfind(tag, 0, start) if reverse else m.find(tag, stop)

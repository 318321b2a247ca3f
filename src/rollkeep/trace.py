"""`trace.jsonl`: one JSON object per line, appended by every run of a run directory.

Every line has `t` (unix seconds), `run_id` (new per process) and `event`; ledger events
carry their own fields (group id, generation, attempt, version, ...). Lines are buffered in
memory and handed to the OS every few milliseconds by the controller (`flush`), and at once
for the events a resume or an audit depends on (`FLUSH_NOW`), so a SIGKILL loses at most
the last few milliseconds of per-rollout events and never a step commit.

A power cut loses what was not fsynced, so durability has its own rule (docs/design.md §8):
**a checkpoint never covers a commit the durable trace lacks.** The cut flushes the trace,
and the checkpoint writer fsyncs it (`sync_flushed`) before the checkpoint is published;
after a power cut the trace holds every commit up to the restored checkpoint, and what
came after it may be lost or end in a torn line (those steps are redone).

The file is written through the filesystem seam (`rollkeep.core.io.fs`), so the simulation
runs this writer on its in-memory disk.

The trace is data: tests and `rollkeep trace` read it, nothing parses log text.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import msgspec

from .core.custody.events import EffectDone, Event
from .core.custody.trace_schema import CHECKPOINT_PUBLISHED, FLUSH_NOW, STEP_COMMITTED, RunEvent
from .core.errors import FilesystemError
from .core.io.fs import DEFAULT_FS, FILE, FS, AppendFile
from .core.io.untrusted import loads_json, read_regular

__all__ = ["FLUSH_NOW", "Trace", "event_lines", "last_committed_in_trace", "parse_trace", "read_trace", "scan_trace"]

_json = msgspec.json.Encoder()
_SPILL_LINES = 1024  # a writer that never flushes still hands its lines over in batches
_RAN_ON = frozenset({"sealed", "failed"})  # ledger events that carry the `replica` that ran them


class _EffectDoneLine(msgspec.Struct, tag_field="event", tag="effect_done"):
    """An `effect_done` event as the trace shows it: the size of its result, not the bytes
    (the journal keeps those; a trace is read by people and tools, and may be shared)."""

    group_id: str
    generation: int
    attempt: int
    key: str
    ok: bool
    bytes: int


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


class Trace:
    """The trace writer of one process (`run_id`), appending to `path` through the
    filesystem seam `fs`; `clock()` gives each line's `t` (a simulation passes its own).

    Threads: `emit`, `flush`, `sync` and `close` belong to the thread that emits (the
    runner's loop); `sync_flushed` may run on another thread meanwhile (the checkpoint
    writer's). Every OSError becomes a FilesystemError naming the trace.
    """

    def __init__(self, path: Path, run_id: str | None = None, *, fs: FS = DEFAULT_FS,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.run_id = run_id or new_run_id()
        self._fs, self._clock = fs, clock
        try:
            fs.makedirs(self.path.parent)
            self._file: AppendFile = fs.open_append(self.path)  # closed by close()
            if self._file.tail(1) not in (b"", b"\n"):  # an earlier writer was killed mid-line:
                self._file.write(b"\n")  # end it, so the next line starts on its own
        except OSError as e:
            raise FilesystemError.of(e, "opening the trace", self.path) from None
        self._run = b',"run_id":"' + self.run_id.encode() + b'",'
        self._lines: list[bytes] = []  # emitted, not flushed yet
        self._torn = False  # a failed write may have left part of a line in the file
        self._dir_synced = False
        # Called after every `flush` the run loop asks for (the journal: what it makes
        # durable is then never ahead of the trace, and ends between two whole transitions).
        # Not after the flushes the trace does by itself mid-transition (FLUSH_NOW, spills).
        self.on_flush: Callable[[], None] | None = None
        # Server mode: each server's URL (JSON-encoded), by replica index; `sealed` and
        # `failed` lines then name the server that ran the attempt (`server`).
        self.servers: tuple[bytes, ...] | None = None

    def emit(self, ev: RunEvent | Event) -> None:
        """One event of the schema (`rollkeep.core.custody.trace_schema`) becomes a line. Also the
        ledger's sink: every ledger event is traced as it is applied (the hot path: one
        encode and one join; msgspec writes `t` exactly, as the shortest repr)."""
        # The event encodes as b'{...}': splice the common fields in front of its own.
        run = self._run
        if isinstance(ev, EffectDone):
            ev = _EffectDoneLine(ev.group_id, ev.generation, ev.attempt, ev.key, ev.ok, len(ev.result))
        if self.servers is not None and ev.__struct_config__.tag in _RAN_ON:  # type: ignore[attr-defined]
            run = self._run + b'"server":' + self.servers[ev.replica] + b","  # type: ignore[union-attr]
        self._lines.append(b"".join((b'{"t":', _json.encode(self._clock()), run, _json.encode(ev)[1:], b"\n")))
        if ev.__struct_config__.tag in FLUSH_NOW or len(self._lines) >= _SPILL_LINES:  # type: ignore[attr-defined]
            self._write_lines()

    ledger_event = emit

    def flush(self) -> None:
        """Hand the buffered lines to the OS: a killed process loses none of them after
        this (a power cut may: `sync`). Then `on_flush`."""
        self._write_lines()
        if self.on_flush is not None:
            self.on_flush()

    def _write_lines(self) -> None:
        if not self._lines:
            return
        data = b"".join(self._lines)
        self._lines.clear()
        try:
            self._file.write(b"\n" + data if self._torn else data)
        except OSError as e:
            # The run stops (exit 5) and these lines are given up, a prefix of them perhaps
            # written: a later flush (the failure's own line) starts on a line of its own.
            self._torn = True
            raise FilesystemError.of(e, "writing the trace", self.path) from None
        self._torn = False

    def sync(self) -> None:
        """Make every line emitted so far durable: `flush`, then `sync_flushed`."""
        self.flush()
        self.sync_flushed()

    def sync_flushed(self) -> None:
        """Make every line flushed so far durable (fsync), and the file's name with it the
        first time (fsync of its directory: a file created since the last power cut is
        not durable until its directory entry is).

        Safe on another thread than `emit` and `flush`: it reads neither the line buffer
        nor `_torn`, only the open file, which `__init__` set and only `close` changes, and
        fsync covers every write that returned before it. The checkpoint writer relies on
        this: the cut flushed its lines on the loop thread before the writer thread started,
        and whatever the loop flushes meanwhile may or may not be covered, which is fine."""
        try:
            self._file.fsync()
            if not self._dir_synced:
                self._fs.fsync(self.path.parent)
                self._dir_synced = True
        except OSError as e:
            raise FilesystemError.of(e, "syncing the trace", self.path) from None

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._file.close()


def read_trace(path: Path, *, fs: FS | None = None,
               events: Collection[str] | None = None) -> tuple[list[dict[str, Any]], int]:
    """`parse_trace` of the file at `path`. Raises OSError if the path is not a readable
    regular file (a symlink to one is followed). `fs` reads through that filesystem seam
    instead of the real disk."""
    data = read_regular(path, follow_symlinks=True) if fs is None else fs.read(path)
    return parse_trace(data, events=events)


def parse_trace(data: bytes, *, events: Collection[str] | None = None) -> tuple[list[dict[str, Any]], int]:
    """(complete lines, number of unreadable lines skipped). A line is torn when a writer
    was killed mid-write (the last line of a live or killed run, or a line the next run
    terminated when it appended) or the machine lost power before it was fsynced; a line
    that is not a JSON event object (damaged, or nested too deeply to parse) is skipped the
    same way and counted. With `events`, only the lines of those events are parsed (a
    byte search picks them) and counted."""
    wanted = None
    if events is not None:
        alternatives = b"|".join(re.escape(e.encode()) for e in events)
        wanted = re.compile(rb'"event"\s*:\s*"(?:' + alternatives + rb')"').search
    out, torn = [], 0
    for line in data.split(b"\n"):
        if not line.strip() or (wanted is not None and wanted(line) is None):
            continue
        try:
            obj = loads_json(line, strict=False)
        except ValueError:
            torn += 1
            continue
        if not isinstance(obj, dict) or "event" not in obj:
            torn += 1
        elif events is None or obj["event"] in events:
            out.append(obj)
    return out, torn


def scan_trace(path: Path, search: Callable[[mmap.mmap | bytes | None], Any], *, fs: FS | None = None) -> Any:
    """`search(m)` over the trace's bytes, memory-mapped: for the few lines a start-up or
    an end-of-run summary needs, found by a byte search instead of parsing the whole
    trace. `m` is None for an empty file or one that is not regular (a FIFO is never waited
    on); None without a trace. Raises FilesystemError if it cannot be opened. `fs` reads
    through that filesystem seam instead (the simulation's disk: `m` is then its bytes)."""
    if fs is not None:
        kind = fs.kind_of(path)
        if kind is None:
            return None
        try:
            data = fs.read(path) if kind == FILE else b""
        except OSError as e:
            raise FilesystemError.of(e, "reading the trace", path) from None
        return search(data or None)
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


def event_lines(m: mmap.mmap | bytes | None, event: str, *, reverse: bool = False) -> Iterator[tuple[int, dict[str, Any]]]:
    """(offset, line) of each readable line of `event` in a mapped (or read) trace, in file order
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


def last_committed_in_trace(trace_path: Path) -> int | None:
    """The step of the trace's last readable `step_committed` line (None if it has none):
    the newest step an earlier process trained. Searched backwards from the end, so a long
    trace costs the bytes after its last commit, not its size."""
    return scan_trace(trace_path, lambda m: next(
        (line["step"] for _, line in event_lines(m, STEP_COMMITTED, reverse=True)
         if type(line.get("step")) is int), None))


_PUBLISHED = b'"event":"%s"' % CHECKPOINT_PUBLISHED.encode()


def published_in_trace(trace_path: Path, *, fs: FS | None = None) -> int | None:
    """How many `checkpoint_published` lines the trace holds (None without a trace): what
    `start.start_point` asks when LATEST is missing. A byte search, not a parse: only a run
    directory without LATEST pays for it. `fs`: read through that filesystem seam (the
    simulation's disk) instead of the real one."""

    def count(m: mmap.mmap | bytes | None) -> int:
        n, at = 0, -1 if m is None else m.find(_PUBLISHED)
        while at >= 0:
            n += 1
            at = m.find(_PUBLISHED, at + 1)
        return n

    return scan_trace(trace_path, count, fs=fs)

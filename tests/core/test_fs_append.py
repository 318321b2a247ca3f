"""The filesystem seam's append handle on the real disk, and the trace writer on it: a FIFO
or a planted symlink is refused at once (never waited on, never written through), a torn
last line of a killed writer is ended before new lines go in, lines are buffered until a
flush, and a failed write neither hides the error nor glues the next line to a torn one."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from rollkeep.core.custody.events import Sealed, StepCommitted
from rollkeep.core.errors import FilesystemError
from rollkeep.core.io.fs import DEFAULT_FS, DIR
from rollkeep.simulate.memfs import MemFS
from rollkeep.trace import Trace, parse_trace, read_trace


def sealed(i: int = 0) -> Sealed:
    return Sealed(group_id=f"e0.{i}", generation=0, attempt=0, version=0, tokens=3)


def committed(step: int) -> StepCommitted:
    return StepCommitted(step=step, weight_version=step, group_ids=(f"e0.{step}",), prompts=((0, step),))


def test_open_append_refuses_a_fifo_at_once(tmp_path, no_hang):
    os.mkfifo(tmp_path / "trace.jsonl")
    with pytest.raises(OSError, match="FIFO"):
        DEFAULT_FS.open_append(tmp_path / "trace.jsonl")
    with pytest.raises(FilesystemError, match="opening the trace") as e:
        Trace(tmp_path / "trace.jsonl")
    assert "FIFO" in str(e.value)


def test_open_append_refuses_a_symlink_and_never_writes_through_it(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep\n")
    (tmp_path / "trace.jsonl").symlink_to(target)
    with pytest.raises(OSError) as e:
        DEFAULT_FS.open_append(tmp_path / "trace.jsonl")
    assert e.value.errno == errno.ELOOP and "symlink" in str(e.value)
    with pytest.raises(FilesystemError, match="opening the trace"):
        Trace(tmp_path / "trace.jsonl")
    assert target.read_bytes() == b"keep\n"


def test_an_append_file_appends_tails_fsyncs_and_closes_once(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(b"abc")
    f = DEFAULT_FS.open_append(path)
    assert f.tail(2) == b"bc" and f.tail(10) == b"abc" and f.tail(0) == b""
    f.write(b"def")
    f.fsync()
    assert path.read_bytes() == b"abcdef" and f.tail(1) == b"f"
    f.close()
    f.close()  # a second close is nothing
    with pytest.raises(OSError) as e:
        f.write(b"x")  # a closed handle fails, never writes to whatever reused its number
    assert e.value.errno == errno.EBADF
    assert path.read_bytes() == b"abcdef"


def test_makedirs_creates_missing_parents_and_accepts_what_exists(tmp_path):
    DEFAULT_FS.makedirs(tmp_path / "a" / "b")
    DEFAULT_FS.makedirs(tmp_path / "a" / "b")
    assert DEFAULT_FS.kind_of(tmp_path / "a" / "b") == DIR
    Trace(tmp_path / "x" / "y" / "trace.jsonl").close()  # the trace makes its directory
    assert (tmp_path / "x" / "y" / "trace.jsonl").read_bytes() == b""


def test_a_torn_last_line_is_ended_before_new_lines_are_appended(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b'{"t":1.0,"run_id":"a","event":"step_committed","step":1,"weight_version":1,'
                     b'"prompts":[[0,1]]}\n{"t":2.0,"run_id":"a","event":"sea')  # killed mid-line
    trace = Trace(path, "b")
    trace.emit(committed(2))
    trace.close()
    lines, torn = read_trace(path)
    assert torn == 1 and [(x["run_id"], x["step"]) for x in lines] == [("a", 1), ("b", 2)]
    assert path.read_bytes().count(b"\n") == 3  # every line ends, the torn one included


def test_lines_are_buffered_until_a_flush_and_flush_now_events_go_at_once(tmp_path):
    path = tmp_path / "trace.jsonl"
    trace = Trace(path, "r", clock=lambda: 0.1 + 0.2)
    trace.emit(sealed())
    assert path.read_bytes() == b""  # buffered
    trace.emit(committed(1))  # a FLUSH_NOW event: the buffer goes with it
    lines, _ = read_trace(path)
    assert [x["event"] for x in lines] == ["sealed", "step_committed"]
    assert lines[0]["t"] == 0.1 + 0.2 and lines[0]["run_id"] == "r"  # `t` is the clock's, exactly
    trace.emit(sealed(1))
    trace.close()  # closing flushes
    assert [x["event"] for x in read_trace(path)[0]] == ["sealed", "step_committed", "sealed"]


def test_a_failed_trace_write_is_a_filesystem_error_and_the_next_line_starts_on_its_own():
    fs = MemFS(random.Random(3), fault_rate=1.0, max_faults=1)  # the first write fails
    fs.makedirs_durable(Path("/r"))
    # A fixed clock: what the fault leaves (a torn prefix, or the whole line with an error)
    # is a function of the line's length, and `time.time()`'s repr is not always as long.
    trace = Trace(Path("/r/trace.jsonl"), "r", fs=fs, clock=lambda: 1700000000.25)
    with pytest.raises(FilesystemError, match="writing the trace") as e:
        trace.emit(committed(1))
    assert "No space left" in str(e.value) or "errno 28" in str(e.value)
    trace.emit(committed(2))  # the disk has room again
    lines, torn = read_trace(Path("/r/trace.jsonl"), fs=fs)
    assert [x["step"] for x in lines] == [2] and torn <= 1


def test_parse_trace_with_events_reads_only_those_lines():
    data = (b'{"t":1,"run_id":"a","event":"sealed"}\n{"t":2,"run_id":"a","event":"step_committed","step":1}\n'
            b'{"t": 3, "run_id": "a", "event": "dropped"}\n{"t":4,"run_id":"a","event":"step_committed","st')
    lines, torn = parse_trace(data, events={"step_committed", "dropped"})
    assert [x["t"] for x in lines] == [2, 3] and torn == 1  # the torn step_committed is counted
    assert len(parse_trace(data)[0]) == 3

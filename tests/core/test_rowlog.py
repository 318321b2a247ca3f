"""Durable row segments: rows round-trip by location, segments rotate and are never appended
to again, every kind of damage is refused naming the file and offset (never a wrong row),
retention keeps what checkpoints and the open writer need, and on the simulated disk every
row whose flush returned survives a power cut, wherever the crash falls."""

from __future__ import annotations

import errno
import os
import random
import shutil
import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkeep.core.errors import CheckpointError, RowsMismatch
from rollkeep.core.rollout.rows import Row, RowId
from rollkeep.core.rowlog.segments import (
    RowLocation,
    RowLogReader,
    RowSegmentCorrupt,
    _encode,
    _frame,
    _header_frame,
    _RowWire,
    delete_unreferenced,
    segment_path,
    segments,
    verify_segment,
)
from rollkeep.core.rowlog.writer import RowLogWriter
from rollkeep.simulate.memfs import MemFS, SimCrash

RUN = Path("/run")


def row(prompt=3, completion=2, *, reward=1.0, finish="stop", seed=0) -> Row:
    rng = np.random.default_rng(seed)
    return Row(
        rng.integers(0, 50_000, prompt, dtype=np.int32),
        rng.integers(0, 50_000, completion, dtype=np.int32),
        rng.standard_normal(completion).astype(np.float32),
        rng.integers(0, 7, completion, dtype=np.int32),
        reward,
        finish,
    )


def written(directory: Path, rows: list[tuple[RowId, Row]], **kw) -> list[RowLocation]:
    w = RowLogWriter(directory, **kw)
    locs = [w.append(rid, r) for rid, r in rows]
    w.close()
    return locs


def refused(directory: Path, rid: RowId, loc: RowLocation) -> RowSegmentCorrupt:
    with pytest.raises(RowSegmentCorrupt) as info:
        RowLogReader(directory).read(rid, loc)
    return info.value


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


# -- round trip, locations, rotation -----------------------------------------------------


SHAPES = [
    row(0, 0),
    row(5, 0, finish="length"),
    row(1, 1, reward=-0.0),
    row(7, 64, reward=float("nan")),
    row(3000, 20_000, reward=1e300, seed=3),
]


def test_round_trip_rows_of_every_shape(tmp_path):
    ids = [RowId(f"e0.{i}", i, 2**31 - 1 - i) for i in range(len(SHAPES))]
    locs = written(tmp_path / "rows", list(zip(ids, SHAPES, strict=True)))
    reader = RowLogReader(tmp_path / "rows")
    for rid, r, loc in zip(ids, SHAPES, locs, strict=True):
        back = reader.read(rid, loc)
        assert back.equal(r) and back.tokens == r.tokens
        assert not back.completion_ids.flags.writeable and back.prompt_ids.dtype == np.int32


def test_locations_are_contiguous_frames_after_the_header(tmp_path):
    locs = written(tmp_path / "rows", [(RowId("g", i, 0), row(seed=i)) for i in range(4)])
    assert {loc.segment for loc in locs} == {0}
    assert locs[0].offset == len(_header_frame(0))
    for a, b in zip(locs, locs[1:], strict=False):
        assert b.offset == a.offset + a.length
    assert segments(tmp_path / "rows") == [(0, locs[-1].offset + locs[-1].length)]


def test_rotation_at_segment_bytes_and_an_oversized_row_goes_alone(tmp_path):
    rows = [(RowId("g", i, 0), row(4, 40 if i != 5 else 400, seed=i)) for i in range(12)]
    locs = written(tmp_path / "rows", rows, segment_bytes=1200)
    sizes = dict(segments(tmp_path / "rows"))
    assert len(sizes) >= 3 and all(sizes[n] <= 1200 for n in sizes if n != locs[5].segment)
    assert [loc.segment for loc in locs] == sorted(loc.segment for loc in locs)
    alone = [loc for loc in locs if loc.segment == locs[5].segment]
    assert alone == [locs[5]] and sizes[locs[5].segment] > 1200
    reader = RowLogReader(tmp_path / "rows")
    assert all(reader.read(rid, loc).equal(r) for (rid, r), loc in zip(rows, locs, strict=True))
    for n in sizes:
        check = verify_segment(tmp_path / "rows", n)
        assert check.torn_bytes == 0 and check.size == sizes[n]
    assert sum(verify_segment(tmp_path / "rows", n).rows for n in sizes) == 12


def test_reopen_starts_a_new_segment_and_never_appends_to_an_old_one(tmp_path):
    d = tmp_path / "rows"
    first = written(d, [(RowId("a", 0, 0), row())])
    before = segment_path(d, 0).read_bytes()
    RowLogWriter(d).close()  # seals nothing: creates no segment
    assert [n for n, _ in segments(d)] == [0]
    second = written(d, [(RowId("b", 0, 0), row(seed=1))])
    assert (first[0].segment, second[0].segment) == (0, 1)
    assert segment_path(d, 0).read_bytes() == before
    (d / "00000007.rows").write_bytes(b"junk a crashed writer left")
    assert written(d, [(RowId("c", 0, 0), row())])[0].segment == 8


def test_a_writer_refuses_a_segment_that_appeared_under_its_number(tmp_path):
    d = tmp_path / "rows"
    w = RowLogWriter(d)
    w.append(RowId("g", 0, 0), row())
    segment_path(d, 0).write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        w.flush()
    with pytest.raises(OSError, match="unusable"):
        w.append(RowId("g", 1, 0), row())
    assert segment_path(d, 0).read_bytes() == b"someone else's"


def test_append_and_flush_from_two_threads(tmp_path):
    w = RowLogWriter(tmp_path / "rows", segment_bytes=4096)
    done = threading.Event()
    errors: list[BaseException] = []

    def flusher():
        try:
            while not done.is_set():
                w.flush()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=flusher)
    t.start()
    rows = [(RowId("g", i, 0), row(2, i % 9, seed=i)) for i in range(2000)]
    locs = [w.append(rid, r) for rid, r in rows]
    done.set()
    t.join()
    w.close()
    assert not errors
    reader = RowLogReader(tmp_path / "rows")
    assert all(reader.read(rid, loc).equal(r) for (rid, r), loc in zip(rows, locs, strict=True))


def test_append_does_no_io_and_rejects_bad_input():
    fs = MemFS(random.Random(0))
    fs.makedirs_durable(RUN)
    w = RowLogWriter(RUN / "rows", fs=fs)
    fs.freeze(SimCrash("dead"))  # any filesystem call now raises
    loc = w.append(RowId("g", 0, 0), row())
    assert loc.segment == 0
    with pytest.raises(ValueError, match="row id"):
        w.append(("g", -1, 0), row())
    with pytest.raises(ValueError, match="needs a Row"):
        w.append(RowId("g", 1, 0), "not a row")
    with pytest.raises(SimCrash):
        w.flush()


def test_row_location_is_a_compact_strict_msgpack_array():
    loc = RowLocation(3, 30, 95, 2**64 - 1)
    raw = msgspec.msgpack.encode(loc)
    assert len(raw) == 13 and msgspec.msgpack.decode(raw, type=RowLocation) == loc
    for bad in ([3, 30, 95, -1], [3, -1, 95, 1], [3, 30, 11, 1], [3, 30, 95, 1, 0], [3, 30, 95]):
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=RowLocation)


# -- refusals ---------------------------------------------------------------------------


@pytest.fixture
def two_rows(tmp_path):
    d = tmp_path / "rows"
    ids = [RowId("g", 0, 0), RowId("g", 1, 0)]
    locs = written(d, [(ids[0], row(seed=1)), (ids[1], row(seed=2))])
    return d, ids, locs


@pytest.mark.parametrize("where", ["length", "checksum", "payload", "last byte"])
def test_a_flipped_byte_is_refused_with_file_and_offset(two_rows, where):
    d, ids, locs = two_rows
    loc = locs[0]
    at = {"length": 0, "checksum": 5, "payload": 20, "last byte": loc.length - 1}[where]
    flip(segment_path(d, 0), loc.offset + at)
    err = refused(d, ids[0], loc)
    assert isinstance(err, RowsMismatch) and isinstance(err, CheckpointError)
    assert err.path == str(segment_path(d, 0)) and err.offset == loc.offset and err.segment == 0
    assert f"offset {loc.offset}" in str(err) and "What to do" in str(err)
    assert RowLogReader(d).read(ids[1], locs[1]).equal(row(seed=2))  # its neighbour is fine
    with pytest.raises(RowSegmentCorrupt, match=f"corrupt at offset {loc.offset}") as info:
        verify_segment(d, 0)  # a valid frame follows: corruption, not a torn tail
    assert info.value.offset == loc.offset


def test_a_flipped_byte_in_the_header_is_refused(two_rows):
    d, ids, locs = two_rows
    flip(segment_path(d, 0), 14)
    with pytest.raises(RowSegmentCorrupt, match="no valid header") as info:
        RowLogReader(d).read(ids[0], locs[0])
    assert info.value.offset == 0
    with pytest.raises(RowSegmentCorrupt, match="corrupt at offset 0"):
        verify_segment(d, 0)


def test_another_row_at_the_location_is_refused(two_rows):
    d, ids, locs = two_rows
    err = refused(d, ids[1], locs[0])
    assert "holds another row" in str(err) and str(tuple(ids[0])) in err.found
    err = refused(d, ids[0], RowLocation(0, locs[1].offset, locs[1].length, locs[0].checksum))
    assert "not the one recorded" in str(err)
    err = refused(d, ids[0], RowLocation(0, locs[0].offset, locs[0].length + 1, locs[0].checksum))
    assert "wrong length" in str(err)
    err = refused(d, ids[0], RowLocation(0, locs[0].offset + 1, locs[0].length, locs[0].checksum))
    assert err.offset == locs[0].offset + 1


def test_a_renamed_segment_is_refused(two_rows):
    d, ids, locs = two_rows
    shutil.copy(segment_path(d, 0), segment_path(d, 4))
    err = refused(d, ids[0], RowLocation(4, *list(msgspec.structs.astuple(locs[0]))[1:]))
    assert "naming segment 0" in err.found
    with pytest.raises(RowSegmentCorrupt, match="naming segment 0"):
        verify_segment(d, 4)


def test_missing_and_truncated_segments_are_refused(two_rows):
    d, ids, locs = two_rows
    err = refused(d, ids[0], RowLocation(9, *list(msgspec.structs.astuple(locs[0]))[1:]))
    assert "missing" in str(err) and err.path == str(segment_path(d, 9))
    data = segment_path(d, 0).read_bytes()
    segment_path(d, 0).write_bytes(data[:-3])
    err = refused(d, ids[1], locs[1])
    assert "cut short" in str(err) and f"ends at byte {len(data) - 3}" in err.found
    assert RowLogReader(d).read(ids[0], locs[0]).equal(row(seed=1))


def test_a_fifo_or_symlink_in_place_of_a_segment_is_refused_at_once(two_rows, no_hang):
    d, ids, locs = two_rows
    os.rename(segment_path(d, 0), d / "elsewhere")
    os.mkfifo(segment_path(d, 0))
    assert "not a regular file" in str(refused(d, ids[0], locs[0]))
    with pytest.raises(RowSegmentCorrupt, match="not a regular file"):
        segments(d)
    with pytest.raises(RowSegmentCorrupt, match="not a regular file"):
        verify_segment(d, 0)
    os.unlink(segment_path(d, 0))
    segment_path(d, 0).symlink_to(d / "elsewhere")
    err = refused(d, ids[0], locs[0])
    assert "not a regular file" in str(err) and "symlink" in err.found
    with pytest.raises(RowSegmentCorrupt, match="not a regular file"):
        segments(d)


def crafted(d: Path, wire: list) -> tuple[RowId, RowLocation]:
    """A segment 0 whose one row frame is `wire`, checksummed correctly."""
    header = _header_frame(0)
    frame, checksum = _frame(msgspec.msgpack.encode(wire))
    d.mkdir(exist_ok=True)
    segment_path(d, 0).write_bytes(header + frame)
    return RowId("g", 0, 0), RowLocation(0, len(header), len(frame), checksum)


I4 = np.arange(3, dtype="<i4").tobytes()
F4 = np.zeros(3, dtype="<f4").tobytes()
GOOD = ["g", 0, 0, 1.0, "stop", I4, I4, F4, I4]


@pytest.mark.parametrize(
    "change, message",
    [
        ({0: ""}, "group_id: Expected `str` of length >= 1"),
        ({1: -1}, ">= 0"),
        ({2: 2**31}, "attempt: Expected `int` <= 2147483647"),
        ({3: "1.0"}, "Expected `float`"),
        ({4: "eos"}, "finish_reason: Invalid enum value 'eos'"),
        ({5: [1, 2]}, "Expected `bytes`"),
        ({6: I4[:-1]}, "not a multiple of 4"),
        ({7: F4[:-4]}, "logprobs has length 2"),
        ({8: np.array([0, -2, 0], "<i4").tobytes()}, "versions must be >= 0 (or -1"),
        ({5: np.array([-5], "<i4").tobytes()}, "prompt_ids must be non-negative"),
        ({9: b"extra"}, "at most length 9"),
    ],
)
def test_a_checksummed_but_malformed_frame_is_refused(tmp_path, change, message):
    wire = list(GOOD)
    for i, v in change.items():
        wire[i : i + 1] = [v]
    rid, loc = crafted(tmp_path / "rows", wire)
    err = refused(tmp_path / "rows", rid, loc)
    assert "does not decode" in str(err) and message in err.found
    with pytest.raises(RowSegmentCorrupt, match="a well-formed row frame"):
        verify_segment(tmp_path / "rows", 0)


def test_the_crafted_good_frame_reads_back(tmp_path):
    rid, loc = crafted(tmp_path / "rows", GOOD)
    assert RowLogReader(tmp_path / "rows").read(rid, loc).tokens == 3
    assert _encode(_RowWire(*GOOD)) == msgspec.msgpack.encode(GOOD)


# -- audit and retention ----------------------------------------------------------------


def test_verify_segment_reports_a_torn_tail_not_corruption(two_rows):
    d, _, locs = two_rows
    data = segment_path(d, 0).read_bytes()
    for cut in (locs[1].offset + 1, locs[1].offset + 15, len(data) - 1):
        segment_path(d, 0).write_bytes(data[:cut])
        check = verify_segment(d, 0)
        assert (check.rows, check.valid_end, check.torn_bytes) == (1, locs[1].offset, cut - locs[1].offset)
    segment_path(d, 0).write_bytes(data[:7])  # torn inside the header
    assert verify_segment(d, 0).rows == 0
    segment_path(d, 0).write_bytes(data + b"\0" * 40)  # a power cut's zeroed tail
    assert verify_segment(d, 0).torn_bytes == 40


def test_retention_keeps_referenced_and_open_segments(tmp_path):
    d = tmp_path / "rows"
    for i in range(5):
        written(d, [(RowId("g", i, 0), row())])
    w = RowLogWriter(d)  # will write segment 5
    w.append(RowId("g", 5, 0), row())
    w.flush()
    assert delete_unreferenced(d, {1, 3}, keep_from=4) == [0, 2]
    assert [n for n, _ in segments(d)] == [1, 3, 4, 5]
    assert delete_unreferenced(d, {1, 3}, keep_from=4) == []
    assert delete_unreferenced(d, set(), keep_from=w.segment) == [1, 3, 4]
    assert [n for n, _ in segments(d)] == [5]
    w.close()


# -- the simulated disk: kills and power cuts --------------------------------------------


class CrashAt(MemFS):
    """MemFS whose process dies at the `at`-th filesystem call (None: never)."""

    def __init__(self, seed: int, at: int | None = None) -> None:
        super().__init__(random.Random(seed))
        self.calls, self.at = 0, at

    def _alive(self) -> None:
        self.calls += 1
        if self.at is not None and self.calls == self.at and self.frozen is None:
            self.freeze(SimCrash(f"killed at call {self.at}"))
        super()._alive()


def fresh(seed: int = 0) -> CrashAt:
    fs = CrashAt(seed)
    fs.makedirs_durable(RUN)
    return fs


def test_a_crash_at_every_call_of_a_flush_then_a_power_cut_keeps_the_flushed_rows():
    """The second flush (which also rotates) is killed at each of its filesystem calls in
    turn: the first flush's rows always read back; the second's read back or are refused."""
    k = 1
    while True:
        fs = fresh(k)
        w = RowLogWriter(RUN / "rows", fs=fs, segment_bytes=600)
        durable = [(RowId("d", i, 0), row(2, 10, seed=i)) for i in range(4)]
        locs = [w.append(rid, r) for rid, r in durable]
        w.flush()
        tail = [(RowId("t", i, 0), row(2, 10, seed=i)) for i in range(8)]
        tail_locs = [w.append(rid, r) for rid, r in tail]
        assert len({loc.segment for loc in tail_locs}) > 1
        fs.at = fs.calls + k
        try:
            w.flush()
            finished = True
        except SimCrash:
            finished = False
        fs.at = None
        fs.power_cut()
        reader = RowLogReader(RUN / "rows", fs=fs)
        assert all(reader.read(rid, loc).equal(r) for (rid, r), loc in zip(durable, locs, strict=True))
        for (rid, r), loc in zip(tail, tail_locs, strict=True):
            try:
                assert reader.read(rid, loc).equal(r)  # survived whole: the right row
            except RowSegmentCorrupt as e:
                assert not finished and e.segment == loc.segment  # torn or lost: refused
        for n, _ in segments(RUN / "rows", fs=fs):
            verify_segment(RUN / "rows", n, fs=fs)  # torn at worst, never corrupt
        if finished:
            break
        k += 1
    assert k > 5  # write, fsync, create, write, fsync, fsync(dir): every point was hit


def test_a_failed_flush_leaves_the_writer_unusable_and_earlier_rows_durable():
    for seed in range(10):
        fs = fresh(seed)
        w = RowLogWriter(RUN / "rows", fs=fs)
        loc = w.append(RowId("a", 0, 0), row())
        w.flush()
        w.append(RowId("b", 0, 0), row(seed=1))
        fs.fault_rate, fs.faults_left = 1.0, 1
        with pytest.raises(OSError) as info:
            w.flush()
        assert info.value.errno in (errno.ENOSPC, errno.EIO)
        with pytest.raises(OSError, match="unusable after an earlier failure"):
            w.flush()
        with pytest.raises(OSError, match="unusable after an earlier failure"):
            w.append(RowId("c", 0, 0), row())
        w.close()
        fs.power_cut()
        assert RowLogReader(RUN / "rows", fs=fs).read(RowId("a", 0, 0), loc).equal(row())
        assert RowLogWriter(RUN / "rows", fs=fs).segment == 1


ROWS = st.builds(
    lambda p, c, seed, reward, finish: row(p, c, reward=reward, finish=finish, seed=seed),
    st.integers(0, 6),
    st.integers(0, 40),
    st.integers(0, 2**16),
    st.floats(allow_nan=True, width=64),
    st.sampled_from(["stop", "length"]),
)
OPS = st.lists(st.one_of(ROWS, st.just("flush")), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(
    runs=st.lists(OPS, min_size=1, max_size=3),
    segment_bytes=st.integers(100, 3000),
    crash_at=st.none() | st.integers(1, 120),
    seed=st.integers(0, 2**16),
)
def test_power_cut_anywhere_keeps_every_row_whose_flush_returned(runs, segment_bytes, crash_at, seed):
    """Several runs (each a writer of its own, killed at its end); the last is cut at a
    random filesystem call, then the power goes. Every row whose flush returned reads back
    equal; every other row reads back equal or is refused; no segment is corrupt."""
    fs = fresh(seed)
    durable: list[tuple[RowId, Row, RowLocation]] = []
    maybe: list[tuple[RowId, Row, RowLocation]] = []
    gen = 0
    for i, ops in enumerate(runs):
        if i == len(runs) - 1 and crash_at is not None:
            fs.at = fs.calls + crash_at
        pending: list[tuple[RowId, Row, RowLocation]] = []
        try:
            w = RowLogWriter(RUN / "rows", fs=fs, segment_bytes=segment_bytes)
            for op in ops:
                if op == "flush":
                    w.flush()
                    durable += pending
                    pending = []
                else:
                    rid = RowId(f"r{i}", gen, 0)
                    gen += 1
                    pending.append((rid, op, w.append(rid, op)))
        except SimCrash:
            pass
        maybe += pending
        fs.kill()  # the run's process dies; the page cache lives on
    fs.at = None
    fs.power_cut()
    reader = RowLogReader(RUN / "rows", fs=fs)
    for rid, r, loc in durable:
        assert reader.read(rid, loc).equal(r)
    for rid, r, loc in maybe:
        try:
            assert reader.read(rid, loc).equal(r)
        except RowSegmentCorrupt:
            pass
    for n, size in segments(RUN / "rows", fs=fs):
        assert verify_segment(RUN / "rows", n, fs=fs).size == size

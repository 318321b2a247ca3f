"""The custody journal's format, writer and reader: records come back in order across
rotations and reopened writers, a torn tail (cut at any byte) ends the journal and loses
only what was never flushed, damage before the tail and every broken link of the chain is
refused with the file and the offset, and a crash (SIGKILL, power cut, failing IO) keeps
exactly the completed flushes."""

from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkeep.core.errors import CheckpointError, CustodyError
from rollkeep.core.io.fs import DEFAULT_FS
from rollkeep.core.journal.segments import (
    FRAME_OVERHEAD,
    HEADER_SIZE,
    MAX_RECORD_BYTES,
    JournalError,
    JournalReader,
    JournalWriter,
    delete_covered,
    encode_frame,
    encode_header,
    read_journal,
    segment_name,
)
from rollkeep.simulate.memfs import MemFS

J = Path("/run/journal")


def memfs(seed: int = 0) -> MemFS:
    fs = MemFS(random.Random(seed))
    fs.makedirs_durable(Path("/run"))
    return fs


def payload(i: int) -> bytes:
    return f"event-{i}".encode() * (i % 4)  # some empty


def write(fs, payloads, *, next_seq=1, segment_bytes=1 << 20, directory=J) -> JournalWriter:
    w = JournalWriter(directory, next_seq, fs=fs, segment_bytes=segment_bytes)
    for p in payloads:
        w.append(p)
    w.flush()
    return w


def segments(fs, directory=J) -> list[str]:
    return [name for name, _ in fs.listdir(directory)]


def records(fs, after=0, directory=J):
    return read_journal(directory, after=after, fs=fs).records


def replace(fs, path: Path, data: bytes) -> None:
    """Put `data` at `path` durably, through the seam (MemFS has no truncate)."""
    fs.unlink(path)
    fs.write(path, data)
    fs.fsync(path)
    fs.fsync(path.parent)


# -- round trip, rotation, reopening -------------------------------------------------------


def test_round_trip_gives_every_record_in_order_with_a_summary():
    fs = memfs()
    w = JournalWriter(J, 1, fs=fs)
    assert [w.append(payload(i)) for i in range(1, 6)] == [1, 2, 3, 4, 5]
    assert w.durable_seq == 0 and fs.kind_of(J / segment_name(1)) is None  # append does no IO
    assert w.flush() == 5 and w.durable_seq == 5
    assert w.flush() == 5  # nothing buffered: no IO, same answer
    w.close()
    w.close()
    tail = read_journal(J, after=0, fs=fs)
    assert tail.records == [(i, payload(i)) for i in range(1, 6)]
    s = tail.summary
    assert (s.records, s.last_seq, s.segments_read, s.torn_tail, s.complete) == (5, 5, 1, False, True)
    assert s.bytes_read == HEADER_SIZE + sum(FRAME_OVERHEAD + len(payload(i)) for i in range(1, 6))
    assert records(fs, after=3) == [(4, payload(4)), (5, payload(5))]
    assert read_journal(J, after=5, fs=fs).summary.last_seq == 5


def test_an_absent_or_empty_journal_is_an_empty_tail_only_after_nothing():
    fs = memfs()
    assert read_journal(J, after=0, fs=fs).summary.last_seq == 0
    JournalWriter(J, 1, fs=fs).close()  # no record: no segment
    assert segments(fs) == [] and records(fs) == []
    assert read_journal(J, after=0, fs=fs).summary.complete


def test_d6_an_emptied_journal_under_a_checkpoint_position_is_refused():
    """Every segment deleted (the directory kept): the checkpoint's position names records
    that are gone, and retention never deletes the newest segment, so it is damage."""
    fs = memfs()
    write(fs, [b"a", b"b", b"c"])
    for name in segments(fs):
        fs.unlink(J / name)
    with pytest.raises(JournalError, match="holds no segment, but the checkpoint counts on its records"):
        read_journal(J, after=2, fs=fs)


def test_rotation_starts_a_segment_when_the_next_frame_would_overflow():
    fs = memfs()
    frame = FRAME_OVERHEAD + 10
    w = write(fs, [b"x" * 10] * 7, segment_bytes=HEADER_SIZE + 3 * frame)
    w.append(b"y" * 500)  # larger than a segment: a segment of its own
    w.append(b"z")
    w.flush()
    assert segments(fs) == [segment_name(s) for s in (1, 4, 7, 8, 9)]
    assert [len(fs.read(J / n)) for n in segments(fs)[:2]] == [HEADER_SIZE + 3 * frame] * 2
    assert [s for s, _ in records(fs)] == list(range(1, 10))


def test_a_reopened_writer_starts_a_new_segment_and_the_reader_stitches_them():
    fs = memfs()
    write(fs, [b"a", b"b"]).close()
    fs.kill()
    last = read_journal(J, after=0, fs=fs).summary.last_seq
    w = write(fs, [b"c"], next_seq=last + 1)
    w.append(b"d")
    w.close()  # close flushes
    assert segments(fs) == [segment_name(1), segment_name(3)]
    assert records(fs) == [(1, b"a"), (2, b"b"), (3, b"c"), (4, b"d")]
    assert read_journal(J, after=3, fs=fs).summary.segments_skipped == 1


def test_a_writer_refuses_to_reuse_seqs_and_changes_nothing():
    fs = memfs()
    write(fs, [b"a", b"b", b"c"]).close()
    write(fs, [b"d"], next_seq=4).close()
    before = {n: fs.read(J / n) for n in segments(fs)}
    for next_seq in (2, 3, 4):  # a segment with records at or after next_seq exists
        with pytest.raises(CustodyError, match="reuse sequence numbers") as e:
            JournalWriter(J, next_seq, fs=fs)
        assert e.value.path == str(J / segment_name(4))
    assert {n: fs.read(J / n) for n in segments(fs)} == before


def test_appending_after_close_or_a_too_large_record_is_refused():
    fs = memfs()
    w = write(fs, [b"a"])
    with pytest.raises(ValueError, match="above the limit"):
        w.append(b"\0" * (MAX_RECORD_BYTES + 1))
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.append(b"b")
    assert records(fs) == [(1, b"a")]


def test_appends_on_one_thread_and_flushes_on_another_lose_nothing():
    fs = memfs()
    w = JournalWriter(J, 1, fs=fs, segment_bytes=4096)
    done = threading.Event()

    def flusher():
        while not done.is_set():
            w.flush()
        w.flush()

    t = threading.Thread(target=flusher)
    t.start()
    for i in range(1, 2001):
        assert w.append(payload(i)) == i
    done.set()
    t.join()
    assert w.durable_seq == 2000
    assert records(fs) == [(i, payload(i)) for i in range(1, 2001)]


# -- torn tails --------------------------------------------------------------------------------


def test_a_torn_tail_at_every_byte_of_the_last_record_gives_the_records_before_it(tmp_path):
    d = tmp_path / "journal"
    write(DEFAULT_FS, [b"first", b"second", b"the last record"], directory=d).close()
    path = d / segment_name(1)
    full = path.read_bytes()
    last_start = len(full) - FRAME_OVERHEAD - len(b"the last record")
    for cut in range(last_start, len(full)):
        path.write_bytes(full[:cut])
        tail = read_journal(d, after=0)
        assert tail.records == [(1, b"first"), (2, b"second")], cut
        torn = [(t.offset, t.dropped) for t in tail.summary.torn]
        assert tail.summary.last_seq == 2 and torn == ([(last_start, cut - last_start)] if cut > last_start else [])
    path.write_bytes(full)
    assert read_journal(d, after=0).summary.records == 3


def test_a_torn_header_of_the_last_segment_is_an_empty_tail_and_a_writer_replaces_it():
    fs = memfs()
    write(fs, [b"a", b"b"]).close()
    header = encode_header(3)
    for cut in range(HEADER_SIZE):
        if cut:
            fs.write(J / segment_name(3), header[:cut])
        else:
            fs.write(J / segment_name(3), b"")
        tail = read_journal(J, after=0, fs=fs)
        assert tail.records == [(1, b"a"), (2, b"b")] and tail.summary.torn[0].offset == 0
        fs.unlink(J / segment_name(3))
    fs.write(J / segment_name(3), header + encode_frame(3, b"c")[:-1])  # a header, a torn frame
    assert read_journal(J, after=0, fs=fs).summary.last_seq == 2
    write(fs, [b"C"], next_seq=3).close()  # holds no complete record: replaced
    assert records(fs) == [(1, b"a"), (2, b"b"), (3, b"C")]


def test_a_bad_last_record_with_nothing_after_it_is_a_torn_tail():
    fs = memfs()
    write(fs, [b"a", b"b", b"c"]).close()
    path = J / segment_name(1)
    data = bytearray(fs.read(path))
    data[-1] ^= 0xFF
    replace(fs, path, bytes(data))
    assert records(fs) == [(1, b"a"), (2, b"b")]


def test_a_huge_length_at_the_tail_is_a_torn_tail_not_an_allocation():
    fs = memfs()
    write(fs, [b"a"]).close()
    path = J / segment_name(1)
    frame = bytearray(encode_frame(2, b"b"))
    frame[12:16] = (2**32 - 1).to_bytes(4, "little")
    replace(fs, path, fs.read(path) + bytes(frame))
    assert records(fs) == [(1, b"a")]


# -- corruption ------------------------------------------------------------------------------


def test_a_flipped_byte_anywhere_in_a_middle_record_is_refused_at_its_offset():
    fs = memfs()
    write(fs, [b"first", b"middle record", b"last"]).close()
    path = J / segment_name(1)
    good = fs.read(path)
    start = HEADER_SIZE + FRAME_OVERHEAD + len(b"first")
    for i in range(start, start + FRAME_OVERHEAD + len(b"middle record")):
        data = bytearray(good)
        data[i] ^= 0x01
        replace(fs, path, bytes(data))
        with pytest.raises(JournalError, match="in the middle of a segment") as e:
            read_journal(J, after=0, fs=fs)
        err = e.value
        assert isinstance(err, CheckpointError) and (err.path, err.offset) == (str(path), start), i
        assert "seq 2" in err.expected and f"at byte {start}" in str(err) and "journal.enabled=false" in str(err)
    replace(fs, path, good)
    assert len(records(fs)) == 3


@pytest.mark.parametrize(("seqs", "found"), [((1, 3), "seq 3 (a gap)"), ((1, 2, 2), "seq 2 (a repeated seq)"),
                                             ((2,), "seq 2 (a gap)")])
def test_a_record_out_of_sequence_is_refused(seqs, found):
    fs = memfs()
    fs.makedirs(J)
    fs.write(J / segment_name(1), encode_header(1) + b"".join(encode_frame(s, b"p") for s in seqs))
    with pytest.raises(JournalError, match="out of sequence") as e:
        read_journal(J, after=0, fs=fs)
    assert e.value.found == found
    assert e.value.offset == HEADER_SIZE + (FRAME_OVERHEAD + 1) * (len(seqs) - 1)


def test_a_segment_that_does_not_follow_the_one_before_is_refused():
    fs = memfs()
    write(fs, [b"a", b"b", b"c"]).close()
    fs.makedirs(J)
    fs.write(J / segment_name(6), encode_header(6) + encode_frame(6, b"f"))
    with pytest.raises(JournalError, match="does not start right after") as e:
        read_journal(J, after=0, fs=fs)
    assert e.value.expected.startswith("first_seq 4") and "a gap" in e.value.found
    # a torn tail of an older segment is fine when the next one starts right after it
    fs.unlink(J / segment_name(6))
    path = J / segment_name(1)
    replace(fs, path, fs.read(path)[:-1])
    write(fs, [b"C", b"d"], next_seq=3).close()
    assert records(fs) == [(1, b"a"), (2, b"b"), (3, b"C"), (4, b"d")]


def test_a_missing_first_segment_is_refused_when_after_is_older():
    fs = memfs()
    for first, batch in ((1, [b"a", b"b"]), (3, [b"c", b"d"]), (5, [b"e"])):
        write(fs, batch, next_seq=first).close()
    fs.unlink(J / segment_name(1))
    for after in (0, 1):
        with pytest.raises(JournalError, match="does not reach back") as e:
            read_journal(J, after=after, fs=fs)
        assert e.value.expected.startswith(f"a segment holding seq {after + 1}")
        assert e.value.found == "the oldest segment starts at seq 3"
    assert [s for s, _ in records(fs, after=2)] == [3, 4, 5]


def test_a_journal_that_ends_before_after_is_refused():
    fs = memfs()
    write(fs, [b"a", b"b"]).close()
    with pytest.raises(JournalError, match="ends before the position") as e:
        read_journal(J, after=5, fs=fs)
    assert e.value.found == "the last complete record is seq 2"


@pytest.mark.parametrize("damage", ["magic", "version", "first_seq", "checksum", "torn, not last"])
def test_a_wrong_segment_header_is_refused(damage):
    fs = memfs()
    write(fs, [b"a"]).close()
    write(fs, [b"b"], next_seq=2).close()
    path = J / segment_name(1)
    data = bytearray(fs.read(path))
    at = {"magic": 0, "version": 16, "first_seq": 20, "checksum": 28}.get(damage)
    if at is None:
        data = data[: HEADER_SIZE - 1]
    else:
        data[at] ^= 0x04
    replace(fs, path, bytes(data))
    with pytest.raises(JournalError, match="header is wrong") as e:
        read_journal(J, after=0, fs=fs)
    assert (e.value.path, e.value.offset) == (str(path), 0) and "first_seq 1 (from the file name)" in e.value.expected
    with pytest.raises(JournalError, match="header is wrong"):  # skipped segments get their header checked too
        read_journal(J, after=1, fs=fs)


@pytest.mark.parametrize("entry", ["fifo", "symlink", "stray file", "tmp leftover", "directory", "seq 0"])
def test_anything_but_a_segment_in_the_directory_is_refused_without_hanging(tmp_path, no_hang, entry):
    d = tmp_path / "journal"
    write(DEFAULT_FS, [b"a"], directory=d).close()
    target = tmp_path / "elsewhere"
    target.write_bytes(encode_header(2) + encode_frame(2, b"b"))
    name = {"fifo": segment_name(5), "symlink": segment_name(5), "stray file": "notes.txt",
            "tmp leftover": segment_name(5) + ".tmp", "directory": segment_name(5), "seq 0": segment_name(0)}[entry]
    if entry == "fifo":
        os.mkfifo(d / name)
    elif entry == "symlink":
        (d / name).symlink_to(target)
    elif entry == "directory":
        (d / name).mkdir()
    else:
        (d / name).write_bytes(b"x")
    with pytest.raises(JournalError, match="not a journal segment") as e:
        read_journal(d, after=0)
    assert e.value.path == str(d / name)
    # the writer and deletion leave such entries alone
    write(DEFAULT_FS, [b"b"], next_seq=2, directory=d).close()
    assert delete_covered(d, 2) == [d / segment_name(1)]


def test_a_symlinked_journal_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    write(DEFAULT_FS, [b"a"], directory=real).close()
    (tmp_path / "journal").symlink_to(real)
    with pytest.raises(JournalError, match="not a directory"):
        read_journal(tmp_path / "journal", after=0)


# -- retention ---------------------------------------------------------------------------------


def test_delete_covered_keeps_what_is_needed_and_never_the_newest_segment():
    for seq in range(0, 9):
        fs = memfs()
        for first, batch in ((1, [b"a", b"b"]), (3, [b"c", b"d"]), (5, [b"e", b"f"])):
            write(fs, batch, next_seq=first).close()
        deleted = delete_covered(J, seq, fs=fs)
        want = [J / segment_name(f) for f, nxt in ((1, 3), (3, 5)) if nxt <= seq + 1]
        assert deleted == want, seq
        assert segments(fs)[-1] == segment_name(5)
        tail = read_journal(J, after=min(seq, 6), fs=fs)  # every record after `seq` is still there
        assert [s for s, _ in tail.records] == list(range(min(seq, 6) + 1, 7))
    fs = memfs()
    assert delete_covered(J, 10, fs=fs) == []  # no journal: nothing


def test_retention_racing_a_new_segment_keeps_the_journal_reaching_the_checkpoint():
    """The red chaos run: the writer's thread had created its next segment (the file, no
    record yet) when the checkpoint writer deleted every segment before it; a kill, and
    the next writer removed the empty segment as a crashed writer's: a journal emptied
    under the checkpoint's position. A segment goes only once a durable record follows."""
    fs = memfs()
    w = write(fs, [b"a", b"b", b"c"], segment_bytes=HEADER_SIZE + FRAME_OVERHEAD + 1)  # one per segment
    fs.open_append(J / segment_name(4)).close()  # the writer's thread, between creating and writing
    assert w.delete_covered(3) == [J / segment_name(1), J / segment_name(2)]
    fs.kill()
    restored = read_journal(J, after=3, fs=fs)
    assert restored.summary.last_seq == 3 and restored.records == []
    JournalWriter(J, 4, fs=fs).close()  # removes the empty segment 4
    assert segments(fs) == [segment_name(3)]
    assert read_journal(J, after=3, fs=fs).summary.complete


def test_a_writer_past_seq_one_with_no_older_segment_shows_where_it_starts():
    """The red chaos run, second cause: a journal set aside under a checkpoint at seq 6, the
    new writer killed before its first flush left an empty directory, which a restore must
    refuse as damage (D6). The writer now puts a header at 7 in place before it returns."""
    fs = memfs()
    w = JournalWriter(J, 7, fs=fs)
    fs.power_cut()  # no flush yet, and nothing made durable after the constructor
    assert segments(fs) == [segment_name(7)]
    tail = read_journal(J, after=6, fs=fs)
    assert tail.records == [] and tail.summary.last_seq == 6 and tail.summary.complete
    w = JournalWriter(J, 7, fs=fs)  # a header-only segment at next_seq is kept and appended to
    w.append(b"g")
    w.close()
    fs.power_cut()
    assert segments(fs) == [segment_name(7)] and records(fs, after=6) == [(7, b"g")]
    with pytest.raises(CustodyError, match="reuse sequence numbers"):
        JournalWriter(J, 7, fs=fs)  # it holds a record now


@pytest.mark.parametrize("left", [b"", encode_header(7)[:5], "header+torn"])
def test_a_frameless_segment_with_no_older_one_is_replaced_never_removed_first(left):
    fs = memfs()
    fs.makedirs(J)
    fs.write(J / segment_name(7), encode_header(7) + encode_frame(7, b"x")[:-1] if left == "header+torn" else left)
    fs.fsync(J / segment_name(7))
    fs.fsync(J)
    removed = []
    unlink = fs.unlink
    fs.unlink = lambda p: (removed.append(p), unlink(p))  # type: ignore[method-assign]
    JournalWriter(J, 7, fs=fs).close()
    assert not [p for p in removed if p.parent == J], "the directory held no segment for a while"
    fs.power_cut()
    assert fs.read(J / segment_name(7)) == encode_header(7)
    assert read_journal(J, after=6, fs=fs).summary.complete


def test_a_read_after_the_checkpoint_reads_only_the_segments_it_needs():
    class Counting(MemFS):
        def __init__(self):
            super().__init__(random.Random(0))
            self.reads: list[tuple[str, int]] = []

        def read_prefix(self, path, n):
            self.reads.append((Path(path).name, n))
            return super().read_prefix(path, n)

    fs = Counting()
    fs.makedirs_durable(Path("/run"))
    write(fs, [b"x" * 10] * 9, segment_bytes=HEADER_SIZE + 3 * (FRAME_OVERHEAD + 10)).close()
    fs.reads.clear()
    tail = read_journal(J, after=6, fs=fs)
    assert [s for s, _ in tail.records] == [7, 8, 9]
    assert fs.reads == [(segment_name(1), HEADER_SIZE), (segment_name(4), HEADER_SIZE)] + [
        (segment_name(7), fs.reads[-1][1])]
    assert (tail.summary.segments_skipped, tail.summary.segments_read) == (2, 1)


def test_a_reader_yields_as_it_goes_and_is_iterated_once():
    fs = memfs()
    write(fs, [b"a", b"b"], segment_bytes=HEADER_SIZE + FRAME_OVERHEAD + 1).close()
    reader = JournalReader(J, after=0, fs=fs)
    it = iter(reader)
    assert next(it) == (1, b"a") and reader.summary.segments_read == 1 and not reader.summary.complete
    assert list(it) == [(2, b"b")] and reader.summary.complete
    with pytest.raises(RuntimeError):
        iter(reader)


# -- failures and crashes --------------------------------------------------------------------


class FailNth(MemFS):
    """Fails the n-th write or fsync (of a file or through an open one) with EIO."""

    def __init__(self, n: int, seed: int = 0) -> None:
        super().__init__(random.Random(seed))
        self.n, self.calls = n, 0

    def _fault(self, what, path):
        self.calls += 1
        if self.calls == self.n:
            raise OSError(errno.EIO, f"simulated {what} failure", str(path))


@pytest.mark.parametrize("n", range(1, 10))
@pytest.mark.parametrize("crash", ["kill", "power_cut"])
def test_a_failing_write_or_fsync_raises_and_what_was_flushed_stays_readable(n, crash):
    fs = FailNth(10**9)
    fs.makedirs_durable(Path("/run"))
    w = JournalWriter(J, 1, fs=fs, segment_bytes=HEADER_SIZE + 2 * (FRAME_OVERHEAD + 1))
    for p in (b"a", b"b", b"c"):
        w.append(p)
    w.flush()  # segments 1 (a, b) and 3 (c)
    fs.n, fs.calls = n, 0  # the n-th IO call of the next flush fails (n > its calls: none does)
    for p in (b"d", b"e", b"f", b"g"):
        w.append(p)
    try:
        w.flush()
        failed = False
    except OSError:
        failed = True
        with pytest.raises(OSError, match="unusable"):
            w.append(b"h")
        with pytest.raises(OSError, match="unusable"):
            w.flush()
        w.close()  # closes the file, raises nothing
    assert failed == (n <= 8)  # 3 segments touched: write + fsync each, a directory fsync for the 2 new
    durable = w.durable_seq
    getattr(fs, crash)()
    tail = read_journal(J, after=0, fs=fs)
    got = [p for _, p in tail.records]
    everything = [b"a", b"b", b"c", b"d", b"e", b"f", b"g"]
    assert got == everything[: len(got)] and len(got) >= durable >= 3


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rounds=st.lists(
        st.tuples(
            st.lists(st.tuples(st.binary(max_size=40), st.booleans()), max_size=25),  # (payload, flush after it)
            st.sampled_from(["kill", "power_cut", "failing flush", "cut"]),
        ),
        min_size=1, max_size=4,
    ),
    segment_bytes=st.sampled_from([HEADER_SIZE + FRAME_OVERHEAD + 1, 150, 400, 1 << 20]),
)
def test_after_a_crash_the_journal_holds_exactly_a_prefix_with_every_completed_flush(seed, rounds, segment_bytes):
    fs = memfs(seed)
    rng = random.Random(seed)
    journal: list[bytes] = []  # what the journal holds, as the last read found it
    for appends, crash in rounds:
        next_seq = read_journal(J, after=0, fs=fs).summary.last_seq + 1
        assert next_seq == len(journal) + 1
        w = JournalWriter(J, next_seq, fs=fs, segment_bytes=segment_bytes)
        written, flushed = list(journal), len(journal)
        for p, flush in appends:
            assert w.append(p) == len(written) + 1
            written.append(p)
            if flush:
                flushed = w.flush()
                assert flushed == len(written)
        if crash == "failing flush":
            fs.fault_rate, fs.faults_left = 1.0, 1
            w.append(b"unflushed")
            written.append(b"unflushed")
            with pytest.raises(OSError):
                w.flush()
            fs.fault_rate = 0.0
        if crash == "cut":  # the newest segment's file cut at a random byte
            names = segments(fs)
            if names:
                path = J / names[-1]
                data = fs.read(path)
                replace(fs, path, data[: rng.randint(0, len(data))])
                flushed = min(flushed, int(names[-1].split(".")[0]) - 1)
        else:
            fs.power_cut() if crash in ("power_cut", "failing flush") else fs.kill()
        tail = read_journal(J, after=0, fs=fs)
        got = [p for _, p in tail.records]
        assert got == written[: len(got)] and len(got) >= flushed
        if crash == "kill":
            assert len(got) == flushed  # nothing unflushed was ever written
        journal = got

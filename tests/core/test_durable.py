"""Journal entries and the tail a restore reads: every event comes back as it went in, a
seal with its row's place; a record that is not one event or one restart marker is refused
(exit 3); `read_tail` gives the events after a position in order, each seal with its row
read back and checked, and refuses a damaged row frame or a missing journal that a
checkpoint counts on."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import numpy as np
import pytest

from rollkeep.cli import exit_code
from rollkeep.core.custody.events import (
    Admitted,
    Dispatched,
    Dropped,
    Failed,
    Progressed,
    Sealed,
    StepCommitted,
    Taken,
)
from rollkeep.core.journal.durable import (
    JOURNAL_DIR,
    ROWS_DIR,
    JournalEntry,
    decode_entry,
    encode_entry,
    encode_restart,
    read_tail,
)
from rollkeep.core.journal.replay import Restart
from rollkeep.core.journal.segments import JournalError, JournalWriter
from rollkeep.core.rollout.rows import Row, RowId
from rollkeep.core.rowlog.segments import (
    RowLocation,
    RowLogReader,
    RowSegmentCorrupt,
    segment_path,
)
from rollkeep.core.rowlog.writer import RowLogWriter

LOC = RowLocation(segment=0, offset=64, length=100, checksum=12345)
TAKEN = Taken(epoch=0, ordinal=0, idx=7, task="t", row_fingerprint=99, group_size=3)

EVENTS = [
    TAKEN,
    Admitted(group_id="g0", target_step=1, version=0),
    Dispatched(group_id="g0", generations=(0, 1, 2), version=0),
    Failed(group_id="g0", generation=1, attempt=0, kind="infra", error="boom"),
    Dropped(group_id="g1", reason="data", prompt=(0, 4), step=1, shrink=True, replacement=TAKEN),
    StepCommitted(step=1, weight_version=1, group_ids=("g0",), prompts=((0, 7),)),
]


def row(seed: int) -> Row:
    rng = np.random.default_rng(seed)
    return Row(rng.integers(0, 50_000, 3, dtype=np.int32), rng.integers(0, 50_000, 2, dtype=np.int32),
               rng.standard_normal(2).astype(np.float32), rng.integers(0, 7, 2, dtype=np.int32), 1.0, "stop")


def refused(payload: bytes) -> JournalError:
    with pytest.raises(JournalError) as e:
        decode_entry(payload, seq=4, path="/run/journal")
    assert exit_code(e.value) == 3 and "record 4" in str(e.value) and "/run/journal" in str(e.value)
    return e.value


@pytest.mark.parametrize("ev", EVENTS, ids=lambda ev: type(ev).__name__)
def test_every_event_round_trips_without_a_row(ev) -> None:
    entry = decode_entry(encode_entry(ev), seq=1, path="j")
    assert (entry.event, entry.row, entry.restart) == (ev, None, None)


def test_a_seal_round_trips_with_its_row_location_and_a_restart_with_its_step() -> None:
    seal = Sealed(group_id="g0", generation=2, attempt=1, version=0, tokens=17)
    entry = decode_entry(encode_entry(seal, LOC), seq=1, path="j")
    assert (entry.event, entry.row, entry.restart) == (seal, LOC, None)
    for step in (0, 5):
        entry = decode_entry(encode_restart(step), seq=1, path="j")
        assert (entry.event, entry.row, entry.restart) == (None, None, step)


def test_decode_refuses_what_is_not_one_event_or_one_restart() -> None:
    enc = msgspec.msgpack.encode
    seal = Sealed(group_id="g0", generation=0, attempt=0, version=0, tokens=1)
    refused(b"\xff\x00 not msgpack")
    refused(enc([1, 2, 3]))  # msgpack, but not an entry
    refused(encode_entry(seal))  # a seal without its row
    assert "must name its frame" in str(refused(encode_entry(TAKEN, LOC)))  # a row on a non-seal
    progress = Progressed(group_id="g0", generation=0, attempt=0, tokens=3)
    refused(encode_entry(progress))  # a progress without its chunk's frame
    refused(enc(JournalEntry(TAKEN, None, 3)))  # both an event and a restart
    assert "neither" in str(refused(enc(JournalEntry(None, None, None))))  # neither
    refused(enc(JournalEntry(None, None, -1)))  # a negative restart


def write_run(run: Path) -> tuple[list, dict[RowId, Row]]:
    """A journal + row log as the journal thread writes them: restart, events, seals."""
    rows_w = RowLogWriter(run / ROWS_DIR)
    journal = JournalWriter(run / JOURNAL_DIR, 1)
    written: list = [Restart(0)]
    journal.append(encode_restart(0))
    rows = {}
    for ev in EVENTS[:3]:
        journal.append(encode_entry(ev))
        written.append(ev)
    for g in (0, 2):
        rid, r = RowId("g0", g, 0), row(g)
        seal = Sealed(group_id="g0", generation=g, attempt=0, version=0, tokens=2)
        journal.append(encode_entry(seal, rows_w.append(rid, r)))
        written.append(seal)
        rows[rid] = r
    for ev in EVENTS[3:]:
        journal.append(encode_entry(ev))
        written.append(ev)
    rows_w.flush()
    journal.flush()
    journal.close()
    rows_w.close()
    return written, rows


def test_read_tail_gives_the_events_in_order_with_each_seals_row(tmp_path) -> None:
    run = tmp_path / "run"
    written, rows = write_run(run)
    tail = read_tail(run, after=0)
    assert [ev for ev, _ in tail.events] == written and tail.last_seq == len(written)
    reader = RowLogReader(run / ROWS_DIR)
    for ev, loc in tail.events:  # a seal comes with its row's place, read only when asked
        if isinstance(ev, Sealed):
            rid = RowId(ev.group_id, ev.generation, ev.attempt)
            assert isinstance(loc, RowLocation) and reader.read(rid, loc).equal(rows[rid])
        else:
            assert loc is None
    assert isinstance(tail.events[0][0], Restart) and tail.dropped == [[0, 4]]

    later = read_tail(run, after=4)  # the events after a checkpoint's position
    assert [ev for ev, _ in later.events] == written[4:] and later.last_seq == len(written)


def test_a_missing_journal_is_an_empty_tail_unless_a_checkpoint_counts_on_it(tmp_path) -> None:
    tail = read_tail(tmp_path / "run", after=0)
    assert (tail.events, tail.dropped, tail.last_seq) == ([], [], 0)
    with pytest.raises(JournalError) as e:
        read_tail(tmp_path / "run", after=3)
    assert exit_code(e.value) == 3 and "missing" in str(e.value)


def test_a_damaged_row_frame_is_refused_when_the_row_is_read(tmp_path) -> None:
    """The tail does not read its rows (a restore's cost does not grow with row bytes): a
    changed byte inside a frame is found by the first read of that row, exit 3."""
    run = tmp_path / "run"
    write_run(run)
    seg = segment_path(run / ROWS_DIR, 0)
    data = bytearray(seg.read_bytes())
    data[-5] ^= 0xFF  # inside the last row's frame
    seg.write_bytes(bytes(data))
    tail = read_tail(run, after=0)
    ev, loc = [(ev, loc) for ev, loc in tail.events if isinstance(ev, Sealed)][-1]
    with pytest.raises(RowSegmentCorrupt) as e:
        RowLogReader(run / ROWS_DIR).read(RowId(ev.group_id, ev.generation, ev.attempt), loc)
    assert exit_code(e.value) == 3 and "checksum" in str(e.value)


@pytest.mark.parametrize("damage", ["truncated", "missing", "header", "fifo"])
def test_a_seal_whose_segment_is_short_missing_or_not_a_segment_is_refused_by_the_tail(tmp_path, damage) -> None:
    run = tmp_path / "run"
    write_run(run)
    seg = segment_path(run / ROWS_DIR, 0)
    data = seg.read_bytes()
    if damage == "truncated":
        seg.write_bytes(data[:-3])  # the last frame a durable seal names is cut short
    elif damage == "missing":
        seg.unlink()
    elif damage == "header":
        seg.write_bytes(b"\0" + data[1:])
    else:
        seg.unlink()
        os.mkfifo(seg)
    with pytest.raises(RowSegmentCorrupt) as e:
        read_tail(run, after=0)
    assert exit_code(e.value) == 3 and "segment 0" in str(e.value)

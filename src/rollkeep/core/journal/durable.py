"""What a run keeps between checkpoints (docs/design.md §5.1): one journal record per ledger
event, the record of a seal naming its row's place in the row log; read back as the tail a
restore replays.

    RUN_DIR/journal/   `rollkeep.core.journal.segments`: the records, in seq order
    RUN_DIR/rows/      `rollkeep.core.rowlog.segments`: the rows the seals name

A record's payload is `JournalEntry` in msgpack: the event as the ledger applied it, and for
a `sealed` event its row's `RowLocation`; or, as the first record of every process, a
`restart` marker: the step its ledger was at when it started (`replay.Restart`) and the
dataset it ran on (`source.DatasetId`: what a resume from the journal alone checks the
dataset against, as a checkpoint's manifest does). The writer (the runner's journal thread) flushes
the row log before the journal in every cycle, so a seal that is durable has a durable row.
`read_tail` gives every event after a checkpoint's journal position with the location of
each seal's row; the rows are not read (a restore's cost does not grow with row bytes): the
segments they are in are checked to exist, to have their header and to reach that far, and
each row is verified when it is first read (`rowlog.RowLogReader.read`: length, checksum,
row id; docs/design.md §5.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import msgspec

from ..checkpoint.rowindex import extents
from ..custody.events import ALL_EVENTS, Dropped, Event, Progressed, Sealed, TurnSealed
from ..io.fs import DEFAULT_FS, FS
from ..rollout.source import DatasetId
from ..rowlog.segments import ROWS_DIR, RowLocation, RowLogReader
from .replay import Restart
from .segments import JournalError, JournalReader, JournalSummary

__all__ = ["JOURNAL_DIR", "ROWS_DIR", "JournalEntry", "Tail", "decode_entry", "encode_entry", "encode_restart",
           "read_tail"]

JOURNAL_DIR = "journal"

AnyEvent = Union[ALL_EVENTS]  # noqa: UP007  (a tuple of types: the tagged union of every event)


class JournalEntry(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    event: AnyEvent | None  # type: ignore[valid-type]
    row: RowLocation | None = None  # a seal's row, or a progress's chunk, in the row log
    restart: int | None = None  # a process started here at this step (no event)
    dataset: DatasetId | None = None  # with a restart: the dataset that process ran on (absent in older journals)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(JournalEntry)


def encode_entry(event: Event, row: RowLocation | None = None) -> bytes:
    return _encoder.encode(JournalEntry(event, row))


def encode_restart(step: int, dataset: DatasetId | None = None) -> bytes:
    return _encoder.encode(JournalEntry(None, None, step, dataset))


def decode_entry(payload: bytes, *, seq: int, path: str) -> JournalEntry:
    try:
        entry = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise JournalError(f"journal record {seq} is not a rollkeep journal entry", path=path,
                           expected="a ledger event (and a seal's row location)", found=str(e)) from None
    if (entry.event is None) == (entry.restart is None) or (entry.restart is not None and entry.restart < 0):
        raise JournalError(f"journal record {seq} is neither one event nor one restart marker", path=path,
                           expected="an event, or a restart step >= 0", found=f"{entry}")
    if isinstance(entry.event, Sealed | Progressed | TurnSealed) != (entry.row is not None):
        raise JournalError(f"journal record {seq}: a seal or a progress must name its frame, and only they do",
                           path=path, expected="a row location exactly with a sealed, progressed or turn_sealed event",
                           found=f"{type(entry.event).__name__} with row {entry.row}")
    if entry.dataset is not None and entry.restart is None:
        raise JournalError(f"journal record {seq}: only a restart marker names a dataset", path=path,
                           expected="a dataset with a restart marker only", found=f"{entry}"[:200])
    return entry


@dataclass
class Tail:
    """The events after a checkpoint's journal position, each seal with its row's location."""

    events: list[tuple[Event | Restart, RowLocation | None]] = field(default_factory=list)
    summary: JournalSummary | None = None
    dropped: list[list[int]] = field(default_factory=list)  # [epoch, idx] of the tail's drops
    datasets: list[DatasetId] = field(default_factory=list)  # of the tail's restart markers, in order

    @property
    def last_seq(self) -> int:
        return 0 if self.summary is None else self.summary.last_seq


def read_tail(run_dir: Path, *, after: int, fs: FS = DEFAULT_FS) -> Tail:
    """Every journal event with seq > `after` (the checkpoint's position; 0 for a run that
    never checkpointed), with the locations of its seals' rows. Raises `JournalError` (exit 3)
    for a journal that is damaged or does not extend `after`, and the row log's errors for a
    seal whose segment is missing, has no valid header or is too short."""
    journal, rows = Path(run_dir) / JOURNAL_DIR, Path(run_dir) / ROWS_DIR
    tail = Tail()
    if fs.kind_of(journal) is None:
        if after:
            raise JournalError("the journal is missing but the checkpoint counts on it", path=str(journal),
                               expected=f"records through seq {after}", found="no journal directory")
        return tail
    reader = JournalReader(journal, after=after, fs=fs)
    for seq, payload in reader:
        entry = decode_entry(payload, seq=seq, path=str(journal))
        ev = entry.event if entry.event is not None else Restart(entry.restart)
        if isinstance(ev, Dropped):
            tail.dropped.append(list(ev.prompt))
        elif entry.dataset is not None:
            tail.datasets.append(entry.dataset)
        tail.events.append((ev, entry.row))
    row_reader = RowLogReader(rows, fs=fs)
    for seg, end in extents(loc for _, loc in tail.events if loc is not None):  # rows and chunks
        row_reader.check_extent(seg, end)
    tail.summary = reader.summary
    return tail

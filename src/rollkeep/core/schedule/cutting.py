"""The cut: what every driver does with a `Cut` command (docs/design.md §3, §8).

The scheduler captured custody when it decided the cut (`Cut.custody`, O(1)); the driver
then, on its loop and before any other scheduler call:

    take    the journal's position (the tail a restore of this checkpoint replays starts
            after it), the trainer's snapshot, and a flush of the trace (every commit the
            checkpoint covers is in the trace first); crash point `checkpoint.after_cut`
and, in the background (a worker thread, or the simulation's later):

    write   fsync what `take` flushed of the trace (no checkpoint covers a commit the
            durable trace lacks), then publish inside the journal's `covering`: the journal
            and the rows it names durable before the commit point, what the checkpoint
            makes redundant deleted after; then report `on_cut_written(step)`.

`checkpoint_meta` is what every checkpoint records besides custody and the trainer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .. import crashpoints
from ..checkpoint.cut import write_checkpoint
from ..checkpoint.meta import DatasetMeta, JournalPosition, RunMeta
from ..checkpoint.store import CheckpointStore
from ..custody.trace_schema import CheckpointPublished
from ..journal.groupcommit import GroupCommit
from ..restore.configdiff import fingerprint
from ..rollout.source import PromptSource
from .commands import Cut

AFTER_CUT = crashpoints.register("checkpoint.after_cut")


class FlushedTrace(Protocol):
    def flush(self) -> None: ...  # buffered lines to the file (no fsync)

    def sync_flushed(self) -> None: ...  # fsync what was flushed


class Snapshot(Protocol):
    step: int

    def save(self, dir: Path) -> None: ...


@dataclass(frozen=True)
class TakenCut:
    cmd: Cut
    position: tuple[int, int] | None  # the journal's (seq, rows segment) at the cut; None without one
    snapshot: Snapshot
    snapshot_seconds: float


def take(cmd: Cut, *, snapshot: Callable[[], Snapshot], journal: GroupCommit | None,
         trace: FlushedTrace) -> TakenCut:
    """The loop's part, right after the poll that returned `cmd` (no step trains in between)."""
    position = None if journal is None else journal.position()
    t0 = time.perf_counter()
    snap = snapshot()
    seconds = time.perf_counter() - t0
    trace.flush()
    crashpoints.hit(AFTER_CUT)
    return TakenCut(cmd, position, snap, seconds)


def write(taken: TakenCut, *, store: CheckpointStore, journal: GroupCommit | None, trace: FlushedTrace,
          meta: RunMeta, keep_last: int | None,
          trainer_save: Callable[[Path], None] | None = None) -> CheckpointPublished:
    """The background part: publish the cut (`trainer_save`: the snapshot's `save`, or a
    wrapper of it) and return its `checkpoint_published` event for the driver to emit. It
    touches the trace's open file only, not its buffer, so the loop may go on emitting
    meanwhile."""
    t0 = time.perf_counter()
    trace.sync_flushed()
    position, c = taken.position, taken.cmd.custody
    covering = contextlib.nullcontext() if position is None or journal is None else journal.covering(position, store)
    with covering:
        published = write_checkpoint(store, c, trainer_save=trainer_save or taken.snapshot.save,
                                     meta=meta, keep_last=keep_last, trainer_step=taken.snapshot.step)
    return CheckpointPublished(
        step=taken.cmd.step, name=published.name, bytes=published.bytes, cut_hold_seconds=c.hold_seconds,
        trainer_snapshot_seconds=taken.snapshot_seconds, write_seconds=time.perf_counter() - t0, cut_time=c.time,
        env_wait_seconds=taken.cmd.env_wait_s, env_steps_retired=taken.cmd.env_retired,
        shard_bytes=list(getattr(taken.snapshot, "shard_bytes", [])),  # (a sharded trainer's, once saved)
        shard_write_seconds=list(getattr(taken.snapshot, "write_seconds", [])))


def checkpoint_meta(source: PromptSource, semantic: dict[str, Any], run_id: str, *, writer: str,
                    journal: tuple[int, int] | None = None) -> RunMeta:
    """What every checkpoint of the run records besides custody and the trainer: the
    dataset and the semantic config a restore checks (restore steps 7 and 8), the writer
    (`writer`: its rollkeep version, and the run id), and with the journal its position at
    the cut (`GroupCommit.position`: the tail a restore of this checkpoint replays starts
    after `seq`)."""
    return RunMeta(
        dataset=DatasetMeta(n_rows=source.n_rows, seed=source.seed, epochs=source.epochs,
                            fingerprint=source.fingerprint()),
        config=semantic, config_fingerprint=fingerprint(semantic), rollkeep_version=writer, run_id=run_id,
        journal=None if journal is None else JournalPosition(*journal))

"""Starting a process: where it starts from and what it continues (docs/design.md §5, §5.1).

Every driver of the scheduler starts the same way (`rollkeep train`'s `startup.open_run`,
`rollkeep simulate`'s world, a library user's own loop), over the filesystem seam, with
plain values in and out:

    start_point   which checkpoint to restore: `--resume-from NAME`, LATEST, or a fresh
                  run; a run whose durable work would be started over is refused
    prepare       (after `restore_chain` on it) the journal's tail after it, read, checked
                  and replayed (only LATEST's tail: `is_newest`), the dataset checked on the
                  state the run continues from; reads only: a `Start`
    begin         once every check passed, the changes on disk, in their order: a journal
                  of another lineage set aside (crash point `startup.journal_set_aside`),
                  the new journal's first segment, then (--resume-from) the newer
                  checkpoints set aside and LATEST repointed
    open_state    the ledger, the row store and the prefix store the scheduler is built on

A process killed anywhere in between either left nothing changed, or a state the next plain
start resumes or refuses with the remedy (docs/design.md §5.1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import crashpoints
from ..checkpoint.cut import gc_paused
from ..checkpoint.store import CheckpointStore, checkpoint_order
from ..custody.ledger import Ledger, LedgerState
from ..errors import CheckpointNotFound, IllegalTransition, UserInputError
from ..io.fs import DEFAULT_FS, DIR, FS
from ..journal.durable import JOURNAL_DIR, read_tail
from ..journal.replay import LostWork, Restart, replay
from ..journal.segments import JournalError, JournalWriter
from ..rollout.effects import EffectRecord, EffectStore
from ..rollout.prefixes import Link, PrefixStore
from ..rollout.rows import Row, RowId
from ..rollout.rowstore import RowStore
from ..rollout.source import PromptSource
from ..rowlog.segments import ROWS_DIR, RowLocation, RowLogReader
from .chain import Restored, RestorePlan, check_dataset_identity, check_dataset_rows, plan

# Between setting a stale journal aside and moving the newer checkpoints aside (--resume-from).
JOURNAL_SET_ASIDE = crashpoints.register("startup.journal_set_aside")


# ---------------------------------------------------------------------- where it starts


def start_point(
    store: CheckpointStore, resume_from: str | None, *, published: Callable[[], int | None]
) -> str | None:
    """The checkpoint a run restores, or None for a fresh run:

        --resume-from NAME given   that checkpoint (it must exist; the restore chain checks it)
        LATEST names a checkpoint  that one
        no LATEST, step_* present  refused: a missing LATEST is never a fresh start (unless the
                                   trace shows none was ever published: a crash inside the
                                   first publication, before its commit point)
        no checkpoint at all, but
          the trace records one    refused: checkpoints were published and are gone
        otherwise                  a fresh run

    `published()` counts the publications the run's trace records (None: there is no
    trace; `trace.published_in_trace`); it is called only when LATEST is missing. Reads
    only; raises UserInputError (an unknown `resume_from`) or CheckpointNotFound."""
    names = store.list()
    if resume_from is not None:
        if resume_from not in names:
            raise UserInputError(
                f"--resume-from {resume_from}: no such checkpoint in {store.root}",
                path=str(store.root / resume_from),
                expected="the name of a checkpoint directory of this run",
                found="checkpoints present: " + (", ".join(names) or "none"),
                remedy="pick one of the names listed (`rollkeep inspect RUN_DIR` shows what each holds)",
            )
        return resume_from
    latest = store.latest()  # a malformed LATEST raises CheckpointNotFound
    if latest is not None:
        return latest
    traced = published()
    # A crash between the first publication's rename and its LATEST (store steps P6-P8)
    # leaves a complete step_* directory that was never published: the trace then records
    # no publication, and the run starts fresh (the store sets the leftover aside when it
    # publishes that step again). Anything else without LATEST means something was removed.
    if names and (traced is None or traced > 0):
        raise CheckpointNotFound(
            "LATEST is missing while checkpoint directories exist: starting over would "
            "retrain over their work, so the run is refused",
            path=str(store.root / "LATEST"),
            expected="a LATEST file naming the newest checkpoint",
            found=f"no LATEST; checkpoint directories present: {', '.join(names)}",
            remedy=f"resume from one on purpose with `rollkeep train ... --resume-from {names[-1]}` "
            "(the restore chain checks it first), or start over in a new run_dir",
        )
    if traced and not names:
        raise CheckpointNotFound(
            "the trace records published checkpoints, but none is left: starting over "
            "would retrain over durable work, so the run is refused",
            path=str(store.root),
            expected="the checkpoints the trace records",
            found=f"{traced} checkpoint_published event(s) in the trace; no checkpoint directory",
            remedy="put the checkpoints directory back, or start over in a new run_dir",
        )
    return None


def is_newest(store: CheckpointStore, restored: Restored | None) -> bool:
    """`restored` is LATEST, or no checkpoint of the store is newer (None: a fresh start):
    only then is the journal's tail after it replayed."""
    if restored is None or restored.name == store.latest():
        return True  # a directory newer than LATEST was never published (store P6-P8): the tail is LATEST's
    return not any(checkpoint_order(n) > checkpoint_order(restored.name) for n in store.list())


# ---------------------------------------------------------------------- what it continues


@dataclass(frozen=True)
class Tail:
    """The checkpoint (or the empty ledger) with the journal's tail replayed."""

    state: LedgerState
    rows: dict[RowId, Row | RowLocation]
    prefixes: dict[tuple[str, int], tuple[Link, ...]]
    events: int
    dropped: list[list[int]]
    lost: LostWork  # what the tail generated under lost versions (recovery.lost_versions)
    effects: dict[tuple[str, int], tuple[EffectRecord, ...]] = field(default_factory=dict)  # calls to the outside


@dataclass(frozen=True)
class Start:
    """Where a process starts from (`prepare`): plain values, nothing opened."""

    restored: Restored | None  # the checkpoint restored (None: none)
    tail: Tail | None  # the journal's tail replayed after it (None: none)
    next_seq: int  # the seq the journal goes on at
    stale: bool  # the journal on disk belongs to another lineage: `begin` sets it aside

    @property
    def resumed(self) -> bool:
        return self.restored is not None or self.tail is not None

    def state(self, source: PromptSource) -> LedgerState:
        """The ledger the process continues: the tail's, the checkpoint's, or a fresh one."""
        if self.tail is not None:
            return self.tail.state
        if self.restored is not None:
            return self.restored.ledger
        return Ledger(n_rows=source.n_rows, seed=source.seed, epochs=source.epochs).capture()

    def continues(self) -> Restored | RestorePlan | None:
        """What `Scheduler.start` normalises: the restored checkpoint, the plan of the
        replayed ledger, or None for a fresh run."""
        if self.tail is not None:
            return plan(self.tail.state)
        return self.restored

    def restored_fields(self) -> dict[str, Any]:
        """The journal's fields of the `restored` trace event."""
        if self.tail is None:
            return {}
        return {"journal_events_replayed": self.tail.events, "journal_dropped": self.tail.dropped}


def prepare(run_dir: Path, store: CheckpointStore, source: PromptSource, restored: Restored | None, *,
            journaled: bool, check_config: Callable[[], None] | None = None, allow_dataset_change: bool = False,
            extend_epochs: bool = False, fs: FS = DEFAULT_FS) -> Start:
    """Where the process starts from, after `restore_chain` passed on `restored` (None: no
    checkpoint). Reads only. With the journal off: no tail and nothing set aside, and a
    journal that holds a run's only record of its work is refused rather than silently
    started over (exit 3). `check_config()`: checks the run's config when no checkpoint did
    (a run that never checkpointed)."""
    run_dir = Path(run_dir)
    if journaled:
        tail, next_seq, stale = journal_tail(run_dir, restored, newest=is_newest(store, restored), source=source,
                                             check_config=check_config, allow_dataset_change=allow_dataset_change,
                                             extend_epochs=extend_epochs, fs=fs)
        return Start(restored, tail, next_seq, stale)
    if restored is None:
        _refuse_unjournaled_restart(run_dir, fs)
    else:
        check_dataset_rows(restored.ledger, source, path=str(restored.checkpoint.path / "ledger.msgpack"),
                           fingerprint=restored.meta.dataset_fingerprint,
                           allow_dataset_change=allow_dataset_change)
    return Start(restored, None, 1, False)


def _refuse_unjournaled_restart(run_dir: Path, fs: FS) -> None:
    """No checkpoint, the journal off, and a journal on disk that recorded work: starting
    over would retrain what that run trained and drop what it generated (exit 3)."""
    journal = run_dir / JOURNAL_DIR
    if fs.kind_of(journal) is None:
        return
    tail = read_tail(run_dir, after=0, fs=fs)
    events = sum(1 for ev, _ in tail.events if not isinstance(ev, Restart))
    if events:
        raise JournalError(
            "the run never published a checkpoint; its journal is the only record of its work, and "
            "journal.enabled=false would start it over", path=str(journal), field="journal.enabled",
            expected="journal.enabled=true to resume a run that has only its journal",
            found=f"{events} journal event(s) and journal.enabled=false",
            remedy="resume with journal.enabled=true (and the recovery.mode it ran with), or move "
            f"{journal} aside (or use a new run_dir) to start over on purpose")


def journal_tail(run_dir: Path, restored: Restored | None, *, newest: bool, source: PromptSource,
                 check_config: Callable[[], None] | None = None, allow_dataset_change: bool = False,
                 extend_epochs: bool = False, fs: FS = DEFAULT_FS) -> tuple[Tail | None, int, bool]:
    """(the checkpoint with the journal's tail replayed, or None if there is none; the seq the
    journal goes on at; whether the journal on disk belongs to another lineage and is set
    aside). Only LATEST's tail is replayed; a run that never checkpointed replays from the
    empty ledger of the dataset its first process recorded, once `check_config()` accepted
    the run's config (docs/design.md §5.1). Restore step 7's rows are checked here on the
    state the run continues from: every group, the checkpoint's and the tail's alike, and
    the newest recorded dataset fingerprint (`restore_chain(..., dataset_rows=False)`
    leaves them to this). A tail that does not continue the ledger is refused (exit 3)."""
    ledger_path = None if restored is None else str(restored.checkpoint.path / "ledger.msgpack")
    recorded = None if restored is None else restored.meta.dataset_fingerprint

    def check_rows(state: LedgerState, path: str, fingerprint: str | None) -> None:
        check_dataset_rows(state, source, path=path, fingerprint=fingerprint, allow_dataset_change=allow_dataset_change)

    position = 0 if restored is None else restored.meta.journal_seq
    if position is None or not newest:  # written with the journal off, or an older one resumed on purpose
        check_rows(restored.ledger, ledger_path, recorded)
        return None, 1 + (position or 0), True
    for name in (JOURNAL_DIR, ROWS_DIR):  # before anything is written: a FIFO or a file is refused
        if fs.kind_of(run_dir / name) not in (None, DIR):
            raise JournalError(
                f"RUN_DIR/{name} is not a directory", path=str(run_dir / name),
                expected="a directory (not a symlink) that the run's journal writes",
                found=fs.describe(run_dir / name),
                remedy="move it aside and run again (the run resumes from its checkpoint)")
    tail = _read_tail(run_dir, position, fs)
    if not any(not isinstance(ev, Restart) for ev, _ in tail.events):
        if restored is not None:
            check_rows(restored.ledger, ledger_path, tail.datasets[-1].fingerprint if tail.datasets else recorded)
        return None, tail.last_seq + 1, False
    journal = str(run_dir / JOURNAL_DIR)
    if restored is None:
        if check_config is not None:
            check_config()
        first = tail.datasets[0] if tail.datasets else source.identity()  # (older journals record none)
        base, rows = Ledger(n_rows=first.n_rows, seed=first.seed, epochs=first.epochs).capture(), {}
    else:
        base, rows = restored.ledger, restored.rows
    try:
        r = replay(base, rows, tail.events, None if restored is None else restored.prefixes,
                   None if restored is None else restored.effects)
    except IllegalTransition as e:  # not a bug of this run: a journal that is not this checkpoint's
        raise JournalError(e.what, path=journal, expected=e.expected, found=e.found, remedy=e.remedy) from None
    check_dataset_identity(r.state, source, path=journal, extend_epochs=extend_epochs)
    check_rows(r.state, journal, tail.datasets[-1].fingerprint if tail.datasets else recorded)
    return Tail(r.state, r.rows, r.prefixes, r.events, tail.dropped, r.lost, r.effects), tail.last_seq + 1, False


def _read_tail(run_dir: Path, position: int, fs: FS):
    """`read_tail` after `position`, naming the rerun of `--resume-from` where a journal
    was set aside beside a missing or damaged one (killed inside `begin`)."""
    rerun = ("if a `rollkeep train ... --resume-from NAME` was stopped before it moved the newer checkpoints "
             "aside, run it again: it finishes and resumes from NAME")
    aside = [] if not position else sorted(
        n for n, _ in fs.listdir(run_dir) if n.startswith(f"{JOURNAL_DIR}-abandoned-"))
    if aside and fs.kind_of(run_dir / JOURNAL_DIR) is None:
        raise JournalError(
            "the journal is missing but the checkpoint counts on it; a journal was set aside beside it",
            path=str(run_dir / JOURNAL_DIR), expected=f"records through seq {position}",
            found=f"no journal directory; {', '.join(aside)} beside it",
            remedy=f"{rerun}. Otherwise the journal was removed: resume from the checkpoint alone with "
            "journal.enabled=false")
    try:
        return read_tail(run_dir, after=position, fs=fs)
    except JournalError as e:
        if not aside:
            raise
        # killed after the new journal began and before LATEST moved: it starts after NAME's cut
        raise JournalError(e.what, path=e.path, offset=e.offset, expected=e.expected, found=e.found,
                           remedy=f"{rerun}. Otherwise: {e.remedy}") from None


# ---------------------------------------------------------------------- what it changes


def begin(run_dir: Path, store: CheckpointStore, start: Start, *, journaled: bool,
          fs: FS = DEFAULT_FS) -> dict[str, Any] | None:
    """The changes on disk a start makes, once every check passed, in this order: a stale
    journal set aside (a plain start killed after it refuses, naming the rerun), the new
    journal's first segment at `next_seq` (so an empty journal under a checkpoint's position
    is always damage), then the newer checkpoints set aside and LATEST pointed at the one
    restored (--resume-from). Returns what was set aside ({"names", "into"}) or None."""
    if start.stale:
        set_journal_aside(Path(run_dir), fs)
        crashpoints.hit(JOURNAL_SET_ASIDE)
        if journaled:
            JournalWriter(Path(run_dir) / JOURNAL_DIR, start.next_seq, fs=fs).close()
    return resume_here(store, start.restored)


def set_journal_aside(run_dir: Path, fs: FS = DEFAULT_FS) -> None:
    """Move the journal out of the way (nothing is deleted). The row log stays: checkpoints
    name their rows in it (retention deletes what none names)."""
    if fs.kind_of(run_dir / JOURNAL_DIR) is not None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside, n = run_dir / f"{JOURNAL_DIR}-abandoned-{stamp}", 1
        while fs.kind_of(aside) is not None:
            n += 1
            aside = run_dir / f"{JOURNAL_DIR}-abandoned-{stamp}-{n}"
        fs.rename(run_dir / JOURNAL_DIR, aside)


def resume_here(store: CheckpointStore, restored: Restored | None) -> dict[str, Any] | None:
    """Move the checkpoints newer than `restored` aside (nothing is deleted), then point
    LATEST at it (the store's protocol); a plain start moves only a directory that was
    renamed in and never published."""
    if restored is None:
        return None
    mine = checkpoint_order(restored.name)
    newer = [n for n in store.list() if checkpoint_order(n) > mine]
    into = store.set_aside(newer)
    if store.latest() != restored.name:
        store.point_latest(restored.name)
    return {"names": newer, "into": into} if newer else None


def open_state(run_dir: Path, start: Start, source: PromptSource, *, fs: FS = DEFAULT_FS,
               columns_from: int | None = None) -> tuple[Ledger, RowStore, PrefixStore]:
    """The ledger, rows and prefixes the scheduler is built on; rows in the row log stay
    there until first read. `columns_from`: the row store's (`RowStore`)."""
    t, r = start.tail, start.restored
    rows, chains = (t.rows, t.prefixes) if t is not None else (r.rows, r.prefixes) if r is not None else ({}, {})
    reader = RowLogReader(Path(run_dir) / ROWS_DIR, fs=fs).read
    row_store, prefixes = RowStore(reader=reader, columns_from=columns_from), PrefixStore(reader=reader)
    # The checkpoint's rows by reference as its index's columns too, less those its tail freed.
    located = r.located if r is not None else None
    gone = r.rows.keys() - rows.keys() if located is not None and t is not None else ()
    with gc_paused():  # O(groups + rows) small objects, as in the chain
        row_store.restore(rows, located, gone)
        prefixes.restore(chains)
        return Ledger.from_state(start.state(source)), row_store, prefixes


def open_effects(start: Start) -> EffectStore:
    """The effect records the scheduler is built on: the tail's, or the checkpoint's."""
    t, r = start.tail, start.restored
    store = EffectStore()
    store.restore(t.effects if t is not None else r.effects if r is not None else {})
    return store

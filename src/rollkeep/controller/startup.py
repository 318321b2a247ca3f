"""Starting a run: restore the checkpoint `train` chose (or start fresh), then open what
the run writes. Nothing on disk changes before the restore chain has passed.

    restore   the full restore chain on the chosen checkpoint (read-only), the trainer's
              state (bound to the ledger's step), the ledger and the rows; with the
              journal, its tail after LATEST (or after nothing, for a run that never
              checkpointed) read, checked and replayed (`journal_tail`, docs/design.md §5.1)
    then      set newer checkpoints aside (--resume-from) and a journal that belongs to
              another lineage, write config.yaml (fresh run), remove leftover temp files,
              open the trace, the metrics and the journal thread, trace `run_started`,
              start the scheduler (it records the run's limits and normalises a restored
              ledger), trace `restored` and say what it reuses
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ADDED_KEYS, Config, dump_yaml, load_config
from ..config import semantic as semantic_of
from ..core import crashpoints, restore
from ..core.configdiff import check_compatible, fingerprint, is_allowed
from ..core.durable import JOURNAL_DIR, ROWS_DIR, journal_position, read_tail
from ..core.errors import IllegalTransition, UserInputError
from ..core.fs import DEFAULT_FS, DIR, FS
from ..core.journal import JournalError, JournalWriter
from ..core.ledger import Ledger, LedgerState
from ..core.prefixes import Link, PrefixStore
from ..core.replay import LostWork, Restart, replay
from ..core.restore import check_dataset_identity, check_dataset_rows, plan, restore_chain
from ..core.rowlog import RowLocation, RowLogReader
from ..core.rows import Row, RowId, RowStore
from ..core.samplers import Limits, make_sampler
from ..core.schedule import RetryPolicy, Scheduler, Settings
from ..core.source import PromptSource
from ..core.store import CheckpointStore, checkpoint_order
from ..core.trace_schema import Restored, RunStarted
from ..envs import EnvSpec
from ..progress import RunProgress
from ..trace import Trace, last_committed_in_trace
from ..trainers import Trainer
from ..version import rollkeep_version
from .episodes import check_restored
from .journaling import JournalThread, check_writable
from .metrics import MetricsLog

# Between setting a stale journal aside and moving the newer checkpoints aside (--resume-from).
JOURNAL_SET_ASIDE = crashpoints.register("startup.journal_set_aside")


def settings(cfg: Config, *, streams: bool = True) -> Settings:
    """The scheduler's settings. `streams`: the engine reports tokens as it goes (without
    that no partial generation is recorded or continued)."""
    r = cfg.rollout
    return Settings(
        seed=cfg.seed, group_size=r.group_size, total_steps=cfg.train.total_steps,
        checkpoint_every=cfg.checkpoint.every_steps, checkpoint_on_shutdown=cfg.checkpoint.on_shutdown,
        deterministic=cfg.deterministic, recovery_mode=cfg.recovery.mode,
        on_dropped_prompt=r.on_dropped_prompt, on_stale=cfg.sampler.on_stale, spare_prompts=r.spare_prompts,
        timeout_s=r.timeout_s, retry=RetryPolicy(r.max_infra_attempts, r.max_data_attempts, r.backoff_ms,
                                                 r.backoff_max_ms),
        scale_rewards=cfg.trainer.scale_rewards,
        # Prefixes are durable only through the journal; without it attempts regenerate.
        record_partial=cfg.journaled and streams, resume_partial=cfg.recovery.partial == "resume",
        progress_every_s=cfg.recovery.progress_ms / 1000, lost_versions=cfg.recovery.lost_versions,
    )



def open_run(
    cfg: Config,
    *,
    store: CheckpointStore,
    source: PromptSource,
    trainer: Trainer,
    limits: Limits,
    semantic: dict[str, Any],
    resume: str | None,
    allow_config_change: tuple[str, ...],
    allow_dataset_change: bool,
    streams: bool = True,
    env: EnvSpec | None = None,
) -> tuple[Scheduler, Trace, MetricsLog, RunProgress, JournalThread | None]:
    """Restore (or start fresh) and open the run; see the module docstring."""
    run_dir = Path(cfg.run_dir)
    extend_epochs = is_allowed("data.epochs", allow_config_change)
    restored = None
    if resume is not None:
        restored = restore_chain(
            store, name=resume, source=source, config=semantic,
            allow_config_change=allow_config_change, allow_dataset_change=allow_dataset_change,
            extend_epochs=extend_epochs, config_added=ADDED_KEYS, dataset_rows=False)
        load_trainer(trainer, restored)
    newest = is_newest(store, restored)
    tail, next_seq, stale = _journal_tail(cfg, run_dir, restored, newest=newest, source=source, semantic=semantic,
                                          allow_config_change=allow_config_change,
                                          allow_dataset_change=allow_dataset_change, extend_epochs=extend_epochs)
    resumed = restored is not None or tail is not None
    base = restored.ledger if restored is not None else Ledger(
        n_rows=source.n_rows, seed=source.seed, epochs=source.epochs).capture()
    state, restored_rows, chains = (tail.state, tail.rows, tail.prefixes) if tail is not None else (
        base, {}, {}) if restored is None else (base, restored.rows, restored.prefixes)
    ledger = Ledger.from_state(state)
    reader = RowLogReader(run_dir / ROWS_DIR).read
    rows, prefixes = RowStore(reader=reader), PrefixStore(reader=reader)
    rows.restore(restored_rows)  # rows in the row log stay there until first read
    prefixes.restore(chains)
    check_restored(prefixes, env, str(store.root / (resume or "")))
    # Only now that the restore chain (and the journal's tail) passed does anything on disk change,
    # once the journal's directories are known to take its segments (D10).
    if cfg.journaled:
        check_writable(run_dir)
    if stale:  # first: killed before the checkpoints below are moved, a plain start refuses (no journal)
        set_journal_aside(run_dir)
        crashpoints.hit(JOURNAL_SET_ASIDE)
        if cfg.journaled:  # the new journal shows where it starts before LATEST moves to it
            JournalWriter(run_dir / JOURNAL_DIR, next_seq).close()
    abandoned = _resume_here(store, restored)
    if not resumed:
        run_dir.mkdir(parents=True, exist_ok=True)  # `train` made it; a direct caller may not
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    leftovers = store.cleanup_tmp()
    redone = [] if not resumed else _steps_redone(ledger.version, run_dir / "trace.jsonl")
    trace = Trace(run_dir / "trace.jsonl")
    metrics = MetricsLog(run_dir, trace.run_id, tensorboard=cfg.logger.tensorboard)
    with open(run_dir / "config-history.jsonl", "a") as f:
        f.write(json.dumps({"t": time.time(), "run_id": trace.run_id, "config": cfg.to_dict()}) + "\n")
    sched = Scheduler(ledger=ledger, rows=rows, source=source, sampler=make_sampler(cfg.sampler.name, limits),
                      settings=settings(cfg, streams=streams), prefixes=prefixes)
    sched.subscribe(trace.ledger_event)
    journal = None
    if cfg.journaled:
        journal = JournalThread(run_dir, next_seq=next_seq, rows=rows, prefixes=prefixes,
                                flush_ms=cfg.journal.flush_ms, flush_events=cfg.journal.flush_events)
        journal.restart(ledger.version, source.identity())
        sched.subscribe(journal.sink)
        trace.on_flush = journal.release
    trace.emit(RunStarted(resumed_from_step=ledger.version if resumed else None,
                          checkpoint=None if restored is None else restored.name, pid=os.getpid(),
                          config_fingerprint=fingerprint(semantic), cleaned_tmp=leftovers,
                          abandoned_checkpoints=abandoned))
    counts = sched.start(None if not resumed else restored if tail is None else plan(state), epochs=source.epochs,
                         replayed=tail is not None, lost=None if tail is None else tail.lost)
    progress = RunProgress(cfg.logger.progress, total_steps=cfg.train.total_steps, start_step=ledger.version)
    if leftovers:
        progress.note(f"removed {len(leftovers)} leftover temporary file(s): {', '.join(leftovers)}")
    if abandoned:
        progress.note(f"resuming from {restored.name}: moved the newer checkpoint(s) "
                      f"{', '.join(abandoned['names'])} aside into {abandoned['into']}/")
    if resumed:
        cut_time = restored.manifest.get("cut_time") if restored is not None else 0.0
        journal_fields = {} if tail is None else {"journal_events_replayed": tail.events,
                                                  "journal_dropped": tail.dropped}
        trace.emit(Restored(checkpoint=None if restored is None else restored.name, step=ledger.version,
                            cut_time=cut_time, **counts, steps_redone=redone, **journal_fields,
                            config_changes=[] if restored is None else [list(c) for c in restored.config_changes]))
        progress.note(restore_banner(restored.name if restored is not None else "the journal", counts, redone,
                                     journal=None if tail is None else tail.events))
    return sched, trace, metrics, progress, journal


@dataclass(frozen=True)
class _Tail:
    state: LedgerState  # the checkpoint's ledger with the journal's tail replayed
    rows: dict[RowId, Row | RowLocation]
    prefixes: dict[tuple[str, int], tuple[Link, ...]]
    events: int
    dropped: list[list[int]]
    lost: LostWork  # what the tail generated under lost versions (recovery.lost_versions)


def _journal_tail(cfg: Config, run_dir: Path, restored: restore.Restored | None, *, newest: bool, source: PromptSource,
                  semantic: dict[str, Any], allow_config_change: tuple[str, ...], allow_dataset_change: bool,
                  extend_epochs: bool) -> tuple[_Tail | None, int, bool]:
    """`journal_tail` for the run of `cfg`. With the journal off: no tail, and nothing set
    aside; a journal that holds a run's only record of its work (it never checkpointed) is
    refused rather than silently started over."""
    if not cfg.journaled:
        if restored is None:
            _refuse_unjournaled_restart(run_dir, source)
        else:
            check_dataset_rows(restored.ledger, source, path=str(restored.checkpoint.path / "ledger.msgpack"),
                               fingerprint=restored.manifest.get("dataset", {}).get("fingerprint"),
                               allow_dataset_change=allow_dataset_change)
        return None, 1, False

    def check_config() -> None:  # no checkpoint checked the config: the journaled run's own config.yaml does
        check_compatible(semantic_of(load_config(str(run_dir / "config.yaml"), [])), semantic,
                         allow=allow_config_change, path=str(run_dir / "config.yaml"), added=ADDED_KEYS)

    return journal_tail(run_dir, restored, newest=newest, source=source, check_config=check_config,
                        allow_dataset_change=allow_dataset_change, extend_epochs=extend_epochs)


def _refuse_unjournaled_restart(run_dir: Path, source: PromptSource) -> None:
    """No checkpoint, the journal off, and a journal on disk that recorded work: starting
    over would retrain what that run trained and drop what it generated (exit 3)."""
    journal = run_dir / JOURNAL_DIR
    if DEFAULT_FS.kind_of(journal) is None:
        return
    tail = read_tail(run_dir, after=0)
    events = sum(1 for ev, _ in tail.events if not isinstance(ev, Restart))
    if events:
        raise JournalError(
            "the run never published a checkpoint; its journal is the only record of its work, and "
            "journal.enabled=false would start it over", path=str(journal), field="journal.enabled",
            expected="journal.enabled=true to resume a run that has only its journal",
            found=f"{events} journal event(s) and journal.enabled=false",
            remedy="resume with journal.enabled=true (and the recovery.mode it ran with), or move "
            f"{journal} aside (or use a new run_dir) to start over on purpose")


def journal_tail(run_dir: Path, restored: restore.Restored | None, *, newest: bool, source: PromptSource,
                 check_config: Callable[[], None] | None = None, allow_dataset_change: bool = False,
                 extend_epochs: bool = False, fs: FS = DEFAULT_FS) -> tuple[_Tail | None, int, bool]:
    """(the checkpoint with the journal's tail replayed, or None if there is none; the seq the
    journal goes on at; whether the journal on disk belongs to another lineage and is set
    aside). Only LATEST's tail is replayed; a run that never checkpointed replays from the
    empty ledger of the dataset its first process recorded, once `check_config()` accepted
    the run's config (docs/design.md §5.1). Restore step 7's rows are checked here on the
    state the run continues from: every group, the checkpoint's and the tail's alike, and
    the newest recorded dataset fingerprint (`restore_chain(..., dataset_rows=False)`
    leaves them to this). A tail that does not continue the ledger is refused (exit 3).
    `rollkeep simulate` calls it on its simulated disk (`fs`)."""
    ledger_path = None if restored is None else str(restored.checkpoint.path / "ledger.msgpack")
    recorded = None if restored is None else restored.manifest.get("dataset", {}).get("fingerprint")

    def check_rows(state: LedgerState, path: str, fingerprint: str | None) -> None:
        check_dataset_rows(state, source, path=path, fingerprint=fingerprint, allow_dataset_change=allow_dataset_change)

    position = 0 if restored is None else journal_position(
        restored.manifest, path=str(restored.checkpoint.path / "MANIFEST.json"))
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
    rerun = ("if a `rollkeep train ... --resume-from NAME` was stopped before it moved the newer checkpoints "
             "aside, run it again: it finishes and resumes from NAME")
    aside = [] if not position else sorted(
        n for n, _ in fs.listdir(run_dir) if n.startswith(f"{JOURNAL_DIR}-abandoned-"))
    if aside and fs.kind_of(run_dir / JOURNAL_DIR) is None:
        # `--resume-from` sets the journal aside before it moves the newer checkpoints
        raise JournalError(
            "the journal is missing but the checkpoint counts on it; a journal was set aside beside it",
            path=str(run_dir / JOURNAL_DIR), expected=f"records through seq {position}",
            found=f"no journal directory; {', '.join(aside)} beside it",
            remedy=f"{rerun}. Otherwise the journal was removed: resume from the checkpoint alone with "
            "journal.enabled=false")
    try:
        tail = read_tail(run_dir, after=position, fs=fs)
    except JournalError as e:
        if not aside:
            raise
        # killed after the new journal began and before LATEST moved: it starts after NAME's cut
        raise JournalError(e.what, path=e.path, offset=e.offset, expected=e.expected, found=e.found,
                           remedy=f"{rerun}. Otherwise: {e.remedy}") from None
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
        r = replay(base, rows, tail.events, None if restored is None else restored.prefixes)
    except IllegalTransition as e:  # not a bug of this run: a journal that is not this checkpoint's
        raise JournalError(e.what, path=journal, expected=e.expected, found=e.found, remedy=e.remedy) from None
    check_dataset_identity(r.state, source, path=journal, extend_epochs=extend_epochs)
    check_rows(r.state, journal, tail.datasets[-1].fingerprint if tail.datasets else recorded)
    return _Tail(r.state, r.rows, r.prefixes, r.events, tail.dropped, r.lost), tail.last_seq + 1, False


def load_trainer(trainer: Trainer, restored: restore.Restored) -> None:
    """`trainer.load` on the checkpoint's verified `trainer/` directory, which it must not
    change (docs/library.md, "Bring your own trainer"): a file written, changed or removed by it is
    refused (exit 2) before anything else is written, since the checkpoint may no longer
    restore. Compares every file's (size, mtime, inode) before and after, not its bytes:
    the chain has just hashed them."""
    before = _tree_stats(restored.trainer_dir)
    trainer.load(restored.trainer_dir, step=restored.ledger.version)
    after = _tree_stats(restored.trainer_dir)
    if after != before:
        changed = sorted(set(before) ^ set(after) | {k for k in before.keys() & after.keys() if before[k] != after[k]})
        raise UserInputError(
            f"the trainer's load() changed checkpoint {restored.name}'s trainer/ directory",
            path=str(restored.trainer_dir), field="trainer.load",
            expected="load(dir, step=) only reads the directory", found="changed: " + ", ".join(changed[:5]),
            remedy="fix the trainer's load() so it writes nowhere in dir (write caches elsewhere); "
            "the checkpoint may no longer restore (`rollkeep audit --all RUN_DIR` says), so resume "
            "from an older checkpoint with `--resume-from` if it does not")


def _tree_stats(root: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*filenames, *(d for d in dirnames if os.path.islink(os.path.join(dirpath, d)))):
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def is_newest(store: CheckpointStore, restored: restore.Restored | None) -> bool:
    """`restored` is LATEST, or no checkpoint of the store is newer (None: a fresh start):
    only then is the journal's tail after it replayed."""
    if restored is None or restored.name == store.latest():
        return True  # a directory newer than LATEST was never published (store P6-P8): the tail is LATEST's
    return not any(checkpoint_order(n) > checkpoint_order(restored.name) for n in store.list())


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


def checkpoint_meta(source: PromptSource, semantic: dict[str, Any], run_id: str, *,
                    journal: tuple[int, int] | None = None) -> dict[str, Any]:
    """What every checkpoint of the run records besides custody and the trainer: the
    dataset and the semantic config a restore checks (restore steps 7 and 8), the writer,
    and with the journal its position at the cut (`JournalThread.position`: the tail a
    restore of this checkpoint replays starts after `seq`)."""
    meta = {"dataset": {"n_rows": source.n_rows, "seed": source.seed, "epochs": source.epochs,
                        "fingerprint": source.fingerprint()},
            "config": semantic, "config_fingerprint": fingerprint(semantic),
            "rollkeep_version": rollkeep_version(), "run_id": run_id}
    if journal is not None:
        meta["journal"] = {"seq": journal[0], "rows_segment": journal[1]}
    return meta


def restore_banner(name: str, counts: dict[str, Any], steps_redone: list[int], *, journal: int | None = None) -> str:
    """The line a resumed run prints: what it reuses, which steps it trains again, and how
    many siblings it sends out (`siblings_regenerated + siblings_pending`: the dispatches
    the restored groups get)."""
    again, resent, fresh = counts["siblings_regenerated"], counts["siblings_resent"], counts["siblings_pending"]
    redo = "no step to redo"
    if steps_redone:
        first, last = steps_redone
        redo = (f"redo step {first}" if first == last else f"redo steps {first}-{last}") + \
            " (trained after the checkpoint, lost with the process)"
    when = "at the cut" if journal is None else "when the process stopped"
    why = [f"{again - resent} in flight {when}"] if again - resent else []
    why += [f"{resent} waiting after an abandoned or failed attempt"] if resent else []
    kept = "" if journal is None else f"; replayed {journal} journal event(s) after it"
    line = (f"restored {name}{kept}: {redo}; reuse {counts['groups_reused']} finished group(s) and "
            f"{counts['siblings_reused']} sealed sibling(s); dispatch {again + fresh} sibling(s): "
            f"{again} again" + (f" ({', '.join(why)})" if why else "") + f" and {fresh} for the first time; "
            f"re-admit {counts['groups_readmitted']} group(s); {counts['spare_prompts']} spare")
    if counts.get("partial_generations"):
        line += (f"; {counts['partial_generations']} of them continue from {counts['partial_tokens']} token(s) "
                 "generated before the stop")
        if counts.get("turns_reused"):
            line += f" ({counts['turns_reused']} finished turn(s) of multi-turn episodes)"
    if counts["groups_lost"]:
        line += f"; LOST {counts['groups_lost']} group(s) in flight (recovery.mode=cursor_only)"
    return line


def _steps_redone(step: int, trace_path: Path) -> list[int]:
    """[first, last] of the steps an earlier process trained after the restored checkpoint
    (its commits are in the trace, its weights are gone), or [] when none was."""
    last = last_committed_in_trace(trace_path)
    return [step + 1, last] if last is not None and last > step else []


def _resume_here(store: CheckpointStore, restored) -> dict[str, Any] | None:
    """--resume-from an older checkpoint: move the newer ones aside (nothing is deleted),
    then point LATEST at the restored one (the store's protocol)."""
    if restored is None:
        return None
    mine = checkpoint_order(restored.name)
    newer = [n for n in store.list() if checkpoint_order(n) > mine]
    into = store.set_aside(newer)
    if store.latest() != restored.name:
        store.point_latest(restored.name)
    return {"names": newer, "into": into} if newer else None

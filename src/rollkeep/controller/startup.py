"""Starting a run: restore the checkpoint `train` chose (or start fresh), then open what
the run writes. Nothing on disk changes before the restore chain has passed. Where the
run starts from is the core's (`rollkeep.core.restore.start`, which `rollkeep simulate` runs too);
this module adds what only `rollkeep train` has: the config, the trainer, the environment,
the metrics and the progress line.

    restore   the full restore chain on the chosen checkpoint (read-only), the trainer's
              state (bound to the ledger's step), the ledger and the rows; with the
              journal, its tail after LATEST (or after nothing, for a run that never
              checkpointed) read, checked and replayed (`start.prepare`, docs/design.md §5.1)
    then      (`start.begin`) set a journal that belongs to another lineage and newer
              checkpoints (--resume-from) aside, write config.yaml (fresh run), remove leftover temp files,
              open the trace, the metrics and the journal thread, trace `run_started`,
              start the scheduler (it records the run's limits and normalises a restored
              ledger), trace `restored` and say what it reuses
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import ADDED_KEYS, Config, dump_yaml, load_config
from ..config import semantic as semantic_of
from ..core.checkpoint.store import CheckpointStore
from ..core.custody.trace_schema import Restored, RunStarted, TrainerStarted
from ..core.errors import UserInputError
from ..core.restore import chain as restore
from ..core.restore import start
from ..core.restore.chain import restore_chain
from ..core.restore.configdiff import check_compatible, fingerprint, is_allowed
from ..core.rollout.samplers import Limits, check_limits, make_sampler
from ..core.rollout.source import PromptSource
from ..core.schedule import RetryPolicy, Scheduler, Settings, Sinks
from ..envs import LEASE, EnvSpec
from ..progress import RunProgress
from ..trace import Trace, last_committed_in_trace
from ..trainers import Trainer
from .banner import resume_line
from .episodes import check_restored
from .journaling import JournalThread, check_writable
from .metrics import MetricsLog


def limits(cfg: Config) -> Limits:
    """The sampler's limits of `cfg`, checked (exit 2 before anything starts)."""
    return check_limits(cfg.sampler.name, num_prompts_per_step=cfg.train.num_prompts_per_step,
                        window=cfg.sampler.window, max_inflight_prompts=cfg.max_inflight_prompts,
                        max_buffered_rollouts=cfg.max_buffered_rollouts,
                        min_step_batch_fraction=cfg.rollout.min_step_batch_fraction)


def settings(cfg: Config, *, streams: bool = True, evaluates: bool = False, env: EnvSpec | None = None) -> Settings:
    """The scheduler's settings. `streams`: the engine reports tokens as it goes (without
    that no partial generation is recorded or continued); `evaluates`: the run has a
    held-out evaluator, due every eval.every_steps."""
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
        eval_every=cfg.eval.every_steps if evaluates else 0,
        env_phase_s=cfg.env.cut_timeout_s if env is not None and env.recovery == LEASE else None,
        fail_fast_attempts=r.fail_fast_attempts,
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
    evaluates: bool = False,
    crash: Callable[[Any], object] | None = None,
) -> tuple[Scheduler, Trace, MetricsLog, RunProgress, JournalThread | None]:
    """Restore (or start fresh) and open the run; see the module docstring. `evaluates`:
    the run has a held-out evaluator (the scheduler then asks for it every
    eval.every_steps); `crash`: the crash points' ledger sink."""
    run_dir = Path(cfg.run_dir)
    extend_epochs = is_allowed("data.epochs", allow_config_change)
    restored = None
    if resume is not None:
        restored = restore_chain(
            store, name=resume, source=source, config=semantic,
            allow_config_change=allow_config_change, allow_dataset_change=allow_dataset_change,
            extend_epochs=extend_epochs, config_added=ADDED_KEYS, dataset_rows=False)
        load_trainer(trainer, restored)

    def check_config() -> None:  # no checkpoint checked the config: the journaled run's own config.yaml does
        check_compatible(semantic_of(load_config(str(run_dir / "config.yaml"), [])), semantic,
                         allow=allow_config_change, path=str(run_dir / "config.yaml"), added=ADDED_KEYS)

    begun = start.prepare(run_dir, store, source, restored, journaled=cfg.journaled, check_config=check_config,
                          allow_dataset_change=allow_dataset_change, extend_epochs=extend_epochs)
    ledger, rows, prefixes = start.open_state(run_dir, begun, source)
    if env is not None and env.recovery == LEASE:
        prefixes.released = []  # the leases of episodes dropped from here on are released (`Runner`)
    check_restored(prefixes, env, str(store.root / (resume or "")))
    # A run already at (or past) train.total_steps: nothing is written (exit 0 or 2) -- unless
    # the checkpoint resumed is not the one LATEST names (`--resume-from`, the remedy for a
    # missing LATEST): then the start goes on, so that LATEST is pointed at it.
    if begun.resumed and (restored is None or store.latest() == restored.name
                          or ledger.version > cfg.train.total_steps):
        check_steps_left(ledger.version, cfg.train.total_steps, run_dir)
    # Only now that the restore chain (and the journal's tail) passed does anything on disk change,
    # once the journal's directories are known to take its segments (D10).
    if cfg.journaled:
        check_writable(run_dir)
    abandoned = start.begin(run_dir, store, begun, journaled=cfg.journaled)
    if not begun.resumed:
        run_dir.mkdir(parents=True, exist_ok=True)  # `train` made it; a direct caller may not
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    leftovers = store.cleanup_tmp()
    redone = [] if not begun.resumed else _steps_redone(ledger.version, run_dir / "trace.jsonl")
    trace = Trace(run_dir / "trace.jsonl")
    metrics = MetricsLog(run_dir, trace.run_id, tensorboard=cfg.logger.tensorboard)
    with open(run_dir / "config-history.jsonl", "a") as f:
        f.write(json.dumps({"t": time.time(), "run_id": trace.run_id, "config": cfg.to_dict()}) + "\n")
    journal = None
    if cfg.journaled:
        journal = JournalThread(run_dir, next_seq=begun.next_seq, rows=rows, prefixes=prefixes,
                                flush_ms=cfg.journal.flush_ms, flush_events=cfg.journal.flush_events)
        journal.restart(ledger.version, source.identity())
        trace.on_flush = journal.release
    sched = Scheduler(ledger=ledger, rows=rows, source=source, sampler=make_sampler(cfg.sampler.name, limits),
                      settings=settings(cfg, streams=streams, evaluates=evaluates, env=env), prefixes=prefixes,
                      effects=start.open_effects(begun),
                      sinks=Sinks(trace=trace.ledger_event, journal=journal and journal.sink, crash=crash))
    trace.emit(RunStarted(resumed_from_step=ledger.version if begun.resumed else None,
                          checkpoint=None if restored is None else restored.name, pid=os.getpid(),
                          config_fingerprint=fingerprint(semantic), cleaned_tmp=leftovers,
                          abandoned_checkpoints=abandoned))
    info = getattr(trainer, "info", None)  # trainer.world_size > 1: the ranks (started by now)
    trace.emit(TrainerStarted(**info()) if info is not None else
               TrainerStarted(world_size=1, pids=[os.getpid()], backend="in-process"))
    counts = sched.start(begun.continues(), epochs=source.epochs, replayed=begun.tail is not None,
                         lost=None if begun.tail is None else begun.tail.lost)
    progress = RunProgress(cfg.logger.progress, total_steps=cfg.train.total_steps, start_step=ledger.version,
                           verbose=cfg.logger.verbose)
    if leftovers:
        progress.note(f"removed {len(leftovers)} leftover temporary file(s): {', '.join(leftovers)}")
    if abandoned:
        progress.note(f"resuming from {restored.name}: moved the newer checkpoint(s) "
                      f"{', '.join(abandoned['names'])} aside into {abandoned['into']}/")
    if begun.resumed:
        cut_time = restored.meta.cut_time if restored is not None else 0.0
        trace.emit(Restored(checkpoint=None if restored is None else restored.name, step=ledger.version,
                            cut_time=cut_time, **counts, steps_redone=redone, **begun.restored_fields(),
                            config_changes=[] if restored is None else [list(c) for c in restored.config_changes]))
        progress.note(resume_line(step=ledger.version, total_steps=cfg.train.total_steps, steps_redone=redone,
                                  source=f"checkpoint {restored.name}" if restored is not None else "the journal",
                                  groups_lost=counts["groups_lost"], regenerated=counts["siblings_regenerated"]))
        progress.note(restore_banner(restored.name if restored is not None else "the journal", counts, redone,
                                     journal=None if begun.tail is None else begun.tail.events))
    return sched, trace, metrics, progress, journal


class NothingToDo(Exception):
    """The run_dir's run is at train.total_steps already: `train` answers "already
    finished" (exit 0) instead of starting anything. Raised before anything is written."""

    def __init__(self, step: int, run_dir: Path) -> None:
        super().__init__(f"already finished at step {step}")
        self.step, self.run_dir = step, run_dir


def check_steps_left(step: int, total_steps: int, run_dir: Path) -> None:
    """A resumed run at `step`: at train.total_steps there is nothing to do (`NothingToDo`);
    past it, train.total_steps was lowered below what the run has trained (exit 2)."""
    if step == total_steps:
        raise NothingToDo(step, run_dir)
    if step > total_steps:
        raise UserInputError(
            f"train.total_steps is {total_steps}, but the run in {run_dir} is at step {step} already",
            path=str(run_dir), field="train.total_steps",
            expected=f"train.total_steps of at least {step} (a run cannot be shortened below what it trained)",
            found=f"train.total_steps={total_steps}; nothing was run or written",
            remedy=f"give train.total_steps={step} or more to resume (more trains on), or a new run_dir to "
            "start a shorter run")


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



"""Starting a run: restore the checkpoint `train` chose (or start fresh), then open what
the run writes. Nothing on disk changes before the restore chain has passed.

    restore   the full restore chain on the chosen checkpoint (read-only), the trainer's
              state (bound to the ledger's step), the ledger and the rows
    then      set newer checkpoints aside (--resume-from), write config.yaml (fresh run),
              remove leftover temp files, open the trace and the metrics, trace
              `run_started`, start the scheduler (it records the run's limits and
              normalises a restored ledger), trace `restored` and say what it reuses
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ..config import ADDED_KEYS, Config, dump_yaml
from ..core.configdiff import fingerprint, is_allowed
from ..core.ledger import Ledger
from ..core.restore import restore_chain
from ..core.rows import RowStore
from ..core.samplers import Limits, make_sampler
from ..core.schedule import RetryPolicy, Scheduler, Settings
from ..core.source import PromptSource
from ..core.store import CheckpointStore, checkpoint_order
from ..core.trace_schema import Restored, RunStarted
from ..progress import RunProgress
from ..trace import Trace
from ..trainers import Trainer
from ..version import rollkeep_version
from .metrics import MetricsLog
from .rundir import last_committed_in_trace


def settings(cfg: Config) -> Settings:
    r = cfg.rollout
    return Settings(
        seed=cfg.seed, group_size=r.group_size, total_steps=cfg.train.total_steps,
        checkpoint_every=cfg.checkpoint.every_steps, checkpoint_on_shutdown=cfg.checkpoint.on_shutdown,
        deterministic=cfg.deterministic, recovery_mode=cfg.recovery.mode,
        on_dropped_prompt=r.on_dropped_prompt, on_stale=cfg.sampler.on_stale, spare_prompts=r.spare_prompts,
        timeout_s=r.timeout_s, retry=RetryPolicy(r.max_infra_attempts, r.max_data_attempts, r.backoff_ms,
                                                 r.backoff_max_ms),
        scale_rewards=cfg.trainer.scale_rewards,
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
) -> tuple[Scheduler, Trace, MetricsLog, RunProgress]:
    """Restore (or start fresh) and open the run; see the module docstring."""
    run_dir = Path(cfg.run_dir)
    restored = None
    rows = RowStore()
    if resume is not None:
        restored = restore_chain(
            store, name=resume, source=source, config=semantic,
            allow_config_change=allow_config_change, allow_dataset_change=allow_dataset_change,
            extend_epochs=is_allowed("data.epochs", allow_config_change), config_added=ADDED_KEYS)
        trainer.load({n: restored.trainer_file(n) for n in restored.trainer_files()}, step=restored.ledger.version)
        ledger = Ledger.from_state(restored.ledger)
        for rid, row in restored.rows.items():
            rows.put(rid, row)
    else:
        ledger = Ledger(n_rows=source.n_rows, seed=source.seed, epochs=source.epochs)
    # Only now that the restore chain passed does anything on disk change.
    abandoned = _resume_here(store, restored)
    if restored is None:
        run_dir.mkdir(parents=True, exist_ok=True)  # `train` made it; a direct caller may not
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    leftovers = store.cleanup_tmp()
    redone = [] if restored is None else _steps_redone(ledger.version, run_dir / "trace.jsonl")
    trace = Trace(run_dir / "trace.jsonl")
    metrics = MetricsLog(run_dir, trace.run_id, tensorboard=cfg.logger.tensorboard)
    with open(run_dir / "config-history.jsonl", "a") as f:
        f.write(json.dumps({"t": time.time(), "run_id": trace.run_id, "config": cfg.to_dict()}) + "\n")
    sched = Scheduler(ledger=ledger, rows=rows, source=source, sampler=make_sampler(cfg.sampler.name, limits),
                      settings=settings(cfg))
    sched.subscribe(trace.ledger_event)
    trace.emit(RunStarted(resumed_from_step=None if restored is None else ledger.version,
                          checkpoint=None if restored is None else restored.name, pid=os.getpid(),
                          config_fingerprint=fingerprint(semantic), cleaned_tmp=leftovers,
                          abandoned_checkpoints=abandoned))
    counts = sched.start(restored, epochs=source.epochs)
    progress = RunProgress(cfg.logger.progress, total_steps=cfg.train.total_steps, start_step=ledger.version)
    if leftovers:
        progress.note(f"removed {len(leftovers)} leftover temporary file(s): {', '.join(leftovers)}")
    if abandoned:
        progress.note(f"resuming from {restored.name}: moved the newer checkpoint(s) "
                      f"{', '.join(abandoned['names'])} aside into {abandoned['into']}/")
    if restored is not None:
        trace.emit(Restored(checkpoint=restored.name, step=ledger.version,
                            cut_time=restored.manifest.get("cut_time"), **counts, steps_redone=redone,
                            config_changes=[list(c) for c in restored.config_changes]))
        progress.note(restore_banner(restored.name, counts, redone))
    return sched, trace, metrics, progress


def checkpoint_meta(source: PromptSource, semantic: dict[str, Any], run_id: str) -> dict[str, Any]:
    """What every checkpoint of the run records besides custody and the trainer: the
    dataset and the semantic config a restore checks (restore steps 7 and 8), the writer."""
    return {"dataset": {"n_rows": source.n_rows, "seed": source.seed, "epochs": source.epochs,
                        "fingerprint": source.fingerprint()},
            "config": semantic, "config_fingerprint": fingerprint(semantic),
            "rollkeep_version": rollkeep_version(), "run_id": run_id}


def restore_banner(name: str, counts: dict[str, Any], steps_redone: list[int]) -> str:
    """The line a resumed run prints: what it reuses, which steps it trains again, and how
    many siblings it sends out (`siblings_regenerated + siblings_pending`: the dispatches
    the restored groups get)."""
    again, resent, fresh = counts["siblings_regenerated"], counts["siblings_resent"], counts["siblings_pending"]
    redo = "no step to redo"
    if steps_redone:
        first, last = steps_redone
        redo = (f"redo step {first}" if first == last else f"redo steps {first}-{last}") + \
            " (trained after the checkpoint, lost with the process)"
    why = [f"{again - resent} in flight at the cut"] if again - resent else []
    why += [f"{resent} waiting after an abandoned or failed attempt"] if resent else []
    line = (f"restored {name}: {redo}; reuse {counts['groups_reused']} finished group(s) and "
            f"{counts['siblings_reused']} sealed sibling(s); dispatch {again + fresh} sibling(s): "
            f"{again} again" + (f" ({', '.join(why)})" if why else "") + f" and {fresh} for the first time; "
            f"re-admit {counts['groups_readmitted']} group(s); {counts['spare_prompts']} spare")
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

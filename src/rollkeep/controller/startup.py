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
from .metrics import MetricsLog


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
                            cut_time=restored.manifest.get("cut_time"), **counts,
                            config_changes=[list(c) for c in restored.config_changes]))
        lost = counts["groups_lost"]
        progress.note(
            f"restored {restored.name}: reuse {counts['groups_reused']} finished group(s) and "
            f"{counts['siblings_reused']} sealed sibling(s); regenerate {counts['siblings_regenerated']} "
            f"sibling(s); re-admit {counts['groups_readmitted']} group(s); {counts['spare_prompts']} spare"
            + (f"; LOST {lost} group(s) in flight (recovery.mode=cursor_only)" if lost else ""))
    return sched, trace, metrics, progress


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

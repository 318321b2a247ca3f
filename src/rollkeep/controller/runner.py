"""The runner: one asyncio loop that only waits and carries out the scheduler's commands.

Every decision is the scheduler's (`rollkeep.core.schedule`); the runner never reads a
group record. Top to bottom:

  start   restore the checkpoint `train` chose through the full restore chain (read-only:
          a refused restore changes nothing on disk), load the trainer, then change the run
          directory: set newer checkpoints aside (--resume-from), remove leftover temp
          files, open the trace and the metrics, start the scheduler.
  drive   poll the scheduler and carry out each command: generation attempts, train steps
          and refits as tasks, the cut's trainer snapshot right away and its write in the
          background; each task reports its outcome back to the scheduler and wakes the
          loop. Stop when the scheduler says so (the final cut is written by then).
  close   in `finally`, whatever happened: signal handlers, progress, trace, metrics and
          the engine.

Every scheduler call runs on the loop thread, synchronously, with no await inside it;
engine and trainer work happens in tasks and threads between them, so a cut always sees
every owner in one consistent state (DESIGN §3).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ADDED_KEYS, Config, dump_yaml, semantic
from ..core import crashpoints
from ..core.checkpoint import write_checkpoint
from ..core.configdiff import fingerprint, is_allowed
from ..core.errors import FilesystemError
from ..core.events import ALL_EVENTS, DATA, INFRA, Event, event_name
from ..core.ledger import Ledger
from ..core.restore import restore_chain
from ..core.rows import RowStore
from ..core.samplers import check_limits, make_sampler
from ..core.schedule import (
    Cancel,
    Cut,
    Dispatch,
    Failure,
    Generated,
    Note,
    Refit,
    RetryPolicy,
    Scheduler,
    Settings,
    Stop,
    Train,
    WakeAt,
)
from ..core.source import PromptSource
from ..core.store import CheckpointStore, checkpoint_order
from ..engines import DataError, Engine, GenRequest, InfraError
from ..progress import RunProgress
from ..tasks import reward_fn
from ..trace import Trace
from ..trainers import Trainer
from .metrics import MetricsLog, progress_fields, step_record

for _ev in ALL_EVENTS:
    crashpoints.register("ledger." + event_name(_ev))
crashpoints.register("checkpoint.after_cut")
_TRACE_FLUSH_S = 0.05  # buffered trace lines reach the file at least this often


@dataclass(frozen=True)
class RunResult:
    step: int
    weights_sha256: str
    reason: str  # "finished", "data exhausted", "signal"


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


class Runner:
    def __init__(self, cfg: Config, *, source: PromptSource, engine: Engine, trainer: Trainer,
                 resume: str | None = None, allow_config_change: tuple[str, ...] = (),
                 allow_dataset_change: bool = False, on_step: Any = None, evaluator: Any = None) -> None:
        self.cfg, self.source, self.engine, self.trainer = cfg, source, engine, trainer
        self.resume = resume  # the checkpoint to restore (`rundir.start_point`), None = fresh
        self.allow_config_change, self.allow_dataset_change = allow_config_change, allow_dataset_change
        self.on_step, self.evaluator = on_step, evaluator  # callback(step, metrics); held-out eval
        self.run_dir = Path(cfg.run_dir)
        self.store = CheckpointStore(self.run_dir / "checkpoints")
        self.limits = check_limits(cfg.sampler.name, num_prompts_per_step=cfg.train.num_prompts_per_step,
                                   window=cfg.sampler.window, max_inflight_prompts=cfg.max_inflight_prompts,
                                   max_buffered_rollouts=cfg.max_buffered_rollouts,
                                   min_step_batch_fraction=cfg.rollout.min_step_batch_fraction)
        self.semantic = semantic(cfg)
        self.sched: Scheduler | None = None
        self.trace: Trace | None = None  # opened once the restore chain has passed
        self._metrics: MetricsLog | None = None
        self._progress: RunProgress | None = None
        self._wake = asyncio.Event()
        self._tasks: dict[tuple[str, int, int], asyncio.Task] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._t_start = self._last_step = time.perf_counter()
        self._last_eval: dict[str, float] = {}

    # ================================================================== start

    def _start(self) -> None:
        cfg, restored = self.cfg, None
        rows = RowStore()
        if self.resume is not None:
            restored = restore_chain(
                self.store, name=self.resume, source=self.source, config=self.semantic,
                allow_config_change=self.allow_config_change, allow_dataset_change=self.allow_dataset_change,
                extend_epochs=is_allowed("data.epochs", self.allow_config_change), config_added=ADDED_KEYS)
            self.trainer.load({n: restored.trainer_file(n) for n in restored.trainer_files()},
                              step=restored.ledger.version)
            ledger = Ledger.from_state(restored.ledger)
            for rid, row in restored.rows.items():
                rows.put(rid, row)
        else:
            ledger = Ledger(n_rows=self.source.n_rows, seed=self.source.seed, epochs=self.source.epochs)
        # Only now that the restore chain passed does anything on disk change.
        abandoned = self._resume_here(restored)
        if restored is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)  # `train` made it; a direct caller may not
            (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
        leftovers = self.store.cleanup_tmp()
        self.trace = trace = Trace(self.run_dir / "trace.jsonl")
        self._metrics = MetricsLog(self.run_dir, trace.run_id, tensorboard=cfg.logger.tensorboard)
        with open(self.run_dir / "config-history.jsonl", "a") as f:
            f.write(json.dumps({"t": time.time(), "run_id": trace.run_id, "config": cfg.to_dict()}) + "\n")
        self.sched = Scheduler(ledger=ledger, rows=rows, source=self.source,
                               sampler=make_sampler(cfg.sampler.name, self.limits), settings=settings(cfg))
        self.sched.subscribe(trace.ledger_event)
        self.sched.subscribe(_crash_point)
        trace.emit("run_started", resumed_from_step=None if restored is None else ledger.version,
                   checkpoint=None if restored is None else restored.name, pid=os.getpid(),
                   config_fingerprint=fingerprint(self.semantic), cleaned_tmp=leftovers,
                   **({"abandoned_checkpoints": abandoned} if abandoned else {}))
        counts = self.sched.start(restored, epochs=self.source.epochs)
        self._progress = progress = RunProgress(cfg.logger.progress, total_steps=cfg.train.total_steps,
                                                start_step=ledger.version)
        if leftovers:
            progress.note(f"removed {len(leftovers)} leftover temporary file(s): {', '.join(leftovers)}")
        if abandoned:
            progress.note(f"resuming from {restored.name}: moved the newer checkpoint(s) "
                          f"{', '.join(abandoned['names'])} aside into {abandoned['into']}/")
        if restored is not None:
            trace.emit("restored", checkpoint=restored.name, step=ledger.version,
                       cut_time=restored.manifest.get("cut_time"), **counts,
                       config_changes=[list(c) for c in restored.config_changes])
            lost = counts["groups_lost"]
            progress.note(
                f"restored {restored.name}: reuse {counts['groups_reused']} finished group(s) and "
                f"{counts['siblings_reused']} sealed sibling(s); regenerate {counts['siblings_regenerated']} "
                f"sibling(s); re-admit {counts['groups_readmitted']} group(s); {counts['spare_prompts']} spare"
                + (f"; LOST {lost} group(s) in flight (recovery.mode=cursor_only)" if lost else ""))

    def _resume_here(self, restored) -> dict[str, Any] | None:
        """--resume-from an older checkpoint: move the newer ones aside (nothing is
        deleted), then point LATEST at the restored one (the store's protocol)."""
        if restored is None:
            return None
        mine = checkpoint_order(restored.name)
        newer = [n for n in self.store.list() if checkpoint_order(n) > mine]
        into = self.store.set_aside(newer)
        if self.store.latest() != restored.name:
            self.store.point_latest(restored.name)
        return {"names": newer, "into": into} if newer else None

    # ================================================================== drive

    async def run(self) -> RunResult:
        loop = asyncio.get_running_loop()
        try:
            self._start()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self._on_signal)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                reason = await self._drive(loop)
            result = RunResult(self.sched.version, self.trainer.weights_sha256(), reason.value)
            self.trace.emit("run_finished", step=result.step, weights_sha256=result.weights_sha256,
                            reason=result.reason)
            return result
        except BaseException as e:
            self._trace_failure(e)
            raise
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
            await self._close()

    async def _drive(self, loop: asyncio.AbstractEventLoop):
        next_flush = loop.time() + _TRACE_FLUSH_S
        while True:
            wake_at = None
            for cmd in self.sched.poll(loop.time()):
                if isinstance(cmd, Dispatch):
                    self._tasks[cmd.key] = self._tg.create_task(self._generate(cmd.request))
                elif isinstance(cmd, Cancel):
                    for key in cmd.attempts:
                        if (task := self._tasks.pop(key, None)) is not None:
                            task.cancel()
                elif isinstance(cmd, Train):
                    self._tg.create_task(self._train(cmd))
                elif isinstance(cmd, Cut):
                    self._cut(cmd)
                elif isinstance(cmd, Refit):
                    self._tg.create_task(self._refit(cmd.version))
                elif isinstance(cmd, Note):
                    self.trace.emit(cmd.event, **cmd.fields)
                elif isinstance(cmd, WakeAt):
                    wake_at = cmd.time
                elif isinstance(cmd, Stop):
                    self.trace.flush()
                    return cmd.reason
            if loop.time() >= next_flush:
                self.trace.flush()
                next_flush = loop.time() + _TRACE_FLUSH_S
            until = next_flush if wake_at is None else min(wake_at, next_flush)
            with contextlib.suppress(TimeoutError):
                # asyncio.timeout_at, not wait_for: Python 3.11's wait_for can swallow a
                # cancellation that races its timeout, and an aborted run then never ended.
                async with asyncio.timeout_at(until):
                    await self._wake.wait()
            self._wake.clear()

    def _on_signal(self) -> None:
        self.sched.on_signal()
        self._wake.set()

    # ================================================================== commands

    async def _generate(self, req: GenRequest) -> None:
        """One attempt. Only the engine's declared failures are failures: DataError is a
        data failure, InfraError and a lost connection are infra failures (the deadline is
        the scheduler's). Anything else is a bug and stops the run, never a silent retry."""
        key = (req.group_id, req.generation, req.attempt)
        try:
            try:
                completion = await self.engine.generate(req)
                try:
                    reward = float(reward_fn(req.prompt.task)(completion.text, req.prompt.row))
                    outcome = Generated(completion, reward)
                except Exception as e:  # a reward function's error is a data failure (DESIGN §6)
                    outcome = Failure(DATA, f"reward function: {type(e).__name__}: {e}")
            except DataError as e:
                outcome = Failure(DATA, str(e))
            except (InfraError, ConnectionError) as e:
                outcome = Failure(INFRA, f"{type(e).__name__}: {e}")
            self.sched.on_result(key, outcome, asyncio.get_running_loop().time())
        finally:
            self._tasks.pop(key, None)
            self._wake.set()

    async def _train(self, cmd: Train) -> None:
        t0 = time.perf_counter()
        metrics = await asyncio.to_thread(self.trainer.train_step, cmd.batch)
        self.sched.on_trained(cmd.step)
        now = time.perf_counter()
        record = step_record(cmd.batch, metrics, train_seconds=now - t0, step_seconds=now - self._last_step,
                             generated_per_s=self.sched.tokens_generated / max(1e-9, now - self._t_start),
                             counts=self.sched.counts())
        self._last_step = now
        self._metrics.write(cmd.step, record)
        if self.on_step is not None:
            self.on_step(cmd.step, record)
        self._progress.step(cmd.step, progress_fields(record, self._last_eval))
        self._wake.set()

    async def _refit(self, version: int) -> None:
        await self.engine.update_weights(self.trainer.weights(), version)
        every = self.cfg.eval.every_steps
        if self.evaluator is not None and every and version % every == 0:
            t0 = time.perf_counter()
            result = await asyncio.to_thread(self.evaluator.evaluate, self.trainer.weights())
            self._last_eval = result
            self._metrics.write(version, {**result, "eval/seconds": time.perf_counter() - t0})
            self.trace.emit("eval", step=version, **result)
            self._progress.note(f"eval at step {version}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()))
        self.sched.on_refit(version)
        self._wake.set()

    def _cut(self, cmd: Cut) -> None:
        """The cut's trainer half, synchronously (custody was captured by the scheduler in
        the same poll, and no step has trained since); the write goes on in the background."""
        t0 = time.perf_counter()
        snapshot = self.trainer.snapshot()
        snapshot_seconds = time.perf_counter() - t0
        self.trace.flush()  # every commit this checkpoint covers is in the trace first
        crashpoints.hit("checkpoint.after_cut")
        self._tg.create_task(self._write(cmd, snapshot, snapshot_seconds))

    async def _write(self, cmd: Cut, snapshot: Any, snapshot_seconds: float) -> None:
        c, src = cmd.cut, self.source
        meta = {"dataset": {"n_rows": src.n_rows, "seed": src.seed, "epochs": src.epochs,
                            "fingerprint": src.fingerprint()},
                "config": self.semantic, "config_fingerprint": fingerprint(self.semantic),
                "rollkeep_version": _version(), "run_id": self.trace.run_id}

        def work():  # on a worker thread, while the loop keeps going
            t0 = time.perf_counter()
            published = write_checkpoint(self.store, c, trainer_files=snapshot.files(), meta=meta,
                                         keep_last=self.cfg.checkpoint.keep_last, trainer_step=snapshot.step)
            return published, time.perf_counter() - t0

        try:
            published, write_seconds = await asyncio.to_thread(work)
        except OSError as e:  # the store undid what it wrote; the previous checkpoint stands
            raise FilesystemError.of(e, f"publishing the checkpoint of step {cmd.step}") from None
        self.trace.emit("checkpoint_published", step=cmd.step, name=published.name, bytes=published.bytes,
                        cut_hold_seconds=c.hold_seconds,  # custody: ledger capture + row pin
                        trainer_snapshot_seconds=snapshot_seconds,  # weights/optimizer copy
                        write_seconds=write_seconds,  # encode + fsync + publish, off the loop
                        cut_time=c.time)
        self._progress.note(
            f"checkpoint {published.name}: {published.bytes / 1e6:.2f} MB; the cut held the loop "
            f"{c.hold_seconds * 1e6:.0f} us (+{snapshot_seconds * 1e3:.1f} ms trainer copy); "
            f"written in the background in {write_seconds:.2f} s")
        self.sched.on_cut_written(cmd.step)
        self._wake.set()

    # ================================================================== close

    def _trace_failure(self, e: BaseException) -> None:
        """A run stopped by an error keeps its events, and says why (if the trace still
        takes writes: the error may be the trace's own disk)."""
        if self.trace is None or isinstance(e, asyncio.CancelledError):
            return
        leaves = e.exceptions if isinstance(e, BaseExceptionGroup) else (e,)
        error = "; ".join(f"{type(x).__name__}: {x}" for x in leaves)[:2000]
        with contextlib.suppress(OSError, ValueError):
            self.trace.emit("run_failed", step=self.sched.version if self.sched else None, error=error)

    async def _close(self) -> None:
        """Release everything the run holds, each step even if an earlier one fails."""
        try:
            if self._progress is not None:
                self._progress.close()
        finally:
            try:
                if self.trace is not None:
                    with contextlib.suppress(OSError, ValueError):
                        self.trace.close()
            finally:
                try:
                    if self._metrics is not None:
                        self._metrics.close()
                finally:
                    await self.engine.close()


def _crash_point(ev: Event) -> None:
    crashpoints.hit("ledger." + ev.__struct_config__.tag)  # type: ignore[attr-defined]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollkeep")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"

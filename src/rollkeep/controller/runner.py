"""The runner: one asyncio loop that only waits and carries out the scheduler's commands.

Every decision is the scheduler's (`rollkeep.core.schedule`), every protocol the core's:
the start-up (`startup.open_run` over `core.start`: nothing on disk changes before the
restore chain passed), the cut (`core.cutting`), the journal's group commit. The runner
polls the scheduler and carries out each command (attempts, train steps, refits and
evaluations as tasks; a cut's loop part at once, its write in the background); each task
reports back and wakes the loop; in `finally` it releases what the run holds. Every
scheduler call runs on the loop thread with no await inside it, so a cut always sees every
owner in one consistent state (docs/design.md §3).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path
from typing import Any

from ..cluster import EnginePool
from ..config import Config, semantic
from ..core.checkpoint.store import CheckpointStore
from ..core.custody.trace_schema import Eval, RunFailed, RunFinished
from ..core.errors import FilesystemError
from ..core.rollout.source import PromptSource
from ..core.schedule import (
    Cancel,
    Cut,
    Dispatch,
    Evaluate,
    Note,
    Reason,
    Refit,
    Scheduler,
    Stop,
    Train,
    WakeAt,
    crash_point,
    cutting,
)
from ..engines import Engine
from ..engines.base import capabilities_of
from ..envs import LEASE, EnvSpec
from ..progress import RunProgress
from ..trace import Trace
from ..trainers import Trainer
from ..version import rollkeep_version
from .attempts import Attempts
from .build import start_replicas
from .journaling import JournalThread
from .leases import Leases
from .metrics import MetricsLog, StepMeter, progress_fields
from .startup import limits, open_run
from .summary import RunResult, checkpoint_note, error_text, restarts_in_trace, summary_lines
from .usercode import Stopped, UserCode, fail_fast_stop, guarded_save, guarded_step

_TRACE_FLUSH_S = 0.05  # buffered trace lines reach the file at least this often


class Runner:
    def __init__(self, cfg: Config, *, source: PromptSource, engine: Engine, trainer: Trainer,
                 resume: str | None = None, allow_config_change: tuple[str, ...] = (),
                 allow_dataset_change: bool = False, on_step: Any = None, evaluator: Any = None,
                 env: EnvSpec | None = None) -> None:
        self.cfg, self.source, self.engine, self.trainer = cfg, source, engine, trainer
        self.env = env  # a multi-turn environment (`envs.resolve`), None = single-turn
        self.resume = resume  # the checkpoint to restore (`rundir.start_point`), None = fresh
        self.allow_config_change, self.allow_dataset_change = allow_config_change, allow_dataset_change
        self.on_step, self.evaluator = on_step, evaluator  # callback(step, metrics); held-out eval
        self.run_dir = Path(cfg.run_dir)
        self.store = CheckpointStore(self.run_dir / "checkpoints")
        self.limits = limits(cfg)
        self.semantic = semantic(cfg)
        self.sched: Scheduler | None = None
        self.trace: Trace | None = None  # opened once the restore chain has passed
        self._metrics: MetricsLog | None = None
        self._journal: JournalThread | None = None  # journal.enabled: the events between checkpoints
        self._progress: RunProgress | None = None
        self._wake = asyncio.Event()
        self._tasks: dict[tuple[str, int, int], asyncio.Task] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._meter: StepMeter | None = None  # the RL clocks: from `_start`, after the warm start
        self._last_eval: tuple[int | None, dict[str, float]] = (None, {})  # (step, metrics)
        self._signal: str | None = None  # the signal that stopped the run gracefully
        self._failure: str | None = None  # the external failure that stopped it (no engine replica)
        self.user_stop: Stopped | None = None  # user code stopped it: `train` raises its error (exit 2)
        self._code = UserCode(self._on_user_stop)  # the threads of reward functions and environments
        self._leases: Leases | None = None  # an environment that recovers by lease (`_start`)
        self._attempts: Attempts | None = None  # what each Dispatch awaits (`_start`)

    # ================================================================== start and drive

    def _start(self) -> None:
        opened = open_run(self.cfg, store=self.store, source=self.source, trainer=self.trainer,
                          limits=self.limits, semantic=self.semantic, resume=self.resume,
                          allow_config_change=self.allow_config_change,
                          allow_dataset_change=self.allow_dataset_change,
                          streams=capabilities_of(self.engine).streams, env=self.env,
                          evaluates=self.evaluator is not None, crash=crash_point)
        self.sched, self.trace, self._metrics, self._progress, self._journal = opened
        if self.env is not None and self.env.recovery == LEASE:
            self._leases = Leases(self.env, sched=self.sched, code=self._code, trace=self.trace, journal=self._journal,
                                  spawn=lambda coro: self._tg.create_task(coro), wake=self._wake)
        self._attempts = Attempts(self.cfg, engine=self.engine, env=self.env, sched=self.sched, code=self._code,
                                  trace=self.trace, journal=self._journal, leases=self._leases)
        if isinstance(self.engine, EnginePool):
            self.engine.attach(self.trace.emit, self._on_no_replica, trace=self.trace)
        self._meter = StepMeter(time.perf_counter(), self.sched.tokens_generated)  # the RL loop starts now

    async def run(self, *, warmup_seconds: float = 0.0) -> RunResult:
        """Run to the end; `warmup_seconds`, the warm start's time in this process, goes
        into the summary."""
        loop = asyncio.get_running_loop()
        failed = False
        try:
            await start_replicas(self.engine, self.cfg)  # before the restore: it asks whether the engine streams
            self._start()
            first_step = self.sched.version
            _signals(loop, self._on_signal)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                reason = await self._drive(loop)
            self.user_stop = self.user_stop or fail_fast_stop(self.sched)  # the core's fail-fast, if it tripped
            if self._journal is not None:  # its last flush, before anything says the run finished (exit 5 if it fails)
                self._journal.close()
            step, sha = self.sched.version, self.trainer.weights_sha256()
            self.trace.emit(RunFinished(step=step, weights_sha256=sha, reason=reason.value, signal=self._signal,
                                        **(self._journal.stats() if self._journal else {})))
            details = summary_lines(
                step=step, total_steps=self.cfg.train.total_steps, first_step=first_step,
                rl_seconds=time.perf_counter() - self._meter.start, warmup_seconds=warmup_seconds,
                final_eval=self._last_eval, counts=self.sched.counts(),
                restarts=restarts_in_trace(self.trace.path), now=time.time(), run_dir=str(self.run_dir))
            return RunResult(step, sha, reason.value, signal=self._signal, checkpoint=self.store.latest(),
                             details=tuple(details), failure=self._failure)
        except BaseException as e:
            failed = True
            if self.trace is not None and not isinstance(e, asyncio.CancelledError):
                with contextlib.suppress(OSError, ValueError):  # (the error may be the trace's own disk)
                    self.trace.emit(RunFailed(step=self.sched.version if self.sched else None, error=error_text(e)))
            raise
        finally:
            _signals(loop, None)
            await self._close(failed)

    async def _drive(self, loop: asyncio.AbstractEventLoop):
        next_flush = loop.time() + _TRACE_FLUSH_S
        while True:
            if self._journal is not None:
                self._journal.check()  # a failed journal flush stops the run (exit 5), even with no event to sink
            wake_at = None
            cmds = self.sched.poll(loop.time())
            if self._leases is not None:
                self._leases.after_poll()
            for cmd in cmds:
                if isinstance(cmd, Dispatch):
                    self._tasks[cmd.key] = self._tg.create_task(self._generate(cmd))
                elif isinstance(cmd, Cancel):
                    for task in filter(None, (self._tasks.pop(key, None) for key in cmd.attempts)):
                        task.cancel()
                elif isinstance(cmd, Train):
                    self._tg.create_task(self._train(cmd))
                elif isinstance(cmd, Cut):  # its loop part now, right after the poll; the write in the background
                    taken = cutting.take(cmd, snapshot=self.trainer.snapshot, journal=self._journal, trace=self.trace)
                    self._tg.create_task(self._write(taken))
                elif isinstance(cmd, Refit):
                    self._tg.create_task(self._refit(cmd.version))
                elif isinstance(cmd, Evaluate):
                    self._tg.create_task(self._evaluate(cmd.version))
                elif isinstance(cmd, Note):
                    self.trace.emit(cmd.event)
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

    def _on_signal(self, sig: int) -> None:
        self._signal = self._signal or signal.Signals(sig).name
        self.sched.on_signal()
        self._wake.set()

    def _on_user_stop(self, why: Stopped) -> None:
        """User code raised SystemExit or KeyboardInterrupt, or too many of its calls hang:
        stop as for a signal (final checkpoint); `train` then raises `why` (exit 2)."""
        if self._first_stop(why.what, Reason.USER_CODE):
            self.user_stop = why

    def _on_no_replica(self, why: str) -> None:
        """The engine pool has no replica left: stop as for a signal (final checkpoint), exit 5."""
        if self._first_stop(why, Reason.NO_ENGINE):
            self._failure = why

    def _first_stop(self, why: str, reason: Reason) -> bool:
        """Stop for `reason` unless something stopped the run already; True if it stops it."""
        self._wake.set()
        if self._signal is not None or self._failure is not None or self.user_stop is not None:
            return False
        self._progress.note(f"stopping: {why}")
        self.sched.on_signal(reason)
        return True

    # ================================================================== commands

    async def _generate(self, cmd: Dispatch) -> None:
        """One attempt (`attempts.Attempts`), reported: sealed or failed; nothing after a
        user code stop (`_on_user_stop`)."""
        key, sched = cmd.key, self.sched
        try:
            done = await self._attempts.run(cmd)
            if done is None:
                return
            outcome, built = done
            current = sched.ledger.is_current(*key)
            sched.on_result(key, outcome, asyncio.get_running_loop().time())
            if self._leases is not None:
                self._leases.ended(key, built, outcome, current)
        finally:
            self._tasks.pop(key, None)
            self._wake.set()

    async def _train(self, cmd: Train) -> None:
        t0 = time.perf_counter()
        metrics = await asyncio.to_thread(guarded_step(self.trainer.train_step, self.cfg.trainer, cmd.step), cmd.batch)
        self.sched.on_trained(cmd.step)
        record = self._meter.record(cmd.batch, metrics, began=t0, now=time.perf_counter(),
                                    tokens=self.sched.tokens_generated, counts=self.sched.counts(),
                                    pool=self.engine.stats() if isinstance(self.engine, EnginePool) else None)
        record.update(self._attempts.effects.stats() | self._attempts.reward_metrics(cmd.batch))  # effects, reward.fns
        self._metrics.write(cmd.step, record)
        if self.on_step is not None:
            self.on_step(cmd.step, record)
        self._progress.step(cmd.step, progress_fields(record, self._last_eval[1]))
        self._wake.set()

    async def _refit(self, version: int) -> None:
        await self.engine.update_weights(self.trainer.weights(), version)
        self.sched.on_refit(version)
        self._wake.set()

    async def _evaluate(self, version: int) -> None:
        t0 = time.perf_counter()
        result = await asyncio.to_thread(self.evaluator.evaluate, self.trainer.weights())
        self._last_eval = (version, result.metrics)
        self._metrics.write_eval(version, result.metrics, result.samples, time.perf_counter() - t0)
        self.trace.emit(Eval(step=version, accuracy=result.metrics["eval/accuracy"],
                             reward_mean=result.metrics["eval/reward_mean"]))
        self._progress.note(f"eval at step {version}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.metrics.items()))
        self.sched.on_evaluated(version)
        self._wake.set()

    async def _write(self, taken: cutting.TakenCut) -> None:
        step = taken.cmd.step
        meta = cutting.checkpoint_meta(self.source, self.semantic, self.trace.run_id, writer=rollkeep_version(),
                                       journal=taken.position)
        save = guarded_save(taken.snapshot.save, self.cfg.trainer, step)  # a custom trainer's fails as exit 2
        try:  # on a worker thread, while the loop keeps going
            published = await asyncio.to_thread(cutting.write, taken, store=self.store, journal=self._journal,
                                                trace=self.trace, meta=meta, keep_last=self.cfg.checkpoint.keep_last,
                                                trainer_save=save)
        except OSError as e:  # the store undid what it wrote; the previous checkpoint stands
            raise FilesystemError.of(e, f"publishing the checkpoint of step {step}") from None
        self.trace.emit(published)
        self._progress.checkpoint(published.name, checkpoint_note(published), checkpoint_note(published, short=True))
        self.sched.on_cut_written(step)
        self._wake.set()

    # ================================================================== close

    async def _close(self, failed: bool) -> None:
        """Release everything the run holds, each even if another fails (LIFO order). On a
        failed run the journal's own failure does not replace the run's error."""
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(self.engine.close)
            stack.callback(self._code.close)  # idle workers end; abandoned ones are never waited for
            for closable in (self._metrics, self.trace, self._progress):
                if closable is not None:
                    stack.callback(closable.close)
            if self._journal is not None:  # closed first (a finished run closed it before `run_finished`)
                stack.callback(self._journal.close, report=not failed)


def _signals(loop: asyncio.AbstractEventLoop, handler: Any) -> None:
    """SIGINT and SIGTERM to `handler(sig)` (a graceful stop); None: back to the defaults."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, handler, sig) if handler is not None else loop.remove_signal_handler(sig)


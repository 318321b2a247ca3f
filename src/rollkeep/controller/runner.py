"""The runner: one asyncio loop that only waits and carries out the scheduler's commands.

Every decision is the scheduler's (`rollkeep.core.schedule`); the runner never reads a
group record. Top to bottom:

  start   restore the checkpoint `train` chose, or start fresh, and open the run
          (`startup.open_run`: nothing on disk changes before the restore chain passed).
  drive   poll the scheduler and carry out each command: generation attempts, train steps
          and refits as tasks, the cut's trainer snapshot right away and its write in the
          background; each task reports its outcome back to the scheduler and wakes the
          loop. Stop when the scheduler says so (the final cut is written by then).
  close   in `finally`, whatever happened: signal handlers, progress, trace, metrics and
          the engine.

Every scheduler call runs on the loop thread, synchronously, with no await inside it;
engine and trainer work happens in tasks and threads between them, so a cut always sees
every owner in one consistent state (docs/design.md §3).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path
from typing import Any

from ..cluster import EnginePool, ReplicaGone
from ..config import Config, semantic
from ..core import crashpoints
from ..core.checkpoint import write_checkpoint
from ..core.errors import ExternalError, FilesystemError
from ..core.events import ALL_EVENTS, DATA, INFRA, Event, event_name
from ..core.samplers import check_limits
from ..core.schedule import (
    Cancel,
    Cut,
    Dispatch,
    Failure,
    Generated,
    Note,
    Reason,
    Refit,
    Scheduler,
    Stop,
    Train,
    WakeAt,
)
from ..core.source import PromptSource
from ..core.store import CheckpointStore
from ..core.trace_schema import CheckpointPublished, Eval, RunFailed, RunFinished
from ..engines import DataError, Engine, GenRequest, InfraError
from ..envs import EnvSpec
from ..progress import RunProgress
from ..trace import Trace
from ..trainers import Trainer
from .episodes import run_episode
from .journaling import JournalThread
from .metrics import MetricsLog, ReplicaRates, Throughput, progress_fields, step_record
from .startup import checkpoint_meta, open_run
from .summary import RunResult, restarts_in_trace, summary_lines
from .usercode import Stopped, UserCode, UserStop, guarded_save, guarded_step, score

for _ev in ALL_EVENTS:
    crashpoints.register("ledger." + event_name(_ev))
crashpoints.register("checkpoint.after_cut")
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
        self.limits = check_limits(cfg.sampler.name, num_prompts_per_step=cfg.train.num_prompts_per_step,
                                   window=cfg.sampler.window, max_inflight_prompts=cfg.max_inflight_prompts,
                                   max_buffered_rollouts=cfg.max_buffered_rollouts,
                                   min_step_batch_fraction=cfg.rollout.min_step_batch_fraction)
        self.semantic = semantic(cfg)
        self.sched: Scheduler | None = None
        self.trace: Trace | None = None  # opened once the restore chain has passed
        self._metrics: MetricsLog | None = None
        self._journal: JournalThread | None = None  # journal.enabled: the events between checkpoints
        self._progress: RunProgress | None = None
        self._wake = asyncio.Event()
        self._tasks: dict[tuple[str, int, int], asyncio.Task] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._t_start = self._last_step = 0.0  # the RL clocks: `_start`, after the warm start
        self._throughput: Throughput | None = None
        self._last_eval: tuple[int | None, dict[str, float]] = (None, {})  # (step, metrics)
        self._signal: str | None = None  # the signal that stopped the run gracefully
        self._failure: str | None = None  # the external failure that stopped it (no engine replica)
        self.user_stop: Stopped | None = None  # user code stopped it: `train` raises its error (exit 2)
        self._code = UserCode(self._on_user_stop)  # the threads of reward functions and environments
        self._replica_rates = ReplicaRates()  # metrics per engine replica (an engine pool's)

    # ================================================================== start

    async def _open_engine(self) -> None:
        """Start the engine replicas (`cluster.backend: ray`): before the restore, which
        needs to know whether the engine streams."""
        if isinstance(self.engine, EnginePool):
            try:
                await self.engine.open()
            except ReplicaGone as e:
                raise ExternalError(
                    "the engine replicas did not start", field="engine.replicas",
                    expected=f"{self.cfg.engine.replicas} replica(s) of engine {self.cfg.engine.name} on Ray",
                    found=str(e), remedy="check the Ray cluster's resources (cluster.replica_cpus, "
                    "cluster.replica_gpus) and the engine's own errors above; nothing was changed") from None

    def _start(self) -> None:
        opened = open_run(self.cfg, store=self.store, source=self.source, trainer=self.trainer,
                          limits=self.limits, semantic=self.semantic, resume=self.resume,
                          allow_config_change=self.allow_config_change,
                          allow_dataset_change=self.allow_dataset_change,
                          streams=getattr(self.engine, "streams", False), env=self.env)
        self.sched, self.trace, self._metrics, self._progress, self._journal = opened
        self.sched.subscribe(_crash_point)
        if isinstance(self.engine, EnginePool):
            self.engine.attach(self.trace.emit, self._on_no_replica)
        # The RL loop starts now: step 1's `step_seconds` and the throughput count from here.
        self._t_start = self._last_step = time.perf_counter()
        self._throughput = Throughput(self._t_start, self.sched.tokens_generated)

    # ================================================================== drive

    async def run(self, *, warmup_seconds: float = 0.0) -> RunResult:
        """Run to the end; `warmup_seconds`, the warm start's time in this process, goes
        into the summary."""
        loop = asyncio.get_running_loop()
        failed = False
        try:
            await self._open_engine()
            self._start()
            first_step = self.sched.version
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self._on_signal, sig)
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                reason = await self._drive(loop)
            if self._journal is not None:  # its last flush, before anything says the run finished (exit 5 if it fails)
                self._journal.close()
            step, sha = self.sched.version, self.trainer.weights_sha256()
            self.trace.emit(RunFinished(step=step, weights_sha256=sha, reason=reason.value,
                                        **(self._journal.stats() if self._journal else {})))
            details = summary_lines(
                step=step, total_steps=self.cfg.train.total_steps, first_step=first_step,
                rl_seconds=time.perf_counter() - self._t_start, warmup_seconds=warmup_seconds,
                final_eval=self._last_eval, counts=self.sched.counts(),
                restarts=restarts_in_trace(self.trace.path), now=time.time(), run_dir=str(self.run_dir))
            return RunResult(step, sha, reason.value, signal=self._signal, checkpoint=self.store.latest(),
                             details=tuple(details), failure=self._failure)
        except BaseException as e:
            failed = True
            self._trace_failure(e)
            raise
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
            await self._close(failed)

    async def _drive(self, loop: asyncio.AbstractEventLoop):
        next_flush = loop.time() + _TRACE_FLUSH_S
        while True:
            if self._journal is not None:
                self._journal.check()  # a failed journal flush stops the run (exit 5), even with no event to sink
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
        if self._signal is None and self._failure is None and self.user_stop is None:
            self.user_stop = why
            self._progress.note(f"stopping: {why.what}")
            self.sched.on_signal(Reason.USER_CODE)
        self._wake.set()

    def _on_no_replica(self, why: str) -> None:
        """The engine pool has no replica left: stop as for a signal (final checkpoint), exit 5."""
        if self._signal is None and self._failure is None:
            self._failure = why
            self._progress.note(f"stopping: {why}")
            self.sched.on_signal(Reason.NO_ENGINE)
        self._wake.set()

    # ================================================================== commands

    async def _generate(self, req: GenRequest) -> None:
        """One attempt. Only the engine's declared failures are failures: DataError is a
        data failure (an environment's or reward's too), InfraError and a lost connection are
        infra failures (the deadline is the scheduler's). Anything else is a bug and stops
        the run, never a silent retry; UserStop reports nothing (the stop abandons it)."""
        key = (req.group_id, req.generation, req.attempt)
        loop, sched = asyncio.get_running_loop(), self.sched
        # Chunks go to the scheduler when the engine streams and the journal is on.
        progress = (lambda c: sched.on_progress(key, c, loop.time())) if sched.partial.enabled else None
        try:
            try:
                if self.env is not None:  # a multi-turn episode: the environment gives the reward
                    completion, reward = await run_episode(
                        self.engine, self.env, req, progress,
                        lambda traj, turn, snapshot: sched.on_turn(key, traj, turn, snapshot), code=self._code)
                else:
                    completion = await (self.engine.generate(req, progress) if progress is not None
                                        else self.engine.generate(req))
                    reward = await score(self._code, self.cfg.reward, req.prompt, completion)
                outcome = Generated(completion, reward, completion.replica)
            except UserStop:
                return  # the run is stopping (`_on_user_stop`)
            except DataError as e:
                outcome = Failure(DATA, str(e), e.replica)
            except (InfraError, ConnectionError) as e:
                outcome = Failure(INFRA, f"{type(e).__name__}: {e}", getattr(e, "replica", 0))
            sched.on_result(key, outcome, loop.time())
        finally:
            self._tasks.pop(key, None)
            self._wake.set()

    async def _train(self, cmd: Train) -> None:
        t0 = time.perf_counter()
        metrics = await asyncio.to_thread(guarded_step(self.trainer.train_step, self.cfg.trainer, cmd.step), cmd.batch)
        self.sched.on_trained(cmd.step)
        now = time.perf_counter()
        record = step_record(cmd.batch, metrics, train_seconds=now - t0, step_seconds=now - self._last_step,
                             generated_per_s=self._throughput.step(now, self.sched.tokens_generated),
                             counts=self.sched.counts())
        if isinstance(self.engine, EnginePool):
            record.update(self._replica_rates.step(self.engine.stats(), now - self._last_step))
        self._last_step = now
        self._metrics.write(cmd.step, record)
        if self.on_step is not None:
            self.on_step(cmd.step, record)
        self._progress.step(cmd.step, progress_fields(record, self._last_eval[1]))
        self._wake.set()

    async def _refit(self, version: int) -> None:
        await self.engine.update_weights(self.trainer.weights(), version)
        every = self.cfg.eval.every_steps
        if self.evaluator is not None and every and version % every == 0:
            t0 = time.perf_counter()
            result = await asyncio.to_thread(self.evaluator.evaluate, self.trainer.weights())
            self._last_eval = (version, result.metrics)
            self._metrics.write(version, {**result.metrics, "eval/seconds": time.perf_counter() - t0})
            self._metrics.write_samples(version, result.samples)  # samples.jsonl: text stays out of metrics
            self.trace.emit(Eval(step=version, accuracy=result.metrics["eval/accuracy"],
                                 reward_mean=result.metrics["eval/reward_mean"]))
            self._progress.note(f"eval at step {version}: "
                                + ", ".join(f"{k} {v:.3f}" for k, v in result.metrics.items()))
        self.sched.on_refit(version)
        self._wake.set()

    def _cut(self, cmd: Cut) -> None:
        """The atomic cut, synchronously right after the poll that asked for it (no step
        trains in between): custody (O(1)) and the trainer's snapshot; the write goes on in
        the background."""
        captured = self.sched.capture()
        position = None if self._journal is None else self._journal.position()
        t0 = time.perf_counter()
        snapshot = self.trainer.snapshot()
        snapshot_seconds = time.perf_counter() - t0
        self.trace.flush()  # every commit this checkpoint covers is in the trace first
        crashpoints.hit("checkpoint.after_cut")
        self._tg.create_task(self._write(cmd, captured, snapshot, snapshot_seconds, position))

    async def _write(self, cmd: Cut, c: Any, snapshot: Any, snapshot_seconds: float, position: Any) -> None:
        meta = checkpoint_meta(self.source, self.semantic, self.trace.run_id, journal=position)
        save = guarded_save(snapshot.save, self.cfg.trainer, cmd.step)  # a custom trainer's fails as exit 2

        def work():  # on a worker thread, while the loop keeps going
            t0 = time.perf_counter()
            # No checkpoint covers a commit the durable trace lacks (docs/design.md §8): fsync
            # what `_cut` flushed before the commit point, one fsync per checkpoint. It touches
            # the open file only, not the trace's buffer, so the loop may go on emitting.
            self.trace.sync_flushed()
            with contextlib.nullcontext() if position is None else self._journal.covering(position, self.store):
                published = write_checkpoint(self.store, c, trainer_save=save, meta=meta,
                                             keep_last=self.cfg.checkpoint.keep_last, trainer_step=snapshot.step)
            return published, time.perf_counter() - t0

        try:
            published, write_seconds = await asyncio.to_thread(work)
        except OSError as e:  # the store undid what it wrote; the previous checkpoint stands
            raise FilesystemError.of(e, f"publishing the checkpoint of step {cmd.step}") from None
        self.trace.emit(CheckpointPublished(
            step=cmd.step, name=published.name, bytes=published.bytes, cut_hold_seconds=c.hold_seconds,
            trainer_snapshot_seconds=snapshot_seconds, write_seconds=write_seconds, cut_time=c.time))
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
            self.trace.emit(RunFailed(step=self.sched.version if self.sched else None, error=error))

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


def _crash_point(ev: Event) -> None:
    crashpoints.hit("ledger." + ev.__struct_config__.tag)  # type: ignore[attr-defined]

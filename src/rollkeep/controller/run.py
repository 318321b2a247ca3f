"""The single controller: a rollout pump and a train pump on one asyncio loop.

Read top to bottom, in execution order:

  start     restore the checkpoint `train` chose (LATEST, or --resume-from) through the
            full restore chain (read-only: a refused restore changes nothing on disk), or
            start fresh; then remove leftover temp files, record the run's limits in the
            ledger (`configured`) and sync the engine to the trainer's weights.
  pumps     both in one TaskGroup (a failure in one stops the other):
            rollout  admit restored RESERVED groups, take new prompts while the sampler's
                     gate is open, dispatch unsealed siblings (restored ADMITTED groups
                     first: they have the lowest keys), seal or fail results as they
                     arrive, finalize complete groups.
            train    wait for the sampler's batch for the next step, claim it, train in a
                     worker thread, commit, checkpoint at the step boundary, refit.
  stop      abandon what is still generating, write a final checkpoint (a revision of
            the last one if the state changed since it), trace the end; close the
            engine, the trace and the metrics whatever happened.

Every ledger transition runs here on the loop thread with no await inside it; engine and
trainer work happens in tasks and threads between transitions. A checkpoint's cut is
synchronous, so it sees all owners in one consistent state (DESIGN §3).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..advantages import stored_advantages
from ..config import ADDED_KEYS, Config, dump_yaml, semantic
from ..core import crashpoints
from ..core.checkpoint import Cut, cut, write_checkpoint
from ..core.configdiff import fingerprint, is_allowed
from ..core.errors import CustodyError, FilesystemError
from ..core.events import (
    ALL_EVENTS,
    DATA,
    INFRA,
    PROMPT_GROUP,
    SIBLING,
    Abandoned,
    Admitted,
    Claimed,
    Configured,
    Dispatched,
    Event,
    Evicted,
    Failed,
    Finalizing,
    Ready,
    Sealed,
    event_name,
)
from ..core.handout import check_step_size, drop_event, spare_event, take_event
from ..core.keys import group_id
from ..core.ledger import AttemptStatus, GroupState, Ledger
from ..core.restore import restore_chain
from ..core.rows import Row, RowId, RowStore
from ..core.samplers import check_limits, make_sampler
from ..core.source import PromptSource
from ..core.store import CheckpointStore, checkpoint_order
from ..engines import Completion, DataError, Engine, GenRequest, InfraError, sampling_seed
from ..progress import RunProgress
from ..tasks import reward_fn
from ..trace import Trace
from ..trainers import Batch, Trainer, TrainGroup
from .metrics import MetricsLog

for _ev in ALL_EVENTS:
    crashpoints.register("ledger." + event_name(_ev))
for _point in ("train.before_commit", "train.after_commit", "checkpoint.after_cut"):
    crashpoints.register(_point)


LOST_REASON = "lost in flight at the cut (recovery.mode=cursor_only)"


@dataclass(frozen=True)
class RunResult:
    step: int
    weights_sha256: str
    reason: str  # "finished", "data exhausted", "signal"


class Controller:
    def __init__(
        self,
        cfg: Config,
        *,
        source: PromptSource,
        engine: Engine,
        trainer: Trainer,
        resume: str | None = None,
        allow_config_change: tuple[str, ...] = (),
        allow_dataset_change: bool = False,
        on_step: Any = None,
        evaluator: Any = None,
    ) -> None:
        self.cfg = cfg
        self.source = source
        self.engine = engine
        self.trainer = trainer
        self.run_dir = Path(cfg.run_dir)
        self.store = CheckpointStore(self.run_dir / "checkpoints")
        self.resume = resume  # the checkpoint to restore (`rundir.start_point`), None = fresh
        self.trace: Trace | None = None  # opened once the restore chain has passed: a refused restore writes nothing
        self._metrics: MetricsLog | None = None
        self.rows = RowStore()
        self.limits = check_limits(
            cfg.sampler.name,
            num_prompts_per_step=cfg.train.num_prompts_per_step,
            window=cfg.sampler.window,
            max_inflight_prompts=cfg.max_inflight_prompts,
            max_buffered_rollouts=cfg.max_buffered_rollouts,
            min_step_batch_fraction=cfg.rollout.min_step_batch_fraction,
        )
        self.sampler = make_sampler(cfg.sampler.name, self.limits)
        self.semantic = semantic(cfg)
        # cursor_only emulates systems without a ledger; its groups are plain sibling groups.
        self._granularity = PROMPT_GROUP if cfg.recovery.mode == "prompt_group" else SIBLING
        self.allow_config_change = allow_config_change
        self.allow_dataset_change = allow_dataset_change
        self.on_step = on_step  # callback(step, metrics), e.g. for tests and notebooks
        self.evaluator = evaluator  # greedy accuracy on the held-out set, or None
        self.ledger: Ledger
        self.stopping: str | None = None
        self._wake_rollout = asyncio.Event()
        self._wake_train = asyncio.Event()
        self._gen_tasks: dict[tuple[str, int, int], asyncio.Task] = {}
        self._not_before: dict[tuple[str, int], float] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._write_task: asyncio.Task | None = None
        self._changed_since_cut = True  # custody events since the last cut (False: nothing to write)
        self._progress: RunProgress | None = None
        self._t_start = time.perf_counter()
        self._last_eval: dict[str, float] = {}
        self._tokens_generated = 0
        self._last_step_time = time.perf_counter()

    # ================================================================== start

    def _start(self) -> None:
        cfg = self.cfg
        restored = None
        if self.resume is not None:
            restored = restore_chain(
                self.store,
                name=self.resume,
                source=self.source,
                config=self.semantic,
                allow_config_change=self.allow_config_change,
                allow_dataset_change=self.allow_dataset_change,
                extend_epochs=is_allowed("data.epochs", self.allow_config_change),
                config_added=ADDED_KEYS,
            )
            self.trainer.load(
                {name: restored.trainer_file(name) for name in restored.trainer_files()},
                step=restored.ledger.version,
            )
            self.ledger = Ledger.from_state(restored.ledger)
            for rid, row in restored.rows.items():
                self.rows.put(rid, row)
        else:
            self.ledger = Ledger(n_rows=self.source.n_rows, seed=self.source.seed, epochs=self.source.epochs)
        # Only now that the restore chain passed does anything on disk change.
        abandoned = self._resume_here(restored)
        if restored is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)  # `train` made it; a direct caller may not
            (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
        leftovers = self.store.cleanup_tmp()
        self.trace = Trace(self.run_dir / "trace.jsonl")
        self._metrics = MetricsLog(self.run_dir, self.trace.run_id, tensorboard=cfg.logger.tensorboard)
        with open(self.run_dir / "config-history.jsonl", "a") as f:
            f.write(json.dumps({"t": time.time(), "run_id": self.trace.run_id, "config": cfg.to_dict()}) + "\n")
        self.ledger.subscribe(self.trace.ledger_event)
        self.ledger.subscribe(self._on_ledger_event)
        self.trace.emit(
            "run_started",
            resumed_from_step=None if restored is None else self.ledger.version,
            checkpoint=None if restored is None else restored.name,
            pid=os.getpid(),
            config_fingerprint=fingerprint(self.semantic),
            cleaned_tmp=leftovers,
            **({"abandoned_checkpoints": abandoned} if abandoned else {}),
        )
        # The limits this run holds the ledger to (I5, I6), and an extended data.epochs.
        self.ledger.apply(Configured(num_prompts_per_step=cfg.train.num_prompts_per_step,
                                     window=self.limits.window, epochs=self.source.epochs))
        self._progress = RunProgress(cfg.logger.progress, total_steps=cfg.train.total_steps, start_step=self.ledger.version)
        if leftovers:
            self._progress.note(f"removed {len(leftovers)} leftover temporary file(s): {', '.join(leftovers)}")
        if abandoned:
            self._progress.note(f"resuming from {restored.name}: moved the newer checkpoint(s) "
                                f"{', '.join(abandoned['names'])} aside into {abandoned['into']}/")
        if restored is not None:
            self._restart_from(restored)
        self._changed_since_cut = False  # the state is the restored checkpoint's (or empty)

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

    def _restart_from(self, restored) -> None:
        """Normalise the restored ledger (DESIGN §5) and say what the restart reuses."""
        for ev in self.ledger.normalize_for_restart():
            self._free(self.ledger.apply(ev))
        p = restored.plan
        lost = 0
        if self.cfg.recovery.mode == "cursor_only":
            lost = self._lose_inflight()
            # Nothing of the lost groups is reused or regenerated: only REPLAY survives.
            p = dataclasses.replace(p, groups_finalize_again=0, siblings_reused=0, siblings_discarded=0,
                                    siblings_regenerated=0, siblings_pending=0, groups_readmitted=0)
        self.trace.emit(
            "restored",
            checkpoint=restored.name,
            step=self.ledger.version,
            cut_time=restored.manifest.get("cut_time"),
            groups_reused=p.groups_reused,
            groups_finalize_again=p.groups_finalize_again,
            siblings_reused=p.siblings_reused,
            siblings_regenerated=p.siblings_regenerated + p.siblings_discarded,
            siblings_pending=p.siblings_pending,
            groups_readmitted=p.groups_readmitted,
            spare_prompts=p.spare_prompts,
            groups_lost=lost,
            recovery_mode=self.cfg.recovery.mode,
            config_changes=[list(c) for c in restored.config_changes],
        )
        self._progress.note(
            f"restored {restored.name}: reuse {p.groups_reused} finished group(s) and "
            f"{p.siblings_reused} sealed sibling(s); regenerate "
            f"{p.siblings_regenerated + p.siblings_discarded} sibling(s); re-admit "
            f"{p.groups_readmitted} group(s); {p.spare_prompts} spare"
            + (f"; LOST {lost} group(s) in flight (recovery.mode=cursor_only)" if lost else "")
        )
        # Groups sealed but not finalized at the cut are finalized again (no side effects).
        for gid, rec in self.ledger.groups():
            if rec.state == GroupState.READY_TO_FINALIZE:
                self._finalize(gid)

    # ================================================================== run

    async def run(self) -> RunResult:
        loop = asyncio.get_running_loop()
        try:
            self._start()
            await self.engine.update_weights(self.trainer.weights(), self.ledger.version)
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self.stop, "signal")
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                rollout = tg.create_task(self._rollout_pump())
                train = tg.create_task(self._train_pump())
                tg.create_task(self._flush_trace(rollout, train))
            self._abandon_inflight("shutdown")
            if (self.stopping != "signal" or self.cfg.checkpoint.on_shutdown) and self._can_cut():
                await self._write(*self._cut())
            result = RunResult(self.ledger.version, self.trainer.weights_sha256(), self.stopping or "finished")
            self.trace.emit("run_finished", step=result.step, weights_sha256=result.weights_sha256, reason=result.reason)
            return result
        except BaseException as e:
            self._trace_failure(e)
            raise
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(sig)
            await self._close()

    def _trace_failure(self, e: BaseException) -> None:
        """A run stopped by an error keeps its events, and says why (if the trace still
        takes writes: the error may be the trace's own disk)."""
        if self.trace is None or isinstance(e, asyncio.CancelledError):
            return
        leaves = e.exceptions if isinstance(e, BaseExceptionGroup) else (e,)
        error = "; ".join(f"{type(x).__name__}: {x}" for x in leaves)[:2000]
        with contextlib.suppress(OSError, ValueError):
            self.trace.emit("run_failed", step=self.ledger.version, error=error)

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

    def stop(self, reason: str) -> None:
        """Ask both pumps to stop (SIGINT/SIGTERM, the end of training, exhausted data)."""
        if self.stopping is None:
            self.stopping = reason
        self._wake_rollout.set()
        self._wake_train.set()

    async def _wait(self, event: asyncio.Event, until: float | None = None) -> None:
        """Sleep until `event` is set (a ledger change) or loop time `until` (a backoff).

        `asyncio.timeout_at`, not `wait_for`: Python 3.11's wait_for can swallow a
        cancellation that races with its timeout, and then a pump whose TaskGroup was
        aborted (a failed checkpoint write) kept looping and the run hung forever."""
        if until is None:
            await event.wait()
        else:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(until):
                    await event.wait()
        event.clear()

    def _on_ledger_event(self, ev: Event) -> None:
        if not isinstance(ev, Configured):  # limits alone give a checkpoint nothing new
            self._changed_since_cut = True
        self._wake_rollout.set()
        self._wake_train.set()
        crashpoints.hit("ledger." + ev.__struct_config__.tag)  # type: ignore[attr-defined]

    def _free(self, freed) -> None:
        for gid, g, attempt in freed:
            self.rows.delete(RowId(gid, g, attempt))

    async def _flush_trace(self, *pumps: asyncio.Task) -> None:
        """Flush buffered trace lines every 50 ms until both pumps are done."""
        while not all(p.done() for p in pumps):
            await asyncio.wait(pumps, timeout=0.05)
            self.trace.flush()

    # ================================================================== rollout pump

    async def _rollout_pump(self) -> None:
        async with asyncio.TaskGroup() as generation:
            while not self.stopping:
                self._top_up_spare()
                self._admit_and_take()
                wake_at = self._dispatch(generation)
                await self._wait(self._wake_rollout, wake_at)
            for task in list(self._gen_tasks.values()):
                task.cancel()

    def _lose_inflight(self) -> int:
        """recovery.mode=cursor_only: what a system without a ledger does on restore. Its
        checkpoint holds the source cursor and finished groups only, so every group still
        in flight at the cut is gone; the source has moved past it and the step is filled
        from later prompts. Here the loss is recorded (DROPPED, reason "lost ..."), so the
        trace and `rollkeep chaos` show it instead of hiding it."""
        lost = [g for g, r in self.ledger.groups() if r.state < GroupState.READY]
        for gid in sorted(lost, key=lambda g: self.ledger.group(g).key):
            self._drop(gid, LOST_REASON, on_dropped_prompt="replace")
        return len(lost)

    def _top_up_spare(self) -> None:
        while len(self.ledger.spare) < self.cfg.rollout.spare_prompts:
            ev = spare_event(self.ledger)
            if ev is None:
                return
            self.ledger.apply(ev)

    def _pinned_version(self, target_step: int | None) -> int:
        """Deterministic mode: the weight version a step's groups generate under (§7)."""
        return max(0, target_step - 1 - self.limits.window)

    def _step_wanted(self, target: int | None) -> bool:
        return target is None or target <= self.cfg.train.total_steps

    def _more_wanted(self) -> bool:
        """Unstamped samplers: stop taking once the remaining steps are covered."""
        if self.sampler.stamps:
            return True
        remaining = self.cfg.train.total_steps - self.ledger.version
        return len(self.ledger) < remaining * self.limits.num_prompts_per_step

    def _admit_and_take(self) -> None:
        """Restored RESERVED groups first, then new prompts (spare pool, then source)."""
        led, sampler = self.ledger, self.sampler
        for gid in led.reserved_ids():
            ok, target = sampler.admission(led, new=False)
            if not ok or not self._step_wanted(target):
                return
            led.apply(Admitted(group_id=gid, target_step=target, version=self._start_version(target)))
        while True:
            ok, target = sampler.admission(led)
            if not ok or not self._step_wanted(target) or not self._more_wanted():
                return
            taken = take_event(led, self.source, group_size=self.cfg.rollout.group_size,
                               granularity=self._granularity)
            if taken is None:
                return
            led.apply(taken)
            gid = group_id((taken.epoch, taken.ordinal))
            led.apply(Admitted(group_id=gid, target_step=target, version=self._start_version(target)))

    def _start_version(self, target: int | None) -> int:
        if self.cfg.deterministic:
            return self._pinned_version(target)
        return self.ledger.version

    def _dispatch(self, generation: asyncio.TaskGroup) -> float | None:
        """Dispatch every RESERVED sibling of admitted groups whose backoff has passed.
        Returns the loop time of the next backoff expiry, if any is pending."""
        led = self.ledger
        now = asyncio.get_running_loop().time()
        wake_at = None
        for gid in led.pending_ids():
            rec = led.group(gid)
            pinned = None
            if self.cfg.deterministic:
                pinned = self._pinned_version(rec.target_step)
                if self.engine.version != pinned:
                    if self.engine.version > pinned:
                        raise CustodyError(
                            f"deterministic mode: group {gid} of step {rec.target_step} would "
                            f"generate under version {self.engine.version}",
                            expected=f"version {pinned}",
                            found=f"engine at version {self.engine.version}",
                            remedy="this is a bug in the controller's refit ordering",
                        )
                    continue  # waits for the refit to its pinned version
            gens = []
            for g in rec.generations_with(AttemptStatus.RESERVED):
                nb = self._not_before.get((gid, g))
                if nb is not None and nb > now:
                    wake_at = nb if wake_at is None else min(wake_at, nb)
                    continue
                gens.append(g)
            if not gens:
                continue
            led.apply(Dispatched(group_id=gid, generations=tuple(gens), version=self.engine.version))
            rec = led.group(gid)
            prompt = self.source.rehydrate(rec.key)
            for g in gens:
                self._not_before.pop((gid, g), None)
                req = GenRequest(
                    group_id=gid,
                    generation=g,
                    attempt=rec.attempts[g],
                    prompt=prompt,
                    seed=sampling_seed(self.cfg.seed, gid, g, rec.data_failures[g]),
                    version=pinned,
                    infra_retries=rec.infra_failures[g],
                    data_retries=rec.data_failures[g],
                )
                key = (gid, g, req.attempt)
                self._gen_tasks[key] = generation.create_task(self._generate(req))
        return wake_at

    async def _generate(self, req: GenRequest) -> None:
        """One attempt, within its deadline. Only the engine's declared failures are
        retried: DataError is a data failure; InfraError, the deadline passing and a lost
        connection are infra failures. Anything else is a bug and stops the run (the CLI
        exits 1 with its traceback), never a silent retry that burns the budgets."""
        key = (req.group_id, req.generation, req.attempt)
        timeout = self.cfg.rollout.timeout_s
        try:
            kind, error, completion = None, "", None
            try:
                async with asyncio.timeout(timeout):
                    completion = await self.engine.generate(req)
            except DataError as e:
                kind, error = DATA, str(e)
            except TimeoutError:
                kind, error = INFRA, f"deadline: no result within rollout.timeout_s={timeout:g} s"
            except (InfraError, ConnectionError) as e:
                kind, error = INFRA, f"{type(e).__name__}: {e}"
            self._on_result(req, completion, kind, error)
        finally:
            self._gen_tasks.pop(key, None)

    def _on_result(self, req: GenRequest, completion: Completion | None, kind: str | None, error: str) -> None:
        """Seal or fail one sibling (synchronous: one transition, plus finalize or drop)."""
        led = self.ledger
        gid, g, attempt = req.group_id, req.generation, req.attempt
        if not led.is_current(gid, g, attempt):
            return  # a result for an attempt abandoned meanwhile (its group was reset)
        reward = 0.0
        if completion is not None:
            try:
                reward = float(reward_fn(req.prompt.task)(completion.text, req.prompt.row))
                if not math.isfinite(reward):
                    raise ValueError(f"returned {reward} (rewards must be finite)")
            except Exception as e:
                kind, error = DATA, f"reward function: {type(e).__name__}: {e}"
        if kind is None:
            row = Row(
                prompt_ids=completion.prompt_ids,
                completion_ids=completion.completion_ids,
                logprobs=completion.logprobs,
                versions=completion.versions,
                reward=reward,
                finish_reason=completion.finish_reason,
            )
            self.rows.put(RowId(gid, g, attempt), row)
            version = int(row.versions.max()) if row.tokens else self.engine.version
            led.apply(Sealed(group_id=gid, generation=g, attempt=attempt, version=version, tokens=row.tokens))
            self._tokens_generated += row.tokens
            if led.group(gid).state == GroupState.READY_TO_FINALIZE:
                self._finalize(gid)
            return
        self._free(led.apply(Failed(group_id=gid, generation=g, attempt=attempt, kind=kind, error=error[:500])))
        rec = led.group(gid)
        rollout = self.cfg.rollout
        spent = (
            rec.infra_failures[g] >= rollout.max_infra_attempts
            if kind == INFRA
            else rec.data_failures[g] >= rollout.max_data_attempts
        )
        if spent:
            self._drop(gid, f"{kind} budget spent ({error[:200]})")
            return
        # All-or-nothing groups just abandoned their other siblings: stop their work.
        for (tgid, tg_gen, tatt), task in list(self._gen_tasks.items()):
            if tgid == gid and not led.is_current(tgid, tg_gen, tatt):
                task.cancel()
        failures = rec.infra_failures[g] + rec.data_failures[g]
        delay_ms = min(rollout.backoff_ms * 2 ** (failures - 1), rollout.backoff_max_ms)
        self._not_before[(gid, g)] = asyncio.get_running_loop().time() + delay_ms / 1000.0

    def _finalize(self, gid: str) -> None:
        """Rewards → group-relative advantages (`trainer.scale_rewards`; `batch` stores them
        group-centred and the trainer divides). Pure computation, so it runs inside one
        synchronous section: FINALIZING is never left half done by a live run."""
        led = self.ledger
        led.apply(Finalizing(group_id=gid))
        rec = led.group(gid)
        rewards = [self.rows.get(RowId(gid, g, rec.attempts[g])).reward for g in range(rec.group_size)]
        advantages = stored_advantages(rewards, self.cfg.trainer.scale_rewards)
        led.apply(Ready(group_id=gid, advantages=advantages))

    def _drop(self, gid: str, reason: str, *, on_dropped_prompt: str | None = None) -> None:
        """Drop a group and refill or shrink its step, in one transition (DESIGN §6)."""
        ev = drop_event(
            self.ledger,
            self.source,
            gid,
            reason,
            on_dropped_prompt=on_dropped_prompt or self.cfg.rollout.on_dropped_prompt,
            group_size=self.cfg.rollout.group_size,
            granularity=self._granularity,
        )
        for key, task in list(self._gen_tasks.items()):
            if key[0] == gid:
                task.cancel()
        self._free(self.ledger.apply(ev))
        if ev.shrink:
            check_step_size(self.ledger, self.limits, ev.step)

    def _abandon_inflight(self, reason: str) -> None:
        """At shutdown: attempts still generating are abandoned, visibly, in the trace."""
        for gid, rec in self.ledger.groups():
            gens = tuple(rec.generations_with(AttemptStatus.DISPATCHED))
            if gens and rec.state == GroupState.GENERATING:
                self._free(self.ledger.apply(Abandoned(group_id=gid, generations=gens, reason=reason)))

    # ================================================================== train pump

    async def _train_pump(self) -> None:
        cfg, led = self.cfg, self.ledger
        await self._evaluate(led.version)
        while not self.stopping:
            step = led.version + 1
            if step > cfg.train.total_steps:
                self.stop("finished")
                return
            gids = await self._next_batch(step)
            if gids is None:
                if not self.stopping:
                    self.stop("data exhausted")
                return
            led.apply(Claimed(step=step, group_ids=tuple(gids)))
            batch = self._batch(step, gids)
            t0 = time.perf_counter()
            metrics = await asyncio.to_thread(self.trainer.train_step, batch)
            crashpoints.hit("train.before_commit")
            self._free(led.apply(led.commit_event(step)))
            crashpoints.hit("train.after_commit")
            self._log_step(batch, metrics, time.perf_counter() - t0)
            if cfg.deterministic:
                await self._wait_pinned_work()
            # The last step's checkpoint is the final cut, written once the run has stopped.
            if step % cfg.checkpoint.every_steps == 0 and step < cfg.train.total_steps:
                await self._checkpoint()
            await self.engine.update_weights(self.trainer.weights(), step)
            self._wake_rollout.set()
            await self._evaluate(step)

    async def _evaluate(self, step: int) -> None:
        """Greedy accuracy on the held-out set every `eval.every_steps` (in a thread)."""
        every = self.cfg.eval.every_steps
        if self.evaluator is None or every == 0 or step % every:
            return
        t0 = time.perf_counter()
        result = await asyncio.to_thread(self.evaluator.evaluate, self.trainer.weights())
        self._last_eval = result
        self._metrics.write(step, {**result, "eval/seconds": time.perf_counter() - t0})
        self.trace.emit("eval", step=step, **result)
        self._progress.note(f"eval at step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()))

    async def _next_batch(self, step: int) -> list[str] | None:
        """Wait until the sampler can fill `step`; None when no batch can ever come."""
        led = self.ledger
        while not self.stopping:
            for gid in self.sampler.stale(led):
                if self.cfg.sampler.on_stale == "regenerate":
                    self._free(led.apply(Evicted(group_id=gid, reason="stale")))
                else:
                    self._drop(gid, "stale")
            final = led.exhausted and not led.spare and led.n_inflight() == 0
            gids = self.sampler.select(led, step, final=final)
            if gids:
                return gids
            if final:
                return None
            await self._wait(self._wake_train)
        return None

    def _pinned_work_done(self) -> bool:
        """Deterministic mode (DESIGN §7): step k generates under version k - 1 - window, so
        before the engine moves past the trainer's version v, every group of the steps up
        to v + window must have finished generating (and every such step be full)."""
        led = self.ledger
        last_step = min(led.version + self.limits.window, self.cfg.train.total_steps)
        for k in range(led.version + 1, last_step + 1):
            gids = led.stamped(k)
            full = len(gids) + led.shortfall(k) >= self.limits.num_prompts_per_step
            if not full and not (led.exhausted and not led.spare):
                return False
            if any(led.group(g).state <= GroupState.GENERATING for g in gids):
                return False
        return True

    async def _wait_pinned_work(self) -> None:
        while not self.stopping and not self._pinned_work_done():
            await self._wait(self._wake_train)

    def _batch(self, step: int, gids: list[str]) -> Batch:
        groups = []
        for gid in gids:
            rec = self.ledger.group(gid)
            rows = tuple(self.rows.get(RowId(gid, g, rec.attempts[g])) for g in range(rec.group_size))
            groups.append(TrainGroup(gid, rec.epoch, rec.ordinal, rec.idx, rec.task, tuple(rec.advantages), rows))
        return Batch(step=step, groups=tuple(groups))

    def _log_step(self, batch: Batch, metrics: dict[str, float], train_seconds: float) -> None:
        rows = [r for g in batch.groups for r in g.rows]
        tokens = sum(r.tokens for r in rows)
        trainer_version = batch.step - 1
        age = (
            float(sum(int((trainer_version - r.versions).sum()) for r in rows) / tokens) if tokens else 0.0
        )
        now = time.perf_counter()
        counts = self.ledger.counts()
        record = {
            "weight_version": batch.step,
            "groups": len(batch.groups),
            "tokens": tokens,
            "reward_mean": float(np.mean([r.reward for r in rows])) if rows else 0.0,
            "batch_age": age,
            "train_seconds": train_seconds,
            "step_seconds": now - self._last_step_time,
            "tokens_generated_per_s": self._tokens_generated / max(1e-9, now - self._t_start),
            **{f"trainer/{k}": float(v) for k, v in metrics.items()},
            **{f"custody/{k}": v for k, v in counts.items()},
        }
        self._last_step_time = now
        self._metrics.write(batch.step, record)
        if self.on_step is not None:
            self.on_step(batch.step, record)
        self._progress.step(
            batch.step,
            {
                "reward": record["reward_mean"],
                "acc": self._last_eval.get("eval/accuracy"),
                "age": age,
                "tok/s": round(record["tokens_generated_per_s"]),
                "gen": counts["generating"] + counts["reserved"],
                "ready": counts["ready"],
                "trained": counts["trained"],
                "dropped": counts["dropped"],
            },
        )

    # ================================================================== checkpoints

    def _cut(self) -> tuple[Cut, Any, float]:
        """The atomic cut of custody and trainer state (synchronous: O(1) for custody, a
        copy of the weights and optimizer state for the trainer, each timed)."""
        c = cut(self.ledger, self.rows)
        t0 = time.perf_counter()
        snapshot = self.trainer.snapshot()
        snapshot_seconds = time.perf_counter() - t0
        self.trace.flush()  # every commit this checkpoint covers is in the trace first
        self._changed_since_cut = False
        crashpoints.hit("checkpoint.after_cut")
        return c, snapshot, snapshot_seconds

    def _can_cut(self) -> bool:
        """A cut is written when custody changed since the last one (a later cut of the
        same step becomes the next revision of its checkpoint, so a final checkpoint
        always matches the trace). In deterministic mode a checkpoint must not hold a
        group that still has to generate under a version older than the trainer's (a
        resumed engine could not); only a stop can leave that state, and then the
        previous checkpoint stands."""
        if not self._changed_since_cut:
            return False
        if self.cfg.deterministic and not self._pinned_work_done():
            self.trace.emit("checkpoint_skipped", step=self.ledger.version,
                            reason="deterministic: generation pinned to an older version unfinished")
            return False
        return True

    async def _checkpoint(self) -> None:
        """At a step boundary: cut now, write in the background (one write at a time)."""
        if not self._can_cut():
            return
        if self._write_task is not None:
            await self._write_task
        self._write_task = self._tg.create_task(self._write(*self._cut()))

    async def _write(self, c: Cut, snapshot: Any, snapshot_seconds: float) -> None:
        meta = {
            "dataset": {
                "n_rows": self.source.n_rows,
                "seed": self.source.seed,
                "epochs": self.source.epochs,
                "fingerprint": self.source.fingerprint(),
            },
            "config": self.semantic,
            "config_fingerprint": fingerprint(self.semantic),
            "rollkeep_version": _version(),
            "run_id": self.trace.run_id,
        }

        def work():  # on a worker thread, while both pumps keep running
            t0 = time.perf_counter()
            published = write_checkpoint(
                self.store, c, trainer_files=snapshot.files(), meta=meta,
                keep_last=self.cfg.checkpoint.keep_last, trainer_step=snapshot.step,
            )
            return published, time.perf_counter() - t0

        try:
            published, write_seconds = await asyncio.to_thread(work)
        except OSError as e:  # the store undid what it wrote; the previous checkpoint stands
            raise FilesystemError.of(e, f"publishing the checkpoint of step {c.ledger.version}") from None
        self.trace.emit(
            "checkpoint_published",
            step=c.ledger.version,
            name=published.name,
            bytes=published.bytes,
            cut_hold_seconds=c.hold_seconds,  # custody: ledger capture + row pin
            trainer_snapshot_seconds=snapshot_seconds,  # weights/optimizer copy, same hold
            write_seconds=write_seconds,  # encode + fsync + publish, off the loop
            cut_time=c.time,
        )
        self._progress.note(
            f"checkpoint {published.name}: {published.bytes / 1e6:.2f} MB; the cut held the loop "
            f"{c.hold_seconds * 1e6:.0f} us (+{snapshot_seconds * 1e3:.1f} ms trainer copy); "
            f"written in the background in {write_seconds:.2f} s"
        )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollkeep")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


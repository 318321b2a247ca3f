"""One simulated run: the real scheduler, ledger, codec, store and restore chain, driven on
a fake clock against a scripted engine, the toy trainer and an in-memory disk, crashed and
restarted as its `Plan` says, and checked at the end.

A *segment* is one simulated process: it restores the newest checkpoint (the real
`rundir.start_point` rule and the real restore chain, on the simulated disk) or starts
fresh, then carries out the scheduler's commands exactly as the runner does, each taking
simulated time:

    Dispatch  the engine script answers after a latency (or fails, or hangs forever, all
              as pure functions of the request, so every lineage sees the same ones)
    Train     the toy trainer (a digest of every batch) after a train time
    Cut       the trainer snapshot now; the real `write_checkpoint` on the simulated disk
              after a write time
    Refit     the engine holds the new version after a refit time

A segment ends when the scheduler says Stop (the run is over), when an injected crash
fires (a ledger event count or the n-th hit of a named crash point: the disk then keeps
its page cache, or loses what was never fsynced), or when a simulated disk fault fails a
checkpoint or trace write (the process exits, as `rollkeep train` does with exit 5). The
run is restarted until it finishes.

The trace is the real writer (`rollkeep.trace.Trace`, one per process with its run id, on
the fake clock) on the simulated disk, used as the runner uses it: the events that must
survive (`trace.FLUSH_NOW`) flushed at once, the others every 50 ms of simulated time, all
of them at the cut, and fsynced before each checkpoint publication. A kill keeps every
flushed line; a power cut keeps the synced ones and may tear the next. Everything read
back -- the publications `start_point` counts, the lineage checked at the end -- is read
from that disk, torn lines skipped as `read_trace` skips them.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..controller.rundir import published_in_trace, start_point
from ..core import crashpoints
from ..core.checkpoint import write_checkpoint
from ..core.errors import ExternalError, FilesystemError
from ..core.events import DATA, INFRA, Event
from ..core.generation import Completion, GenRequest
from ..core.ledger import Ledger
from ..core.restore import restore_chain
from ..core.rows import RowStore
from ..core.samplers import Limits, make_sampler
from ..core.schedule import (
    Cancel,
    Cut,
    Dispatch,
    Failure,
    Generated,
    Note,
    Refit,
    Scheduler,
    Settings,
    Stop,
    Train,
    WakeAt,
)
from ..core.source import PromptSource, SequenceDataset
from ..core.store import CheckpointStore
from ..core.trace_schema import CheckpointPublished, Restored, RunFailed, RunFinished, RunStarted
from ..lineage import EVENTS, exactly_once, lineage
from ..trace import Trace, parse_trace
from ..trainers.toy import ToyTrainer
from .memfs import MemFS, SimCrash

RUN_DIR = Path("/sim/run")
TRACE = RUN_DIR / "trace.jsonl"
MAX_ACTIONS = 200_000  # per segment: a run that never ends is a violation, not a hang
_FLUSH_S = 0.05


@dataclass(frozen=True)
class Crash:
    """An injected crash: at the `at`-th ledger event of the run (`point` None) or the
    `at`-th hit of the named crash point; `power` loses what was never fsynced."""

    at: int
    point: str | None = None
    power: bool = False

    def __str__(self) -> str:
        where = f"ledger event #{self.at}" if self.point is None else f"{self.point}:{self.at}"
        return f"{'power cut' if self.power else 'kill'} at {where}"


@dataclass(frozen=True)
class Script:
    """The engine's and the machine's behaviour: rates and simulated durations (s)."""

    infra_fail_rate: float = 0.0
    data_fail_rate: float = 0.0
    hang_rate: float = 0.0
    latency: tuple[float, float] = (0.001, 0.05)
    train_s: tuple[float, float] = (0.001, 0.02)
    write_s: tuple[float, float] = (0.001, 0.01)
    refit_s: tuple[float, float] = (0.0, 0.002)
    completion_tokens: int = 4


@dataclass(frozen=True)
class Plan:
    """Everything a schedule is: decided from its seed before it runs (`schedules.plan`)."""

    seed: int
    settings: Settings
    sampler: str
    limits: Limits
    n_rows: int
    epochs: int
    keep_last: int
    script: Script
    crashes: tuple[Crash, ...] = ()
    fault_rate: float = 0.0
    max_faults: int = 0
    index: int = 0  # its place in a sweep (`schedules.plan(seed, index)` rebuilds it)

    def describe(self) -> str:
        s = self.settings
        return (f"sampler={self.sampler} recovery={s.recovery_mode} deterministic={s.deterministic} "
                f"P={self.limits.num_prompts_per_step} window={self.limits.window} G={s.group_size} "
                f"steps={s.total_steps} rows={self.n_rows}x{self.epochs} every={s.checkpoint_every} "
                f"keep={self.keep_last} drop={s.on_dropped_prompt} stale={s.on_stale}")


@dataclass
class Outcome:
    """What a simulated run did, and what was wrong with it (empty = none)."""

    problems: list[str] = field(default_factory=list)
    crashes: int = 0  # injected crashes that fired
    fired: list[str] = field(default_factory=list)  # where: a crash point, or "ledger event"
    faults: int = 0  # simulated disk faults that failed a write
    segments: int = 0
    digest: str | None = None  # final trainer digest of a finished run
    failed_by_design: str | None = None  # the run stopped with a user-facing error
    trace: bytes = b""  # the simulated disk's trace at the end

    @property
    def trace_tail(self) -> list[dict[str, Any]]:
        """The trace's last readable lines (for a violation's report)."""
        return parse_trace(b"\n".join(self.trace.split(b"\n")[-41:]))[0]


def _unit(*parts: object) -> float:
    return xxhash.xxh3_64_intdigest("/".join(map(str, parts)).encode()) / 2.0**64


def _between(lo_hi: tuple[float, float], *parts: object) -> float:
    lo, hi = lo_hi
    return lo + (hi - lo) * _unit(*parts)


class World:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.fs = MemFS(self.rng, fault_rate=plan.fault_rate, max_faults=plan.max_faults)
        self.fs.makedirs_durable(RUN_DIR)  # the run directory exists before the run (`RunDir`)
        self.store = CheckpointStore(RUN_DIR / "checkpoints", fs=self.fs)
        rows = [{"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7)} for i in range(plan.n_rows)]
        self.source = PromptSource(SequenceDataset(rows), seed=plan.seed % 2**31, epochs=plan.epochs)
        self.trace: Trace | None = None  # the trace writer of the process running now
        self._pending = sorted(plan.crashes, key=lambda c: (c.point or "", c.at))
        self._events = 0  # ledger events of the whole run (crash injection counts them)
        self._hits: dict[str, int] = {}
        self.now = 0.0
        self._run_ids = itertools.count()

    # ================================================================== the run

    def run(self) -> Outcome:
        out = Outcome()
        crashpoints.set_handler(self._on_point)
        try:
            while True:
                out.segments += 1
                if out.segments > len(self.plan.crashes) + self.plan.max_faults + 3:
                    out.problems.append(f"the run did not finish after {out.segments - 1} segment(s)")
                    break
                try:
                    ended = self._segment()
                except SimCrash as crash:
                    out.crashes += 1
                    out.fired.append(getattr(crash, "where", "?"))
                    self.trace = None  # its unflushed lines die with the process
                    self.fs.power_cut() if getattr(crash, "power", False) else self.fs.kill()
                    continue
                except (OSError, FilesystemError) as e:  # a simulated disk fault: `rollkeep train` exits 5
                    self._exit_failed(e)
                    continue
                except ExternalError as e:  # e.g. a step shrank below its minimum
                    out.failed_by_design = str(e)
                    break
                if ended == "finished":
                    break
        except Exception as e:  # anything else is a bug the simulation found
            out.problems.append(f"{type(e).__name__}: {e}")
        finally:
            crashpoints.set_handler(None)
        self.fs.kill()  # the last process is over, however it ended
        out.faults = self.fs.faults
        if self.fs.kind_of(TRACE) is not None:
            out.trace = self.fs.read(TRACE)
        if not out.problems and out.failed_by_design is None:
            self._check(out)
        return out

    def _exit_failed(self, e: BaseException) -> None:
        """The process stops with an error, as the runner does: the failure traced if the
        trace still takes writes, and the trace closed (flushed)."""
        if self.trace is not None:
            with contextlib.suppress(FilesystemError):
                self.trace.emit(RunFailed(step=None, error=f"{type(e).__name__}: {e}"))
            with contextlib.suppress(FilesystemError):
                self.trace.close()
        self.trace = None

    def _check(self, out: Outcome) -> None:
        lin = lineage(parse_trace(out.trace, events=EVENTS)[0])  # torn lines skipped, as `read_trace` does
        try:
            restored = restore_chain(self.store, source=self.source, config=None)
        except Exception as e:
            out.problems.append(f"the final checkpoint fails the restore chain: {e}")
            return
        found = exactly_once(lin, restored.ledger, self.source)
        lossy = self.plan.settings.recovery_mode == "cursor_only"  # loses in flight by design
        out.problems.extend(p for p in found.problems if not (lossy and "were lost on restore" in p))
        if lin.finished is not None:
            out.digest = lin.finished["weights_sha256"]

    # ================================================================== one process

    def _segment(self) -> str:
        plan, s = self.plan, self.plan.settings
        self.run_id = f"run{next(self._run_ids)}"
        name = start_point(self.store, None, published=self._published)
        trainer = ToyTrainer()
        rows = RowStore()
        restored = None
        if name is not None:
            restored = restore_chain(self.store, name=name, source=self.source, config=None)
            trainer.load({n: restored.trainer_file(n) for n in restored.trainer_files()},
                         step=restored.ledger.version)
            ledger = Ledger.from_state(restored.ledger)
            for rid, row in restored.rows.items():
                rows.put(rid, row)
        else:
            ledger = Ledger(n_rows=self.source.n_rows, seed=self.source.seed, epochs=self.source.epochs)
        self.store.cleanup_tmp()
        self.trace = Trace(TRACE, self.run_id, fs=self.fs, clock=lambda: self.now)
        sched = Scheduler(ledger=ledger, rows=rows, source=self.source,
                          sampler=make_sampler(plan.sampler, plan.limits), settings=s)
        sched.subscribe(self.trace.ledger_event)
        sched.subscribe(self._count_event)
        sched.subscribe(lambda ev: crashpoints.hit("ledger." + ev.__struct_config__.tag))
        self.trace.emit(RunStarted(resumed_from_step=None if restored is None else ledger.version,
                                   checkpoint=None if restored is None else restored.name))
        counts = sched.start(restored, epochs=self.source.epochs)
        if restored is not None:
            self.trace.emit(Restored(checkpoint=restored.name, step=ledger.version,
                                     cut_time=restored.manifest.get("cut_time"), **counts))
        return _Process(self, sched, trainer).drive()

    def _published(self) -> int | None:
        return published_in_trace(TRACE, fs=self.fs)

    # ================================================================== crashes

    def _count_event(self, ev: Event) -> None:
        self._events += 1
        self._maybe_crash(None, self._events)

    def _on_point(self, name: str) -> None:
        self._hits[name] = self._hits.get(name, 0) + 1
        self._maybe_crash(name, self._hits[name])

    def _maybe_crash(self, point: str | None, n: int) -> None:
        for i, c in enumerate(self._pending):
            if c.point == point and c.at == n:
                del self._pending[i]
                crash = SimCrash(str(c))
                crash.power = c.power  # type: ignore[attr-defined]
                crash.where = c.point or "ledger event"  # type: ignore[attr-defined]
                self.fs.freeze(crash)  # the process is dead: no clean-up path may touch the disk
                raise crash


class _Process:
    """The runner's half of one segment, on the fake clock (see `controller.runner`)."""

    def __init__(self, world: World, sched: Scheduler, trainer: ToyTrainer) -> None:
        self.w, self.sched, self.trainer = world, sched, trainer
        self.queue: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.cancelled: set[tuple[str, int, int]] = set()
        self.engine_version = 0
        self.next_flush = world.now + _FLUSH_S

    def later(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.queue, (self.w.now + delay, next(self.seq), fn))

    def drive(self) -> str:
        w, script = self.w, self.w.plan.script
        for _ in range(MAX_ACTIONS):
            for cmd in self.sched.poll(w.now):
                if isinstance(cmd, Dispatch):
                    self._dispatch(cmd.request)
                elif isinstance(cmd, Cancel):
                    self.cancelled.update(cmd.attempts)
                elif isinstance(cmd, Train):
                    self.later(_between(script.train_s, w.plan.seed, "train", cmd.step), lambda c=cmd: self._train(c))
                elif isinstance(cmd, Cut):
                    captured = self.sched.capture(now=w.now)
                    snapshot = self.trainer.snapshot()
                    w.trace.flush()  # as the runner's `_cut`: every commit it covers is in the trace
                    crashpoints.hit("checkpoint.after_cut")
                    self.later(_between(script.write_s, w.plan.seed, "write", cmd.step, w.now),
                               lambda c=cmd, cap=captured, snap=snapshot: self._write(c, cap, snap))
                elif isinstance(cmd, Refit):
                    self.later(_between(script.refit_s, w.plan.seed, "refit", cmd.version),
                               lambda v=cmd.version: self._refit(v))
                elif isinstance(cmd, Note):
                    w.trace.emit(cmd.event)
                elif isinstance(cmd, WakeAt):
                    if cmd.time > w.now:
                        heapq.heappush(self.queue, (cmd.time, next(self.seq), lambda: None))
                elif isinstance(cmd, Stop):
                    w.trace.emit(RunFinished(step=self.sched.version, weights_sha256=self.trainer.weights_sha256(),
                                             reason=cmd.reason.value))
                    w.trace.close()
                    return "finished"
            if not self.queue:
                raise RuntimeError(f"the scheduler waits for nothing (phase {self.sched.phase.value})")
            t, _, fn = heapq.heappop(self.queue)
            w.now = max(w.now, t)
            if w.now >= self.next_flush:
                w.trace.flush()
                self.next_flush = w.now + _FLUSH_S
            fn()
        raise RuntimeError(f"the run did not stop within {MAX_ACTIONS} simulated actions")

    def _dispatch(self, req: GenRequest) -> None:
        script, seed = self.w.plan.script, self.w.plan.seed
        key = (req.group_id, req.generation, req.attempt)
        if _unit(seed, req.seed, "hang", req.infra_retries) < script.hang_rate:
            return  # never answers: the scheduler's deadline aborts it
        if _unit(seed, req.seed, "infra", req.infra_retries) < script.infra_fail_rate:
            outcome = Failure(INFRA, "InfraError: simulated")
        elif _unit(seed, req.seed, "data") < script.data_fail_rate:
            outcome = Failure(DATA, "simulated data failure")
        else:
            outcome = None  # a completion, built on arrival (the engine may have been refit)
        self.later(_between(script.latency, seed, req.seed, "latency", req.attempt),
                   lambda: self._deliver(key, req, outcome))

    def _deliver(self, key, req: GenRequest, outcome) -> None:
        if key in self.cancelled:
            return
        if outcome is None:
            n = 1 + int(_unit(req.seed, "len") * self.w.plan.script.completion_tokens)
            ids = np.array([int(_unit(req.seed, "tok", i) * 10) for i in range(n)], np.int32)
            version = self.engine_version if req.pinned_version is None else req.pinned_version
            completion = Completion(prompt_ids=np.arange(3, dtype=np.int32), completion_ids=ids,
                                    logprobs=np.full(n, -0.5, np.float32), versions=np.full(n, version, np.int32),
                                    finish_reason="stop", text="".join(map(str, ids.tolist())))
            outcome = Generated(completion, float(ids[0] % 2))
        self.sched.on_result(key, outcome, self.w.now)

    def _train(self, cmd: Train) -> None:
        self.trainer.train_step(cmd.batch)
        self.sched.on_trained(cmd.step)

    def _refit(self, version: int) -> None:
        self.engine_version = version
        self.sched.on_refit(version)

    def _write(self, cmd: Cut, captured, snapshot) -> None:
        w = self.w
        meta = {"dataset": {"n_rows": w.source.n_rows, "seed": w.source.seed, "epochs": w.source.epochs,
                            "fingerprint": w.source.fingerprint()}, "config": {}}
        w.trace.sync_flushed()  # as the runner's `_write`: the durable trace has every commit first
        published = write_checkpoint(w.store, captured, trainer_files=snapshot.files(), meta=meta,
                                     keep_last=w.plan.keep_last, trainer_step=snapshot.step)
        w.trace.emit(CheckpointPublished(step=cmd.step, name=published.name, cut_time=captured.time))
        self.sched.on_cut_written(cmd.step)

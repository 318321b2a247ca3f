"""One simulated run: the real scheduler, ledger, codec, store and restore chain, driven on
a fake clock against a scripted engine, the toy trainer and an in-memory disk, crashed and
restarted as its `Plan` says, and checked at the end.

A *segment* is one simulated process: it restores the newest checkpoint (the real
production start-up, `core.start`, on the simulated disk) or starts fresh, then carries
out the scheduler's commands exactly as the runner does, each taking simulated time:

    Dispatch  the engine script answers after a latency (or fails, or hangs forever, all
              as pure functions of the request, so every lineage sees the same ones)
    Train     the toy trainer (a digest of every batch) after a train time
    Cut       the cut's loop part now, its write (`core.cutting`, the runner's) on the
              simulated disk after a write time
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

With `Plan.journal` each process keeps the journal on that disk as the runner does
(`core.groupcommit.GroupCommit`, the journal thread's cycle run on the fake clock): a
restore is LATEST and the journal's tail after it (`core.start`, the runner's code), the first record a restart marker, records released at each trace flush and made
durable (row log first) every `journal_ms` of simulated time or once `flush_events` wait,
`covering` around each publication and the position in the checkpoint's meta. Crashes land
inside those flushes too (`journal.*` and `rowlog.*` crash points, disk faults, torn
appends at a power cut).

With `Plan.effects` the attempts call a judge outside the process (`simulate.effects`), as
the runner's `controller.effects` carries out `rollkeep.effects.call`: a single-turn
attempt's reward stage between the engine's answer and `on_result`, an episode's
environment at each step; a new call waits, in simulated time, for the journal cycle that
makes its intent durable. Each process starts from the records a restore gives
(`start.open_effects`), which tell the effects' check what a crash left unknown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..core import crashpoints
from ..core.checkpoint.cut import save_files
from ..core.checkpoint.store import CheckpointStore
from ..core.custody.events import DATA, INFRA, Event, Failed
from ..core.custody.trace_schema import EffectAnswered, Restored, RunFailed, RunFinished, RunStarted
from ..core.errors import ExternalError, FilesystemError
from ..core.journal.groupcommit import GroupCommit
from ..core.restore import start
from ..core.restore.chain import restore_chain
from ..core.rollout.datasets import SequenceDataset
from ..core.rollout.effects import EFFECT_UNKNOWN, RETRY, REWARD_TURN, Answer, Call, Unknown
from ..core.rollout.generation import TOKEN_FIELDS, Chunk, Completion, GenRequest
from ..core.rollout.samplers import Limits, make_sampler
from ..core.rollout.source import PromptSource
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
    Sinks,
    Stop,
    Train,
    WakeAt,
    crash_point,
    cutting,
)
from ..core.schedule.episode import (
    Done,
    EnvBuild,
    EnvReplay,
    EnvReset,
    EnvRestore,
    EnvSnapshot,
    EnvStep,
    Episode,
    EpisodeCommand,
    Generate,
    Turn,
)
from ..envs.base import REPLAY, SNAPSHOT, Step
from ..lineage import EVENTS, exactly_once, lineage
from ..trace import Trace, parse_trace, published_in_trace
from ..trainers.toy import STATE_FILE, ToyTrainer
from .effects import (
    JUDGE,
    RUN,
    EffectBook,
    Judge,
    digest,
    reward_of,
    reward_requests,
    step_request,
)
from .episodes import SimEnv, SimTokenizer
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
    turns: int = 1  # model turns per episode: more than one runs multi-turn episodes (§5.4)
    judge_s: tuple[float, float] = (0.001, 0.02)  # a call to the judge, until its answer arrives
    fsync_s: tuple[float, float] = (0.0, 0.002)  # a journal cycle kicked by a wait for an intent


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
    journal: bool = False  # journal.enabled: restore = LATEST + the journal's tail
    journal_ms: float = 10.0  # journal.flush_ms, in simulated time
    flush_events: int = 4096  # journal.flush_events
    # Calls to the outside (`simulate.effects`): the reward stage's `judge_calls` calls to the
    # judge (single-turn), or one per environment step (episodes), of policy `on_unknown`;
    # the judge fails a `judge_errors` share of keys.
    effects: bool = False
    on_unknown: str = RETRY
    judge_calls: int = 1
    judge_errors: float = 0.0

    def describe(self) -> str:
        s = self.settings
        return (f"sampler={self.sampler} recovery={s.recovery_mode} deterministic={s.deterministic} "
                f"P={self.limits.num_prompts_per_step} window={self.limits.window} G={s.group_size} "
                f"steps={s.total_steps} rows={self.n_rows}x{self.epochs} every={s.checkpoint_every} "
                f"keep={self.keep_last} drop={s.on_dropped_prompt} stale={s.on_stale} turns={self.script.turns}"
                + (f" journal={self.journal_ms:g}ms/{self.flush_events}" if self.journal else " journal=off")
                + (f" effects={self.on_unknown}x{self.judge_calls}/errors={self.judge_errors:g}" if self.effects else ""))


@dataclass
class Outcome:
    """What a simulated run did, and what was wrong with it (empty = none)."""

    problems: list[str] = field(default_factory=list)
    crashes: int = 0  # injected crashes that fired
    fired: list[str] = field(default_factory=list)  # where: a crash point, or "ledger event"
    faults: int = 0  # simulated disk faults that failed a write
    segments: int = 0
    journal_replayed: int = 0  # journal events restores replayed after their checkpoint
    journal_restores: int = 0  # restores that replayed a journal tail
    effect_calls: int = 0  # calls the judge received
    effect_resent: int = 0  # of them sent again with a recorded key
    effect_answered: int = 0  # calls answered from the record (not made)
    effect_unknown: int = 0  # attempts failed as effect_unknown (the scheduler's guard at the seal included)
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
        self.journal: GroupCommit | None = None  # and its journal (Plan.journal)
        self.out = Outcome()
        self._pending = sorted(plan.crashes, key=lambda c: (c.point or "", c.at))
        self._events = 0  # ledger events of the whole run (crash injection counts them)
        self._hits: dict[str, int] = {}
        self.now = 0.0
        self._run_ids = itertools.count()
        self.judge = Judge(plan.judge_errors)  # outside every process: its counts survive the crashes
        self.book = EffectBook(plan.on_unknown)

    # ================================================================== the run

    def run(self) -> Outcome:
        out = self.out
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
                    self._crashed(crash)
                    continue
                except (OSError, FilesystemError) as e:  # a simulated disk fault: `rollkeep train` exits 5
                    try:
                        self._exit_failed(e)
                    except SimCrash as crash:  # inside the journal's last flush
                        self._crashed(crash)
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
        if self.plan.effects:
            self._check_effects(out)
        if not out.problems and out.failed_by_design is None:
            self._check(out)
        return out

    def _check_effects(self, out: Outcome) -> None:
        """The effects' invariant (`simulate.effects`), also of a run that failed by design:
        what it called until then must hold too."""
        calls = self.judge.calls
        out.effect_calls, out.effect_resent = sum(calls.values()), sum(n - 1 for n in calls.values())
        out.effect_answered, out.effect_unknown = self.book.answered, self.book.unknown
        out.problems.extend(self.book.problems(self.judge))

    def _crashed(self, crash: SimCrash) -> None:
        self.out.crashes += 1
        self.out.fired.append(getattr(crash, "where", "?"))
        self.trace = self.journal = None  # their unflushed lines and records die with the process
        self.fs.power_cut() if getattr(crash, "power", False) else self.fs.kill()

    def _exit_failed(self, e: BaseException) -> None:
        """The process stops with an error, as the runner does: the failure traced if the
        trace still takes writes, then the journal closed (its last flush, unless it failed)
        and the trace closed (flushed), in the runner's order."""
        trace, journal = self.trace, self.journal
        self.trace = self.journal = None
        if trace is not None:
            with contextlib.suppress(FilesystemError):
                trace.emit(RunFailed(step=None, error=f"{type(e).__name__}: {e}"))
        if journal is not None:
            with contextlib.suppress(OSError, FilesystemError):
                journal.close()
        if trace is not None:
            with contextlib.suppress(FilesystemError):
                trace.close()

    def _check(self, out: Outcome) -> None:
        lin = lineage(parse_trace(out.trace, events=EVENTS)[0])  # torn lines skipped, as `read_trace` does
        try:
            restored = restore_chain(self.store, source=self.source, config=None)
        except Exception as e:
            out.problems.append(f"the final checkpoint fails the restore chain: {e}")
            return
        if self.plan.journal:
            # The journal's tail after the final checkpoint still replays (as a restart and
            # `rollkeep audit` would read it); the custody check is on LATEST alone: a run
            # that restored a tail writes its final cut even if it trains no step after
            # (`Scheduler.start(replayed=True)`), so LATEST holds what the tail did.
            try:
                start.journal_tail(RUN_DIR, restored, newest=start.is_newest(self.store, restored), source=self.source,
                             fs=self.fs)
            except Exception as e:
                out.problems.append(f"the final journal tail fails to replay: {e}")
                return
        found = exactly_once(lin, restored.ledger, self.source)
        lossy = self.plan.settings.recovery_mode == "cursor_only"  # loses in flight by design
        out.problems.extend(p for p in found.problems if not (lossy and "were lost on restore" in p))
        if lin.finished is not None:
            out.digest = lin.finished["weights_sha256"]

    # ================================================================== one process

    def _segment(self) -> str:
        """One process, started as `rollkeep train` starts (`core.start`)."""
        plan, s = self.plan, self.plan.settings
        self.run_id = f"run{next(self._run_ids)}"
        name = start.start_point(self.store, None, published=self._published)
        trainer = ToyTrainer()
        restored = None
        if name is not None:
            restored = restore_chain(self.store, name=name, source=self.source, config=None, dataset_rows=False)
            trainer.load_state(restored.trainer_file(STATE_FILE), step=restored.ledger.version)
        begun = start.prepare(RUN_DIR, self.store, self.source, restored, journaled=plan.journal, fs=self.fs)
        # Half the schedules keep the row store's columns from the first row (a real run only
        # from 128 k rows): restores fill them, tails free from them, checkpoints gather them.
        columns_from = 0 if _unit(plan.seed, "columns") < 0.5 else None
        ledger, rows, prefixes = start.open_state(RUN_DIR, begun, self.source, fs=self.fs, columns_from=columns_from)
        effects = start.open_effects(begun)
        # What this process knows of the calls made before it: a called key whose outcome
        # is not in its records was not durable at the crash.
        self.book.restored(effects, self.judge.calls, weak=begun.tail is None and (not plan.journal or begun.stale))
        start.begin(RUN_DIR, self.store, begun, journaled=plan.journal, fs=self.fs)
        if begun.tail is not None:
            self.out.journal_restores += 1
            self.out.journal_replayed += begun.tail.events
        self.store.cleanup_tmp()
        self.trace = Trace(TRACE, self.run_id, fs=self.fs, clock=lambda: self.now)
        if plan.journal:
            self.journal = GroupCommit(RUN_DIR, next_seq=begun.next_seq, rows=rows, prefixes=prefixes,
                                       flush_ms=plan.journal_ms, flush_events=plan.flush_events, fs=self.fs)
            self.journal.restart(ledger.version, self.source.identity())
            self.trace.on_flush = self.journal.release
        # With the journal, the engine streams and cut-off siblings continue (recovery.partial: resume).
        s = dataclasses.replace(s, record_partial=plan.journal, resume_partial=True,
                                progress_every_s=plan.journal_ms / 1000)
        sched = Scheduler(ledger=ledger, rows=rows, source=self.source,
                          sampler=make_sampler(plan.sampler, plan.limits), settings=s, prefixes=prefixes,
                          effects=effects, sinks=Sinks(trace=self.trace.ledger_event, journal=self.journal and self.journal.sink,
                                      crash=self._count_event),
                          wall_clock=lambda: self.now)
        self.trace.emit(RunStarted(resumed_from_step=ledger.version if begun.resumed else None,
                                   checkpoint=None if restored is None else restored.name))
        counts = sched.start(begun.continues(), epochs=self.source.epochs, replayed=begun.tail is not None,
                             lost=None if begun.tail is None else begun.tail.lost)
        if begun.resumed:
            self.trace.emit(Restored(checkpoint=None if restored is None else restored.name, step=ledger.version,
                                     cut_time=restored.meta.cut_time if restored is not None else 0.0,
                                     **counts, **begun.restored_fields()))
        return _Process(self, sched, trainer).drive()

    def _published(self) -> int | None:
        return published_in_trace(TRACE, fs=self.fs)

    # ================================================================== crashes

    def _count_event(self, ev: Event) -> None:
        """The crash sink: a crash after the n-th ledger event of the run, then the crash point."""
        self._events += 1
        if isinstance(ev, Failed) and ev.error.startswith(EFFECT_UNKNOWN):
            self.book.unknown += 1  # (from the events, not the trace: a power cut may lose its line)
        self._maybe_crash(None, self._events)
        crash_point(ev)

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
        self.streaming: set[tuple[str, int, int]] = set()  # attempts dispatched with `stream`
        self.calling: dict[tuple[str, int, int], str] = {}  # attempt -> the key of its call to the judge in flight
        self.engine_version = 0
        self.next_flush = world.now + _FLUSH_S
        self.journal_s = world.plan.journal_ms / 1000
        self.next_journal = world.now + self.journal_s

    def later(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.queue, (self.w.now + delay, next(self.seq), fn))

    def drive(self) -> str:
        w, script = self.w, self.w.plan.script
        for _ in range(MAX_ACTIONS):
            for cmd in self.sched.poll(w.now):
                if isinstance(cmd, Dispatch):
                    self._dispatch(cmd.request, cmd.stream)
                elif isinstance(cmd, Cancel):
                    self.cancelled.update(cmd.attempts)
                    self._cut_off(cmd.attempts)
                elif isinstance(cmd, Train):
                    self.later(_between(script.train_s, w.plan.seed, "train", cmd.step), lambda c=cmd: self._train(c))
                elif isinstance(cmd, Cut):
                    taken = cutting.take(cmd, snapshot=self.trainer.snapshot, journal=w.journal, trace=w.trace)
                    self._journal_kicked()
                    self.later(_between(script.write_s, w.plan.seed, "write", cmd.step, w.now),
                               lambda t=taken: self._write(t))
                elif isinstance(cmd, Refit):
                    self.later(_between(script.refit_s, w.plan.seed, "refit", cmd.version),
                               lambda v=cmd.version: self._refit(v))
                elif isinstance(cmd, Note):
                    w.trace.emit(cmd.event)
                elif isinstance(cmd, WakeAt):
                    if cmd.time > w.now:
                        heapq.heappush(self.queue, (cmd.time, next(self.seq), lambda: None))
                elif isinstance(cmd, Stop):
                    w.trace.flush()  # as the runner: then close the journal (its last flush), `run_finished`, the trace
                    journal, w.journal = w.journal, None  # closed once, even if its close fails
                    if journal is not None:
                        journal.close()
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
                self._journal_kicked()
            if w.journal is not None and w.now >= self.next_journal:
                self._journal_cycle()
                self.next_journal = w.now + self.journal_s
            fn()
        raise RuntimeError(f"the run did not stop within {MAX_ACTIONS} simulated actions")

    def _journal_kicked(self) -> None:
        """A release left `flush_events` records waiting: the journal's thread flushes now."""
        if self.w.journal is not None and self.w.journal.kicked:
            self._journal_cycle()

    def _journal_cycle(self) -> None:
        """One turn of the journal's thread; a disk fault stops it, and the loop sees it at
        its next event (`GroupCommit.check`: exit 5), as in the runner."""
        j = self.w.journal
        if j is None or j._error is not None:
            return
        try:
            j.cycle()
        except (OSError, FilesystemError) as e:
            j.fail(e)

    def _dispatch(self, req: GenRequest, stream: bool) -> None:
        script, seed = self.w.plan.script, self.w.plan.seed
        key = (req.group_id, req.generation, req.attempt)
        if stream:
            self.streaming.add(key)
        if _unit(seed, req.seed, "hang", req.infra_retries) < script.hang_rate:
            return  # never answers: the scheduler's deadline aborts it
        if _unit(seed, req.seed, "infra", req.infra_retries) < script.infra_fail_rate:
            outcome = Failure(INFRA, "InfraError: simulated")
        elif _unit(seed, req.seed, "data") < script.data_fail_rate:
            outcome = Failure(DATA, "simulated data failure")
        else:
            outcome = None  # a completion, built on arrival (the engine may have been refit)
        latency = _between(script.latency, seed, req.seed, "latency", req.attempt)
        if outcome is None and script.turns > 1:
            self._episode(key, req, latency)
            return
        if outcome is None and stream:  # it streams: one chunk per token, as it goes
            n = 1 + int(_unit(req.seed, "len") * script.completion_tokens)
            made = [] if req.prefix is None else [req.prefix]
            k = 0 if req.prefix is None else len(req.prefix)
            for i in range(k, n):
                self.later(latency * (i - k + 1) / (n - k + 1), lambda i=i: self._chunk(key, req, i, made))
            self.later(latency, lambda: self._deliver(key, req, None, made))
            return
        self.later(latency, lambda: self._deliver(key, req, outcome))

    def _episode(self, key, req: GenRequest, latency: float) -> None:
        """A multi-turn episode continued from `req.prefix` after `req.turns`, run by the real
        episode machine (`core.schedule.episode`, as `controller.episodes.run_episode` drives
        it) against the simulated engine (every model token a function of (seed, position),
        a turn's length of (seed, turn)) and a simulated deterministic environment
        (`simulate.episodes.SimEnv`: two environment tokens a turn). How the run's episodes
        end and recover is a function of the plan's seed: replay or snapshot, the
        environment done at its last turn or `env.max_turns` ending it, a turn cap, an engine
        budget. The timeline is in ticks, the episode's nominal length (every turn of full
        length) spread over the attempt's latency as its tokens: a model token takes one
        (streamed as a chunk when partial generations are on), the environment's answer
        one, its response two before the turn is reported; every callback is scheduled with
        `later` and first checks the attempt was not cancelled."""
        script, seed = self.w.plan.script, self.w.plan.seed
        turns, tokens = script.turns, script.completion_tokens
        recovery = SNAPSHOT if _unit(seed, "env", "recovery") < 0.5 else REPLAY
        done_at = turns if _unit(seed, "env", "done") < 0.5 else None
        cap = None if _unit(seed, "env", "cap") < 0.5 else 1 + int(_unit(seed, "env", "cap", 1) * tokens)
        budget = None if _unit(seed, "env", "budget") < 0.5 else \
            3 + int(_unit(seed, "env", "budget", 1) * turns * (tokens + 2))
        machine = Episode(req, tokenizer=SimTokenizer(), max_turns=turns, label="sim", recovery=recovery,
                          max_turn_tokens=cap, completion_limit=None if budget is None else lambda _p: budget)
        env = SimEnv(recovery, done_at)
        first, pos, n = len(req.prefix) if req.prefix is not None else 0, 0, 0
        for turn in range(turns):  # the nominal timeline's ticks still to come
            m = 1 + int(_unit(req.seed, "len", turn) * tokens)
            n += sum(pos + i >= first for i in range(m))
            pos += m
            if turn < turns - 1:
                n += (pos >= first) + (pos + 1 >= first) + (pos + 2 >= first and turn >= len(req.turns))
                pos += 2
        tick = latency / (n + 1)
        self._episode_step(key, machine, machine.begin(), env, tick, budget)

    def _episode_step(self, key, machine: Episode, cmd: EpisodeCommand, env: SimEnv, tick: float,
                      budget: int | None, waited: bool = False) -> None:
        """Carry out the episode machine's commands, each when it is due: the environment's
        step a tick after the turn's last token, a finished turn's report two after that (its
        response's tokens), a generation's tokens one a tick (`_episode_generate`), the rest
        at once. `waited`: `cmd` is due now."""
        if key in self.cancelled:
            return
        while True:
            ticks = 1 if isinstance(cmd, EnvStep) else 2 if isinstance(cmd, Turn) else 0
            if ticks and not waited:
                self.later(ticks * tick, lambda c=cmd: self._episode_step(key, machine, c, env, tick, budget, True))
                return
            waited = False
            match cmd:
                case EnvBuild():
                    cmd = machine.on_built()  # (the environment is made up front: it holds no state before reset)
                case EnvRestore(snapshot=snapshot):
                    env.restore(snapshot)
                    cmd = machine.on_restored()
                case EnvReset(row=row, seed=seed):
                    env.reset(row, seed)
                    cmd = machine.on_reset()
                case EnvReplay(turn=turn, text=text) if self.w.plan.effects:
                    self._step_effect(key, machine, machine.on_replayed, env.step(text), turn, text, env, tick, budget)
                    return
                case EnvReplay(text=text):
                    cmd = machine.on_replayed(env.step(text))
                case EnvStep(turn=turn, text=text) if self.w.plan.effects:
                    self._step_effect(key, machine, machine.on_step, env.step(text), turn, text, env, tick, budget)
                    return
                case EnvStep(text=text):
                    cmd = machine.on_step(env.step(text))
                case EnvSnapshot():
                    cmd = machine.on_snapshot(env.snapshot())
                case Turn(trajectory=traj, turn=turn, snapshot=snapshot):
                    self.sched.on_turn(key, traj, turn, snapshot)
                    cmd = machine.on_reported()
                case Generate(request=turn_req):
                    self._episode_generate(key, machine, turn_req, env, tick, budget)
                    return
                case Done(completion=completion, reward=reward):
                    self.sched.on_result(key, Generated(completion, reward), self.w.now)
                    return

    def _episode_generate(self, key, machine: Episode, turn_req: GenRequest, env: SimEnv, tick: float,
                          budget: int | None) -> None:
        """The simulated engine's model turn: it continues `turn_req.prefix` up to the turn's
        length, within `turn_req.max_tokens` and the budget; each token made under the
        version the engine holds then, then the completion fed to the machine."""
        req = machine.req
        made = [] if turn_req.prefix is None else [turn_req.prefix]
        first = len(turn_req.prefix) if turn_req.prefix is not None else 0
        start = turn_req.turns[-1] if turn_req.turns else 0
        end = start + 1 + int(_unit(req.seed, "len", len(turn_req.turns)) * self.w.plan.script.completion_tokens)
        for limit in (turn_req.max_tokens, budget):
            end = end if limit is None else min(end, limit)

        def token(pos: int) -> None:
            if key in self.cancelled:
                return
            chunk = self._token(req, pos)
            made.append(chunk)
            if key in self.streaming:
                self.sched.on_progress(key, chunk, self.w.now)

        def generated() -> None:
            if key in self.cancelled:
                return
            ids, logprobs, versions = ((np.concatenate([getattr(c, f) for c in made]) for f in TOKEN_FIELDS)
                                       if made else (np.zeros(0, np.int32), np.zeros(0, np.float32),
                                                     np.zeros(0, np.int32)))
            c = Completion(prompt_ids=np.arange(3, dtype=np.int32), completion_ids=ids, logprobs=logprobs,
                           versions=versions, finish_reason="stop", text="")
            self._episode_step(key, machine, machine.on_generated(c), env, tick, budget)

        for j, pos in enumerate(range(first, end)):
            self.later(tick * (j + 1), lambda pos=pos: token(pos))
        self.later(tick * max(1, end - first), generated)  # (after the last token: scheduled after it)

    def _token(self, req: GenRequest, pos: int) -> Chunk:
        """The simulated engine's token at `pos`: a function of (seed, position), made
        under the version the engine holds now (or the pinned one)."""
        version = self.engine_version if req.pinned_version is None else req.pinned_version
        return Chunk(np.array([int(_unit(req.seed, "tok", pos) * 10)], np.int32), np.full(1, -0.5, np.float32),
                     np.full(1, version, np.int32))

    def _chunk(self, key, req: GenRequest, i: int, made: list) -> None:
        if key in self.cancelled:
            return
        chunk = self._token(req, i)
        made.append(chunk)
        self.sched.on_progress(key, chunk, self.w.now)

    def _deliver(self, key, req: GenRequest, outcome, made: list | None = None) -> None:
        if key in self.cancelled:
            return
        if outcome is None:
            n = 1 + int(_unit(req.seed, "len") * self.w.plan.script.completion_tokens)
            ids = np.array([int(_unit(req.seed, "tok", i) * 10) for i in range(n)], np.int32)
            version = self.engine_version if req.pinned_version is None else req.pinned_version
            logprobs, versions = np.full(n, -0.5, np.float32), np.full(n, version, np.int32)
            if made:  # streamed: the prefix's tokens and the chunks, as reported
                ids, logprobs, versions = (np.concatenate([getattr(c, f) for c in made])
                                           for f in ("completion_ids", "logprobs", "versions"))
            completion = Completion(prompt_ids=np.arange(3, dtype=np.int32), completion_ids=ids,
                                    logprobs=logprobs, versions=versions,
                                    finish_reason="stop", text="".join(map(str, ids.tolist())))
            if self.w.plan.effects:  # the reward function calls the judge
                calls = reward_requests(req.group_id, req.generation, ids, versions, self.w.plan.judge_calls)
                self._reward(key, completion, calls, [])
                return
            outcome = Generated(completion, float(ids[0] % 2))
        self.sched.on_result(key, outcome, self.w.now)

    # -- calls to the outside (`controller.effects`, on the fake clock)

    def _reward(self, key, completion: Completion, requests: list[dict], rewards: list[float]) -> None:
        """The reward stage of a single-turn attempt, between the engine's answer and
        `on_result`: its calls to the judge one after the other (indexes 0, 1, ... of turn
        REWARD_TURN), the reward the mean of their answers."""
        i = len(rewards)
        if i == len(requests):
            self.sched.on_result(key, Generated(completion, sum(rewards) / len(rewards)), self.w.now)
            return
        self._effect(key, REWARD_TURN, i, requests[i],
                     lambda result: self._reward(key, completion, requests, [*rewards, reward_of(result)]))

    def _step_effect(self, key, machine: Episode, fed: Callable[[Step], EpisodeCommand], step: Step, turn: int,
                     text: str, env: SimEnv, tick: float, budget: int | None) -> None:
        """An environment step (or the replay of one) that calls the judge, as an environment
        calling `effects.call_sync` in its `step` does (index 0 of its turn: a replay's call
        is answered from the record of the call it repeats): the step's reward is the answer."""
        def answered(result: bytes) -> None:
            self._episode_step(key, machine, fed(step._replace(reward=reward_of(result))), env, tick, budget)

        self._effect(key, turn, 0, step_request(key[0], key[1], turn, text), answered)

    def _effect(self, key, turn: int, index: int, request: dict, then: Callable[[bytes], None]) -> None:
        """One call to the judge, carried out as `controller.effects.AttemptEffects.call`
        does: the scheduler decides (`on_effect`). Answer: the recorded outcome, nothing is
        called. A new call: the trace is flushed (which releases its intent to the journal)
        and the journal's cycle that makes the intent durable awaited, then it is made and
        its outcome recorded (`on_effect_done`). Sent again (`retry`): the recorded key,
        without a new intent or a wait. Unknown, or no longer in flight: the attempt fails
        as data. `then(result)` goes on with an ok outcome; an error fails the attempt as
        data (the reward function raised `EffectFailed`)."""
        if key in self.cancelled:
            return
        w = self.w
        body, dig = digest(request)
        decision = self.sched.on_effect(key, turn=turn, index=index, kind=JUDGE, digest=dig,
                                        policy=w.plan.on_unknown, run=RUN)
        if decision is None:
            self._fail(key, "the attempt is no longer in flight")
        elif isinstance(decision, Unknown):
            self._fail(key, f"{EFFECT_UNKNOWN}: the outcome of {decision.kind} call {decision.key} was lost with a "
                       f"process (on_unknown={w.plan.on_unknown})")
        elif isinstance(decision, Answer):
            w.book.answered += 1
            w.trace.emit(EffectAnswered(group_id=key[0], generation=key[1], attempt=key[2], kind=JUDGE,
                                        key=decision.key))
            self._outcome(key, decision.key, decision.ok, decision.result, then)
        elif w.journal is not None and not decision.again:
            w.trace.flush()  # the trace first (the journal is never ahead of it): releases the intent
            self._journal_kicked()
            self._when_durable(key, w.journal.position()[0], lambda: self._call(key, decision, turn, index, body, then))
        else:
            self._call(key, decision, turn, index, body, then)

    def _when_durable(self, key, seq: int, then: Callable[[], None]) -> None:
        """`then()` once the journal has made every record through `seq` durable, as
        `JournalThread.durable`, which kicks a cycle (one fsync away); never for an attempt
        cancelled meanwhile (its task is cancelled in the wait: nothing is called). A
        journal that failed stops the process (exit 5), as the failed wait does."""
        j = self.w.journal
        if key in self.cancelled or j is None:  # (None: the run stopped and closed it)
            return
        j.check()
        if j.journal.durable_seq >= seq:
            then()
            return

        def kicked() -> None:
            self._journal_cycle()
            self._when_durable(key, seq, then)

        self._kick(kicked)

    def _kick(self, cycle: Callable[[], None] | None = None) -> None:
        """The journal's thread woken (`JournalThread.kick`): its cycle runs a moment later."""
        self.later(_between(self.w.plan.script.fsync_s, self.w.plan.seed, "fsync", self.w.now),
                   cycle or self._journal_cycle)

    def _call(self, key, decision: Call, turn: int, index: int, body: bytes, then: Callable[[bytes], None]) -> None:
        """The call itself: the judge (outside the process) receives it now and its answer
        arrives after its latency; an attempt cut off meanwhile records no outcome."""
        if key in self.cancelled:
            return
        w = self.w
        gid, gen, attempt = key
        w.book.called(decision.key, gid=gid, gen=gen, attempt=attempt, turn=turn, index=index)
        ok, result = w.judge.call(decision.key, body)
        self.calling[key] = decision.key
        latency = _between(w.plan.script.judge_s, w.plan.seed, "judge", decision.key, w.judge.calls[decision.key])
        self.later(latency, lambda: self._called(key, decision, ok, result, then))

    def _called(self, key, decision: Call, ok: bool, result: bytes, then: Callable[[bytes], None]) -> None:
        """The judge's answer arrived: recorded as the outcome, whose journal cycle is
        kicked, not awaited (a crash before it leaves the intent without outcome)."""
        w, effect = self.w, decision.key
        if key in self.cancelled:  # (counted as cut off when it was cancelled)
            return
        del self.calling[key]
        if decision.again:
            w.trace.emit(EffectAnswered(group_id=key[0], generation=key[1], attempt=key[2], kind=JUDGE, key=effect,
                                        resent=True))
        if not self.sched.on_effect_done(key, effect, ok, result):
            w.book.cut_off(effect)
            self._fail(key, "the attempt is no longer in flight")
            return
        if w.journal is not None:
            w.trace.flush()
            self._kick()
        self._outcome(key, effect, ok, result, then)

    def _cut_off(self, attempts) -> None:
        """Cancelled attempts whose call to the judge is in flight: the call happened (or is
        happening) and its outcome will never be recorded, so a later attempt of the
        sibling may send its key again (`retry`) while it is still out there."""
        for key in attempts:
            if key in self.calling:
                self.w.book.cut_off(self.calling.pop(key))

    def _outcome(self, key, effect: str, ok: bool, result: bytes, then: Callable[[bytes], None]) -> None:
        if ok:
            then(result)
        else:
            self._fail(key, f"EffectFailed: {JUDGE} call {effect}: {result.decode('utf-8', 'replace')}")

    def _fail(self, key, error: str) -> None:
        self.sched.on_result(key, Failure(DATA, error), self.w.now)

    def _train(self, cmd: Train) -> None:
        plan = self.w.plan
        if plan.effects:  # every reward trained on is the judge's
            for g in cmd.batch.groups:
                for gen, row in enumerate(g.rows):
                    self.w.book.trained(g.group_id, gen, row, turns=plan.script.turns, calls=plan.judge_calls)
        self.trainer.train_step(cmd.batch)
        self.sched.on_trained(cmd.step)

    def _refit(self, version: int) -> None:
        self.engine_version = version
        self.sched.on_refit(version)

    def _write(self, taken: cutting.TakenCut) -> None:
        w = self.w
        meta = cutting.checkpoint_meta(w.source, {}, w.run_id, writer="simulate", journal=taken.position)
        # The toy's own `save` writes real files; the simulated disk takes them through its fs.
        save = save_files({STATE_FILE: taken.snapshot.state()}, w.fs)
        w.trace.emit(cutting.write(taken, store=w.store, journal=w.journal, trace=w.trace, meta=meta,
                                   keep_last=w.plan.keep_last, trainer_save=save))
        self.sched.on_cut_written(taken.cmd.step)

"""The scheduler: every decision of an asynchronous RL run, as a pure, synchronous object.

It owns the ledger and the row store together (rows a transition frees are deleted here,
never by the caller), reads no clock (time is an argument), performs no IO and never
waits. A runner drives it (h11's pattern):

    sched = Scheduler(ledger, rows, source, sampler, settings,
                      sinks=Sinks(trace=..., journal=..., crash=...))  # after every ledger event
    restored_fields = sched.start(restored)
    while True:
        for cmd in sched.poll(now()):      # Dispatch, Cancel, Train, Cut, Refit, Evaluate, Note, WakeAt, Stop
            carry it out; report back with on_result / on_trained / on_cut_written / on_refit / on_evaluated
        (on SIGINT/SIGTERM: on_signal())

Two sides, as docs/design.md §2 draws them:

- the **rollout side** (the rollout pump) tops up the spare pool, admits and takes prompts
  through the sampler's gate (`admission`), dispatches every RESERVED sibling whose
  backoff has passed (restored ADMITTED groups first: they have the lowest keys), seals or
  fails results as they arrive (`retry`), finalizes complete groups (`finalize`) and aborts
  attempts past their deadline;
- the **train side** (the train pump) is the state machine of `TRAIN_TABLE`: refit the
  engine, claim the next step's batch from the sampler, train it, commit, cut a checkpoint
  at the step boundary when one is due, refit, and so on; and when the run stops (finished,
  data exhausted, a signal), abandon what is in flight and write the final cut.

Deterministic mode (`pinning`) and restart normalisation (`restart`) are policies of their
own modules.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from .. import crashpoints
from ..checkpoint.cut import cut
from ..custody.events import (
    ALL_EVENTS,
    DATA,
    INFRA,
    PROMPT_GROUP,
    SIBLING,
    Abandoned,
    Claimed,
    Configured,
    Dispatched,
    EffectDone,
    EffectIntent,
    Event,
    Evicted,
    Failed,
    Sealed,
    event_name,
)
from ..custody.ledger import AttemptStatus, GroupState, Ledger
from ..custody.trace_schema import CheckpointSkipped
from ..errors import CustodyError, DatasetMismatch
from ..journal.replay import LostWork
from ..restore.chain import Restored, RestorePlan
from ..rollout.advantages import MAX_REWARD, ScaleRewards
from ..rollout.batch import Batch, TrainGroup
from ..rollout.effects import EFFECT_UNKNOWN, FAIL, Call, Decision, EffectStore, effect_key
from ..rollout.generation import Chunk, GenRequest, sampling_seed
from ..rollout.prefixes import PrefixStore
from ..rollout.rows import Row, row_id_of
from ..rollout.rowstore import RowStore
from ..rollout.samplers import Sampler
from ..rollout.source import PromptSource
from ..rollout.take import check_step_size, drop_event
from . import admission, restart
from .commands import (
    AttemptKey,
    Cancel,
    Command,
    Cut,
    Dispatch,
    Evaluate,
    Failure,
    Generated,
    Note,
    Outcome,
    Reason,
    Refit,
    Stop,
    Train,
    WakeAt,
)
from .failfast import FailFast, Watch
from .finalize import finalize
from .partial import PartialGenerations
from .pinning import Pinning
from .retry import RetryPolicy, budget_reason

_READY_TO_FINALIZE = int(GroupState.READY_TO_FINALIZE)
_A_RESERVED = int(AttemptStatus.RESERVED)


def _greatest(arr: np.ndarray) -> int:
    """The largest element of a non-empty integer array (once per sibling; `argmax` is a
    third of a ufunc reduction's cost on a completion's versions)."""
    return arr.item(arr.argmax())


crashpoints.register("train.before_commit")
crashpoints.register("train.after_commit")
for _ev in ALL_EVENTS:  # `ledger.<event>`: after every sink saw the event (`crash_point`)
    crashpoints.register("ledger." + event_name(_ev))


def crash_point(ev: Event) -> None:
    """The `crash` sink of a real run: crash point `ledger.<event>`."""
    crashpoints.hit("ledger." + ev.__struct_config__.tag)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Settings:
    """The run's settings the scheduler decides from; the defaults are `rollkeep train`'s."""

    group_size: int = 4  # siblings per prompt (rollout.group_size)
    total_steps: int = 20  # train.total_steps
    seed: int = 0  # sampling seeds derive from it (seed)
    checkpoint_every: int = 5  # a cut every this many steps (checkpoint.every_steps)
    checkpoint_on_shutdown: bool = True  # checkpoint.on_shutdown
    deterministic: bool = False  # pin generation to versions (docs/design.md §7)
    recovery_mode: str = "sibling"  # sibling | prompt_group | cursor_only
    on_dropped_prompt: str = "replace"  # replace | shrink
    on_stale: str = "regenerate"  # regenerate | drop
    spare_prompts: int = 0  # rollout.spare_prompts
    timeout_s: float = 600.0  # an attempt's deadline (rollout.timeout_s)
    retry: RetryPolicy = RetryPolicy(max_infra_attempts=3, max_data_attempts=2, backoff_ms=10.0,
                                     backoff_max_ms=2000.0)
    scale_rewards: ScaleRewards = "group_population"  # trainer.scale_rewards
    record_partial: bool = False  # record streamed chunks as `progressed` events (the journal on)
    resume_partial: bool = False  # and continue cut-off siblings from them (recovery.partial: resume)
    progress_every_s: float = 0.25  # an attempt records its chunks at most this often (recovery.progress_ms)
    lost_versions: str = "keep"  # keep | regenerate: work generated under lost versions (recovery.lost_versions)
    eval_every: int = 0  # Evaluate the weights of every version divisible by it (eval.every_steps; 0: never)
    env_phase_s: float | None = None  # the cut's environment phase, at most this long (env.cut_timeout_s); None: none
    fail_fast_attempts: int = 0  # stop when the first this many attempts fail alike (rollout.fail_fast_attempts; 0: off)


@dataclass(frozen=True)
class Sinks:
    """What follows every ledger event, in the order the scheduler fixes: the prefix store
    (its own), then the trace (the line is buffered), then the journal (the record is staged
    behind it: the journal is never ahead of the trace), then the crash points."""

    trace: Callable[[Event], object] | None = None
    journal: Callable[[Event], object] | None = None
    crash: Callable[[Event], object] | None = None

    def in_order(self) -> tuple[Callable[[Event], object], ...]:
        return tuple(s for s in (self.trace, self.journal, self.crash) if s is not None)


class Phase(enum.Enum):
    """The train side's state."""

    START = "start"  # the engine has not been given the trainer's weights yet
    REFITTING = "refitting"  # Refit issued: waiting for on_refit
    EVALUATING = "evaluating"  # Evaluate issued: waiting for on_evaluated
    IDLE = "idle"  # may claim the next step
    TRAINING = "training"  # Train issued: waiting for on_trained
    COMMITTED = "committed"  # the step committed: its cut (if due), then the refit
    STOPPING = "stopping"  # the run stops: abandon what is in flight, then the final cut
    FINAL_CUT = "final_cut"  # the final cut is being written
    STOPPED = "stopped"


#: (phase, what happened) → next phase. Pairs not listed are a bug (CustodyError).
TRAIN_TABLE: dict[tuple[Phase, str], Phase] = {
    (Phase.START, "refit"): Phase.REFITTING,
    (Phase.START, "stop"): Phase.STOPPING,
    (Phase.REFITTING, "refitted"): Phase.IDLE,
    (Phase.REFITTING, "evaluate"): Phase.EVALUATING,
    (Phase.EVALUATING, "evaluated"): Phase.IDLE,
    (Phase.IDLE, "claim"): Phase.TRAINING,
    (Phase.IDLE, "stop"): Phase.STOPPING,
    (Phase.TRAINING, "trained"): Phase.COMMITTED,
    (Phase.COMMITTED, "refit"): Phase.REFITTING,
    (Phase.COMMITTED, "stop"): Phase.STOPPING,
    (Phase.STOPPING, "final_cut"): Phase.FINAL_CUT,
    (Phase.STOPPING, "stopped"): Phase.STOPPED,
    (Phase.FINAL_CUT, "written"): Phase.STOPPED,
}


class Scheduler:
    def __init__(
        self,
        *,
        ledger: Ledger,
        rows: RowStore,
        source: PromptSource,
        sampler: Sampler,
        settings: Settings,
        prefixes: PrefixStore | None = None,
        effects: EffectStore | None = None,
        sinks: Sinks | None = None,
        wall_clock: Callable[[], float] | None = None,
    ) -> None:
        self.ledger, self.rows, self.source, self.sampler, self.settings = ledger, rows, source, sampler, settings
        self.prefixes = PrefixStore() if prefixes is None else prefixes
        self.effects = EffectStore() if effects is None else effects
        sibling = settings.recovery_mode == "sibling"
        self.partial = PartialGenerations(
            self.prefixes, enabled=settings.record_partial and sibling,
            resume=settings.record_partial and settings.resume_partial and sibling, every_s=settings.progress_every_s,
            turns=sibling)
        limits = sampler.limits
        self.pinning = Pinning(settings.deterministic, limits.window, limits.num_prompts_per_step,
                               settings.total_steps)
        # cursor_only emulates systems without a ledger; its groups are plain sibling groups.
        self._granularity = PROMPT_GROUP if settings.recovery_mode == "prompt_group" else SIBLING
        self.phase = Phase.START
        self.stopping: Reason | None = None
        self.engine_version: int | None = None  # the weights the engine holds (on_refit)
        self.tokens_generated = 0  # completion tokens this run's sealed attempts generated
        self._step: int | None = None  # the step being trained
        self._step_tokens = 0  # and the completion tokens of its batch
        self._writing = False  # a cut is being written (one at a time)
        self._changed_since_cut = True
        self._in_flight: dict[AttemptKey, float] = {}  # dispatched attempt → its deadline
        self._deadlines: list[tuple[float, tuple[AttemptKey, ...]]] = []  # heap of dispatches; entries may be stale
        self._not_before: dict[tuple[str, int], float] = {}  # backoff of a retried sibling
        self._queued: list[Command] = []  # commands decided inside a callback
        # Restored groups admitted under a version this lineage has not reached (a journal
        # replay took back the steps after it): gid -> that version, below which their
        # siblings are not generated (docs/design.md §5.1, lost versions).
        self._floor: dict[str, int] = {}
        self._wall = wall_clock  # the unix time a cut records (None: the real one)
        # The cut's environment phase (`_env_quiet`): the environment steps in flight, and
        # while the gate is closed, until when it waits for them (and since when).
        self._env_steps: set[AttemptKey] = set()
        self._env_hold: tuple[float, float] | None = None  # (since, deadline)
        self._env_phase = (0.0, 0)  # the last phase's wait and retired steps, for its Cut
        self._now = 0.0  # the poll's clock
        # Fail fast on a bug in user code (failfast.py): while it watches, a group whose data
        # budget is spent is parked here (gid -> its drop reason), neither retried nor dropped.
        self.fail_fast = FailFast(settings.fail_fast_attempts)
        self._parked: dict[str, str] = {}
        self.user_code_failure: str | None = None  # set when it trips: every first attempt failed with this
        ledger.subscribe(self._on_event)
        for sink in () if sinks is None else sinks.in_order():
            ledger.subscribe(sink)

    # ============================================================== wiring

    def subscribe(self, sink) -> None:
        """`sink(event)` after every ledger event, after the `sinks` the scheduler was built with."""
        self.ledger.subscribe(sink)

    def _on_event(self, ev: Event) -> None:
        # The first subscriber: the prefix store and the effect records follow the event
        # before the journal sees it.
        self.prefixes.apply(ev)
        self.effects.apply(ev)
        if type(ev) is not Configured:  # limits alone give a checkpoint nothing new
            self._changed_since_cut = True

    def _apply(self, ev: Event) -> None:
        """Apply an event and delete the rows it frees: the only way this class mutates."""
        for key in self.ledger.apply(ev):
            self.rows.delete(row_id_of(key))

    def _go(self, what: str) -> None:
        nxt = TRAIN_TABLE.get((self.phase, what))
        if nxt is None:
            raise CustodyError(
                f"scheduler: '{what}' in phase {self.phase.value}",
                expected="a pair of TRAIN_TABLE",
                found=f"({self.phase.value}, {what})",
                remedy="this is a bug in the scheduler or its runner",
            )
        self.phase = nxt

    # ============================================================== start

    def start(self, restored: Restored | RestorePlan | None, *, epochs: int | None,
              replayed: bool = False, lost: LostWork | None = None) -> dict[str, Any] | None:
        """Record the run's limits; after a restore (the chain's `Restored`, or the plan of the
        ledger the scheduler was built on), normalise the ledger (docs/design.md §5) and
        return the counts of the `restored` trace event. `replayed`: the ledger is the
        checkpoint's with a journal tail replayed (docs/design.md §5.1), so it differs from
        every checkpoint: the next cut, the final one included, is written even if nothing
        else changes (LATEST alone then holds what the tail did). `lost`: what the tail
        generated under lost versions, regenerated under `lost_versions: regenerate`."""
        limits = self.sampler.limits
        self._apply(Configured(num_prompts_per_step=limits.num_prompts_per_step, window=limits.window,
                               epochs=epochs))
        # The state is the restored checkpoint's (or empty); what normalising it changes
        # (abandoned attempts, cursor_only's losses) counts as a change for the next cut.
        self._changed_since_cut = replayed
        fields = None
        if restored is not None:
            restart.normalize(self.ledger, self._apply)
            lost_fields = restart.lost_versions(self.ledger, lost or LostWork(), self.settings.lost_versions,
                                                self._apply, self.prefixes)
            lost = 0
            if self.settings.recovery_mode == "cursor_only":
                lost_ids = restart.lost_in_flight(self.ledger)
                for gid in lost_ids:
                    self._drop(gid, Reason.LOST.value, on_dropped_prompt="replace")
                lost = len(lost_ids)
            plan = restored if isinstance(restored, RestorePlan) else restored.plan
            fields = restart.restored_fields(plan, lost=lost, mode=self.settings.recovery_mode)
            if not self.partial.resume:  # recovery.partial=regenerate (or no journal): the turn in flight starts over
                if self.partial.turns:
                    self.prefixes.keep_whole_turns()
                else:
                    self.prefixes.restore({})
            fields.update(partial_generations=len(self.prefixes), partial_tokens=self.prefixes.tokens(),
                          turns_reused=self.prefixes.turns(), **lost_fields, **self.effects.counts())
            # Groups sealed but not finalized at the cut are finalized again (no side effects).
            for gid, rec in self.ledger.groups():
                if rec.state == GroupState.READY_TO_FINALIZE:
                    finalize(self.ledger, self.rows, gid, self.settings.scale_rewards, self._apply)
        v = self.ledger.version
        self._floor = {gid: rec.start_version for gid, rec in self.ledger.groups()
                       if rec.start_version is not None and rec.start_version > v}
        return fields

    # ============================================================== poll

    def poll(self, now: float) -> list[Command]:
        """Everything to do now, in order. Call again after any callback, and at WakeAt."""
        out: list[Command] = []
        self._now = now
        self._expire(now, out)
        # The train side first: what it evicts or drops frees room the rollout side fills
        # in the same poll (nothing the rollout side does can make a group READY).
        self._train_side(out)
        wake = None
        # Nothing is generated before the engine holds the trainer's weights (the first Refit).
        if self.stopping is None and self.phase is not Phase.STOPPED and self.engine_version is not None:
            admission.top_up_spare(self.ledger, self.settings.spare_prompts, self._apply)
            admission.admit_and_take(
                self.ledger, self.source, self.sampler, group_size=self.settings.group_size,
                granularity=self._granularity, total_steps=self.settings.total_steps,
                start_version=lambda target: self.pinning.start_version(target, self.ledger.version),
                apply=self._apply,
            )
            wake = self._dispatch(now, out)
            if self._parked and wake is None and not self._in_flight:  # nothing left to decide with
                self.fail_fast.give_up()
                self._release_parked()
        if self._deadlines:
            wake = self._deadlines[0][0] if wake is None else min(wake, self._deadlines[0][0])
        if self._env_hold is not None:  # the cut's environment phase ends by then
            wake = self._env_hold[1] if wake is None else min(wake, self._env_hold[1])
        if wake is not None and self.phase is not Phase.STOPPED:
            out.append(WakeAt(wake))
        # Cancels decided in callbacks (and in this poll) go first: their attempts are
        # already superseded, so nothing waits for them.
        out[:0], self._queued = self._queued, []
        if self._writing:  # a Cut was decided (this poll or in flight): capture it now
            return [self._captured(c) if type(c) is Cut else c for c in out]
        return out

    # -------------------------------------------------------------- rollout side

    def _dispatch(self, now: float, out: list[Command]) -> float | None:
        """Dispatch every RESERVED sibling of admitted groups whose backoff has passed;
        return when the next backoff expires, if one is pending."""
        led, wake_at = self.ledger, None
        for gid in led.pending_ids():
            if gid in self._parked:
                continue  # its drop waits for the fail-fast watch
            rec = led.group(gid)
            pinned = self.pinning.version_for(rec.target_step)
            if pinned is not None and self.engine_version != pinned:
                if self.engine_version > pinned:
                    raise CustodyError(
                        f"deterministic mode: group {gid} of step {rec.target_step} would "
                        f"generate under version {self.engine_version}",
                        expected=f"version {pinned}",
                        found=f"engine at version {self.engine_version}",
                        remedy="this is a bug in the scheduler's refit ordering",
                    )
                continue  # waits for the refit to its pinned version
            floor = self._floor.get(gid) if pinned is None else None
            if floor is not None:  # admitted under a lost version: never generated under older weights
                if self.engine_version is None or self.engine_version < floor:
                    continue  # waits for the lineage to reach it (the refit after that step wakes us)
                del self._floor[gid]
            gens = [g for g, st in enumerate(rec.status) if st == _A_RESERVED]
            if self._not_before:  # siblings retried after a failure wait for their backoff
                due = []
                for g in gens:
                    nb = self._not_before.get((gid, g))
                    if nb is not None and nb > now:
                        wake_at = nb if wake_at is None else min(wake_at, nb)
                    else:
                        self._not_before.pop((gid, g), None)
                        due.append(g)
                gens = due
            if not gens:
                continue
            self._apply(Dispatched(group_id=gid, generations=tuple(gens), version=self.engine_version))
            rec = led.group(gid)
            prompt = self.source.rehydrate(rec.key)
            if (prompt.idx, prompt.task, prompt.row_fingerprint) != (rec.idx, rec.task, rec.row_fingerprint):
                raise DatasetMismatch(  # restore step 7 checked it; a dataset that changes under the run
                    f"the prompt rebuilt for {gid} is not the one its group recorded", field="row_fingerprint",
                    expected=f"idx {rec.idx}, task {rec.task!r}, row fingerprint {rec.row_fingerprint:016x}",
                    found=f"idx {prompt.idx}, task {prompt.task!r}, row fingerprint {prompt.row_fingerprint:016x}",
                    remedy="the dataset changed while the run read it (a dataset object whose rows change); "
                    "keep it fixed for the run, then resume (the restore checks every recorded row)")
            deadline = now + self.settings.timeout_s
            seed, stream, partial, in_flight = self.settings.seed, self.partial.enabled, self.partial, self._in_flight
            keys = []
            for g in gens:
                attempt, data_retries = rec.attempts[g], rec.data_failures[g]
                key = (gid, g, attempt)
                prefix, turns, snapshot = partial.prefix_for(key)
                req = GenRequest(
                    group_id=gid, generation=g, attempt=attempt, prompt=prompt,
                    seed=sampling_seed(seed, gid, g, data_retries),
                    pinned_version=pinned, infra_retries=rec.infra_failures[g], data_retries=data_retries,
                    prefix=prefix, turns=turns, snapshot=snapshot,
                )
                in_flight[key] = deadline
                keys.append(key)
                out.append(Dispatch(req, stream=stream))
            # One heap entry for the siblings dispatched together: they share the deadline.
            heapq.heappush(self._deadlines, (deadline, tuple(keys)))
        return wake_at

    def _expire(self, now: float, out: list[Command]) -> None:
        """Attempts past their deadline (`rollout.timeout_s`) fail as infra and are aborted."""
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, keys = heapq.heappop(self._deadlines)
            for key in keys:
                if self._in_flight.get(key) != deadline:
                    continue  # finished or cancelled already
                out.append(Cancel((key,)))
                self.on_result(key, Failure(INFRA, f"deadline: no result within rollout.timeout_s="
                                                   f"{self.settings.timeout_s:g} s"), now)

    def on_progress(self, key: AttemptKey, chunk: Chunk, now: float) -> None:
        """New tokens of an in-flight attempt, streamed by the engine; recorded as coalesced
        `progressed` events (`partial`). Ignored for an attempt no longer in flight."""
        if key in self._in_flight:
            self.partial.on_chunk(key, chunk, now, self._apply)

    def on_turn(self, key: AttemptKey, trajectory: Chunk, turn: int, snapshot: bytes | None = None) -> None:
        """An in-flight attempt finished turn `turn` of its episode: `trajectory` is every
        token so far (the environment's response to the turn last), recorded as a
        `turn_sealed` event. Ignored for an attempt no longer in flight."""
        if key in self._in_flight:
            self.partial.on_turn(key, trajectory, turn, snapshot, self._apply)

    def on_effect(self, key: AttemptKey, *, turn: int, index: int, kind: str, digest: int, policy: str,
                  run: str) -> Decision | None:
        """Call `index` of turn `turn` of the in-flight attempt `key` to the outside
        (docs/design.md §13): what the sibling's records decide (`EffectStore.decide`);
        a new call is announced by an `effect_intent` event, which the driver makes durable
        before it makes the call. None for an attempt no longer in flight (nothing recorded:
        its result is ignored anyway)."""
        if key not in self._in_flight:
            return None
        gid, g, attempt = key
        decision = self.effects.decide(gid, g, turn=turn, index=index, kind=kind, digest=digest,
                                       new_key=effect_key(run, gid, g, attempt, turn, index))
        if isinstance(decision, Call) and not decision.again:
            self._apply(EffectIntent(group_id=gid, generation=g, attempt=attempt, turn=turn, index=index, kind=kind,
                                     key=decision.key, digest=digest, policy=policy))
        return decision

    def on_effect_done(self, key: AttemptKey, effect: str, ok: bool, result: bytes) -> bool:
        """The outcome of the call `effect` (its idempotency key) of the in-flight attempt
        `key`, recorded as an `effect_done` event. False (nothing recorded) for an attempt
        no longer in flight."""
        if key not in self._in_flight:
            return False
        gid, g, attempt = key
        self._apply(EffectDone(group_id=gid, generation=g, attempt=attempt, key=effect, ok=ok, result=result))
        return True

    def on_result(self, key: AttemptKey, outcome: Outcome, now: float) -> None:
        """Seal or fail one attempt (one transition, plus finalize or drop). A result for an
        attempt that is no longer current (abandoned, its group dropped) is ignored."""
        in_flight = self._in_flight.pop(key, None) is not None
        gid, g, attempt = key
        led = self.ledger
        if not led.is_current(gid, g, attempt):
            self.partial.forget(key)
            return
        sealing = isinstance(outcome, Generated)
        if sealing:
            # Its last chunks are recorded before its seal (or forgotten if it fails after all).
            resumed = self.partial.before_seal(key, self._apply) if in_flight else 0
            if not in_flight:
                self.partial.forget(key)
            checked = self._checked(gid, g, outcome)
            sealing, outcome = checked is outcome, checked  # else the data failure that says why
        else:
            self.partial.forget(key)
        if sealing:
            c = outcome.completion
            row = Row(prompt_ids=c.prompt_ids, completion_ids=c.completion_ids, logprobs=c.logprobs,
                      versions=c.versions, reward=outcome.reward, finish_reason=c.finish_reason)
            tokens = len(row.completion_ids)
            self.rows.put(row_id_of(key), row)
            version = _greatest(row.versions) if tokens else self.engine_version
            self._apply(Sealed(group_id=gid, generation=g, attempt=attempt, version=version, tokens=tokens,
                               resumed_from=resumed, replica=outcome.replica))
            self.tokens_generated += tokens - resumed  # a continued prefix was generated before
            if led.group(gid).state == _READY_TO_FINALIZE:
                finalize(led, self.rows, gid, self.settings.scale_rewards, self._apply)
            if self.fail_fast.watching:  # the code works: what it parked is dropped as its budgets said
                self.fail_fast.sealed()
                self._release_parked()
            return
        self._apply(Failed(group_id=gid, generation=g, attempt=attempt, kind=outcome.kind,
                           error=outcome.error[:500], replica=outcome.replica))
        rec = led.group(gid)
        watch = self.fail_fast.state
        if outcome.kind == DATA and watch is not Watch.CLEARED:
            watch = self.fail_fast.failed(outcome.error)
            if watch is Watch.TRIPPED and self.user_code_failure is None:
                self.user_code_failure = outcome.error
                self.on_signal(Reason.USER_CODE)
            elif watch is Watch.CLEARED:
                self._release_parked()
                if gid not in led:  # it was parked: dropped just now
                    return
        if self.settings.retry.spent(rec, g, outcome.kind):
            if watch is not Watch.CLEARED:  # a bug in user code may be to blame: drop nothing yet
                self._parked[gid] = budget_reason(outcome.kind, outcome.error)
                return
            self._drop(gid, budget_reason(outcome.kind, outcome.error))
            return
        self._cancel_stale(gid)  # an all-or-nothing group abandoned its other siblings
        self._not_before[(gid, g)] = self.settings.retry.retry_at(rec, g, now)

    def _checked(self, gid: str, g: int, outcome: Generated) -> Outcome:
        """A generation that may not be sealed becomes the data failure that says why."""
        if self.effects and (unknown := self.effects.unknown(gid, g, policy=FAIL)):
            # FINALIZATION_UNKNOWN: what it was finalized with depends on a call that may or may not
            # have happened (its outcome died with a process); it is never sealed.
            return Failure(DATA, f"{EFFECT_UNKNOWN}: the outcome of {unknown[0].kind} call {unknown[0].key} "
                           "was lost with a process (on_unknown=fail)", outcome.replica)
        if not (math.isfinite(outcome.reward) and abs(outcome.reward) <= MAX_REWARD):
            return Failure(DATA, f"reward {outcome.reward} (rewards must be finite and within "
                           f"±{MAX_REWARD:g}, the range a group's advantages are computed in)", outcome.replica)
        return outcome

    def _release_parked(self) -> None:
        """The fail-fast watch cleared: the parked groups are dropped as their budgets said."""
        parked, self._parked = self._parked, {}
        for gid, reason in parked.items():
            if gid in self.ledger:  # (a parked group is still generating: nothing else ends it)
                self._drop(gid, reason)

    def _cancel_stale(self, gid: str) -> None:
        stale = tuple(k for k in self._in_flight if k[0] == gid and not self.ledger.is_current(*k))
        for k in stale:
            del self._in_flight[k]
            self.partial.forget(k)
        if stale:
            self._queued.append(Cancel(stale))

    def _drop(self, gid: str, reason: str, *, on_dropped_prompt: str | None = None) -> None:
        """Drop a group and refill or shrink its step, in one transition (docs/design.md §6)."""
        ev = drop_event(self.ledger, self.source, gid, reason,
                        on_dropped_prompt=on_dropped_prompt or self.settings.on_dropped_prompt,
                        group_size=self.settings.group_size, granularity=self._granularity)
        stale = tuple(k for k in self._in_flight if k[0] == gid)
        for k in stale:
            del self._in_flight[k]
            self.partial.forget(k)
        if stale:
            self._queued.append(Cancel(stale))
        self._apply(ev)
        if ev.shrink:
            check_step_size(self.ledger, self.sampler.limits, ev.step,
                            replacing=(on_dropped_prompt or self.settings.on_dropped_prompt) == "replace",
                            reason=reason)

    # -------------------------------------------------------------- train side

    def _train_side(self, out: list[Command]) -> None:
        led, s = self.ledger, self.settings
        if self.phase is Phase.START:
            if self.stopping is None:
                self._go("refit")
                out.append(Refit(led.version))
            else:
                self._go("stop")
        if self.phase is Phase.COMMITTED:
            if self.stopping is not None:
                self._go("stop")
            elif self.pinning.work_done(led):  # deterministic: never refit past pinned work
                step = led.version
                if step % s.checkpoint_every == 0 and step < s.total_steps and self._changed_since_cut:
                    if self._writing:
                        return  # one write at a time: the step boundary waits for it
                    if not self._env_quiet():
                        return  # the environment phase: the step boundary waits for the steps in flight
                    out.append(self._cut(final=False))
                self._go("refit")
                out.append(Refit(step))
        if self.phase is Phase.IDLE:
            self._claim_next(out)
        if self.phase is Phase.STOPPING:
            self._stop(out)
        if self.phase is Phase.STOPPED:
            out.append(Stop(self.stopping or Reason.FINISHED))

    def _claim_next(self, out: list[Command]) -> None:
        led = self.ledger
        step = led.version + 1
        if self.stopping is None and step > self.settings.total_steps:
            self.stopping = Reason.FINISHED
        if self.stopping is not None:
            self._go("stop")
            return
        for gid in self.sampler.stale(led):
            if self.settings.on_stale == "regenerate":
                self._apply(Evicted(group_id=gid, reason=Reason.STALE.value))
            else:
                self._drop(gid, Reason.STALE.value)
        final = led.exhausted and not led.spare and led.n_inflight() == 0
        gids = self.sampler.select(led, step, final=final)
        if gids:
            batch = self._batch(step, gids)  # first: a row read from the row log may fail (exit 3)
            self._apply(Claimed(step=step, group_ids=tuple(gids)))
            self._step = step
            self._go("claim")
            out.append(Train(step, batch))
        elif final:
            self.stopping = Reason.DATA_EXHAUSTED
            self._go("stop")

    def _batch(self, step: int, gids: list[str]) -> Batch:
        """The step's batch; its completion tokens are what `on_trained` records the step trained."""
        groups, tokens, get = [], 0, self.rows.get
        for gid in gids:
            rec = self.ledger.group(gid)
            rows = tuple(get(row_id_of((gid, g, a))) for g, a in enumerate(rec.attempts))
            tokens += sum(len(r.completion_ids) for r in rows)
            groups.append(TrainGroup(gid, rec.epoch, rec.ordinal, rec.idx, rec.task, tuple(rec.advantages), rows))
        self._step_tokens = tokens
        return Batch(step=step, groups=tuple(groups))

    def _stop(self, out: list[Command]) -> None:
        """Abandon what is still generating (visibly, in the trace), then write the final
        cut unless nothing changed (or a signal stop with checkpoint.on_shutdown: false)."""
        for key in self._in_flight:  # their chunks so far, kept for the rerun to continue
            self.partial.flush(key, self._apply)
        for gid, rec in self.ledger.groups():
            gens = tuple(rec.generations_with(AttemptStatus.DISPATCHED))
            if gens and rec.state == GroupState.GENERATING:
                self._apply(Abandoned(group_id=gid, generations=gens, reason=Reason.SHUTDOWN.value))
        if self._in_flight:
            out.append(Cancel(tuple(self._in_flight)))
            self._in_flight.clear()
            self._deadlines.clear()
            self.partial.forget_all()
        if self._writing:
            return  # a periodic write is still going: Stop only once nothing is in flight
        wanted = self.stopping is not Reason.SIGNAL or self.settings.checkpoint_on_shutdown
        if wanted and self._may_cut(out):
            out.append(self._cut(final=True))
            self._go("final_cut")
        else:
            self._go("stopped")

    def _may_cut(self, out: list[Command]) -> bool:
        """A cut is written when custody changed since the last one (a later cut of the
        same step becomes the next revision of its checkpoint, so a final checkpoint always
        matches the trace). In deterministic mode not while a group still has to generate
        under a version older than the trainer's: only a stop can leave that state, and
        then the previous checkpoint stands (and the trace says so)."""
        if not self._changed_since_cut:
            return False
        if not self.pinning.work_done(self.ledger):
            out.append(Note(CheckpointSkipped(
                step=self.ledger.version,
                reason="deterministic: generation pinned to an older version unfinished")))
            self._changed_since_cut = False  # say it once
            return False
        return True

    def _env_quiet(self) -> bool:
        """The cut's environment phase (lease environments, `Settings.env_phase_s`): whether
        the cut may be taken now. At the step boundary the gate closes (`env_step_begin`
        refuses new steps) and the cut waits until no environment step is in flight, or
        `env_phase_s` has passed (the steps still running are retired: their turns come
        after the cut); then the gate opens again."""
        if self.settings.env_phase_s is None:
            return True
        self._env_steps &= self._in_flight.keys()  # (a step of an attempt that ended ended with it)
        if self._env_hold is None:
            if not self._env_steps or self.settings.env_phase_s <= 0:
                self._env_phase = (0.0, len(self._env_steps))
                return True
            self._env_hold = (self._now, self._now + self.settings.env_phase_s)
        since, deadline = self._env_hold
        if self._env_steps and self._now < deadline:
            return False  # (the poll wakes at the deadline)
        self._env_phase, self._env_hold = (self._now - since, len(self._env_steps)), None
        return True

    def env_step_begin(self, key: AttemptKey) -> bool:
        """An episode of the in-flight attempt `key` is about to step its environment (a
        step, its commit, its turn's report): False while the cut's environment phase holds
        the gate closed (the driver waits for `env_gate_open` and asks again)."""
        if self._env_hold is not None:
            return False
        if key in self._in_flight:
            self._env_steps.add(key)
        return True

    def env_step_end(self, key: AttemptKey) -> None:
        """That step (and its turn's report) is over; the driver then polls."""
        self._env_steps.discard(key)

    @property
    def env_gate_open(self) -> bool:
        return self._env_hold is None

    def _cut(self, *, final: bool) -> Cut:
        """A cut of this step; its custody is captured at the end of the poll (`_captured`)."""
        self._writing = True
        self._changed_since_cut = False
        (wait, retired), self._env_phase = self._env_phase, (0.0, 0)
        return Cut(self.ledger.version, final=final, env_wait_s=wait, env_retired=retired)

    def _captured(self, cmd: Cut) -> Cut:
        """`cmd` with the atomic cut (O(1)) of the state the poll leaves: what the driver's
        journal position right after the poll covers, before any other call."""
        now = None if self._wall is None else self._wall()
        return dataclasses.replace(cmd, custody=cut(self.ledger, self.rows, now=now, prefixes=self.prefixes,
                                                      effects=self.effects))

    # ============================================================== callbacks

    def on_trained(self, step: int) -> None:
        """The optimizer step of `step` is applied: commit it (its groups become TRAINED)."""
        if step != self._step:
            raise CustodyError(f"scheduler: trained step {step}", expected=f"step {self._step}",
                               found=str(step), remedy="this is a bug in the runner")
        crashpoints.hit("train.before_commit")
        ev = self.ledger.commit_event(step)
        self._apply(msgspec.structs.replace(ev, tokens=self._step_tokens))
        crashpoints.hit("train.after_commit")
        self._step = None
        self._go("trained")

    def on_refit(self, version: int) -> None:
        """The engine holds the trainer's weights of `version`; their evaluation is due
        every `eval_every` versions, and the train side waits for it."""
        self.engine_version = version
        every = self.settings.eval_every
        if every and version % every == 0:
            self._go("evaluate")
            self._queued.append(Evaluate(version))
        else:
            self._go("refitted")

    def on_evaluated(self, version: int) -> None:
        """The evaluation of `version` is done (its metrics are the driver's)."""
        self._go("evaluated")

    def on_cut_written(self, step: int) -> None:
        """The cut of `step` is published (or its write ended)."""
        self._writing = False
        if self.phase is Phase.FINAL_CUT:
            self._go("written")

    def on_signal(self, reason: Reason = Reason.SIGNAL) -> None:
        """Stop gracefully: finish the step being trained, then stop (docs/design.md §6)."""
        if self.stopping is None:
            self.stopping = reason

    # ============================================================== reading

    @property
    def version(self) -> int:
        return self.ledger.version

    def counts(self) -> dict[str, int]:
        """How many prompts each owner holds (metrics and the progress bar)."""
        return self.ledger.counts()

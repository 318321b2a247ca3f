"""A hypothesis state machine over the scheduler's public API (issue 23).

Rules drive `Scheduler` the way a runner might, in any order, on a fake clock: advance the
clock (or jump to the WakeAt the scheduler asked for), poll, answer a random in-flight
attempt with a completion, an infra or data failure or a bad reward, answer an attempt
already cancelled, finish the Train / Refit / Cut it asked for, signal. Invariants: the
custody audit passes; the phase is one of TRAIN_TABLE's; after each poll the attempts the
runner holds are exactly the ledger's dispatched ones; every sealed attempt's row is held
until its group is trained; no group (and no prompt key) is trained twice; a Cut's capture
is at its step, passes the audit, and every row it names stays readable through its pin
until the write is done; Stop comes with nothing in flight. At teardown the run is driven
to its end (answering everything), which it must reach: every prompt trained or dropped
once, or left where the audit accounts for it.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from sched_harness import Harness, completion, sealed_rows

from rollkeep.core.custody.audit import audit
from rollkeep.core.custody.events import DATA, INFRA, StepCommitted
from rollkeep.core.custody.ledger import AttemptStatus
from rollkeep.core.errors import ExternalError
from rollkeep.core.schedule import TRAIN_TABLE, Failure, Generated, Phase, Reason, RetryPolicy

PHASES = {p for p, _ in TRAIN_TABLE} | set(TRAIN_TABLE.values())


@st.composite
def configs(draw) -> dict:
    sampler = draw(st.sampled_from(["in_order", "weight_fifo", "windowed"]))
    p = draw(st.integers(1, 2))
    kw = dict(
        sampler=sampler, num_prompts_per_step=p, window=draw(st.integers(0, 2)), n_rows=draw(st.integers(2, 8)),
        epochs=1, seed=draw(st.integers(0, 3)),
        group_size=draw(st.integers(1, 3)), total_steps=draw(st.integers(1, 5)),
        checkpoint_every=draw(st.integers(1, 3)),
        recovery_mode=draw(st.sampled_from(["sibling", "prompt_group"])),
        on_stale=draw(st.sampled_from(["regenerate", "drop"])),
        on_dropped_prompt=draw(st.sampled_from(["replace", "shrink"])),
        spare_prompts=draw(st.integers(0, 2)),
        timeout_s=draw(st.sampled_from([0.5, 2.0])),
        retry=RetryPolicy(max_infra_attempts=draw(st.integers(1, 3)), max_data_attempts=draw(st.integers(1, 2)),
                          backoff_ms=draw(st.sampled_from([0.0, 50.0, 400.0])), backoff_max_ms=800.0),
        deterministic=sampler == "in_order" and draw(st.booleans()),
        checkpoint_on_shutdown=draw(st.booleans()),
    )
    if sampler == "windowed":  # the limits below the gate's capacity p * (window + 1)
        cap = p * (kw["window"] + 1)
        kw.update(max_inflight_prompts=draw(st.integers(1, 4)), max_buffered_rollouts=draw(st.integers(p, cap)))
    return kw


def failed_out(e: ExternalError) -> bool:
    """A run stopped because drops shrank a step below its minimum: a legitimate end."""
    return "to failures" in str(e)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(cfg=configs())
    def setup(self, cfg: dict) -> None:
        self.h = Harness(**cfg)
        self.ended = False  # stopped, or failed out (ExternalError)
        self.last_wake: float | None = None
        self.trained_gids: list[str] = []

    # -- helpers

    def guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except ExternalError as e:
            assert failed_out(e), e
            self.ended = True

    def _poll(self) -> None:
        h = self.h
        n_captures = len(h.captures)
        cmds = h.poll()
        self.last_wake = h.wake(cmds)
        # What is due now was done in this poll: a WakeAt is always later.
        assert self.last_wake is None or self.last_wake > h.now
        # The attempts the runner holds are exactly the ledger's dispatched ones.
        dispatched = {(gid, g, rec.attempts[g]) for gid, rec in h.ledger.groups()
                      for g, s in enumerate(rec.status) if s == AttemptStatus.DISPATCHED}
        assert set(h.in_flight) == dispatched
        for cut, captured in h.captures[n_captures:]:
            assert captured.ledger.version == cut.step == h.ledger.version
            report = audit(captured.ledger)
            assert report.ok, str(report)
            for rid in sealed_rows(captured.ledger.groups):
                captured.rows.get(rid)
        if h.stop is not None:
            assert not h.in_flight and h.train_cmd is None and h.refit_cmd is None and h.cut_cmd is None
            assert h.sched.phase is Phase.STOPPED
            if h.stop.reason is Reason.FINISHED:
                assert h.ledger.version == h.settings.total_steps
            self.ended = True

    # -- rules

    @rule(dt=st.sampled_from([0.0, 0.01, 0.1, 0.6, 2.5]))
    def advance(self, dt: float) -> None:
        self.h.now += dt  # (also after the end: a machine always has a rule to run)

    @precondition(lambda self: not self.ended and self.last_wake is not None)
    @rule()
    def to_wake(self) -> None:
        self.h.now = max(self.h.now, self.last_wake)
        self.guarded(self._poll)

    @precondition(lambda self: not self.ended)
    @rule()
    def poll(self) -> None:
        self.guarded(self._poll)

    @precondition(lambda self: not self.ended and self.h.in_flight)
    @rule(i=st.integers(0, 50), how=st.sampled_from(["ok", "ok", "ok", "infra", "data", "nan"]))
    def answer(self, i: int, how: str) -> None:
        h = self.h
        key = sorted(h.in_flight)[i % len(h.in_flight)]
        outcome = {"ok": None, "infra": Failure(INFRA, "boom"), "data": Failure(DATA, "bad"),
                   "nan": Generated(completion(0), math.nan)}[how]
        self.guarded(h.answer, key, outcome)

    @precondition(lambda self: not self.ended and self.h.cancelled)
    @rule(i=st.integers(0, 50))
    def late_answer(self, i: int) -> None:
        """A cancelled attempt's result arrives anyway: nothing changes."""
        h = self.h
        key = h.cancelled[i % len(h.cancelled)]
        if key in h.in_flight:
            return  # cancelled, then dispatched again under the same key? never: attempts count up
        state = h.ledger.capture()
        h.sched.on_result(key, Generated(completion(0), 1.0), h.now)
        assert h.ledger.capture() == state

    @precondition(lambda self: not self.ended and self.h.train_cmd is not None)
    @rule()
    def train(self) -> None:
        h = self.h
        batch = h.train_cmd.batch
        gids = [tg.group_id for tg in batch.groups]
        assert len(set(gids)) == len(gids) and not set(gids) & set(self.trained_gids)
        for gid in gids:
            rec = h.ledger.group(gid)
            assert rec.claim_step == batch.step
        n = len(h.events_of(StepCommitted))
        h.train()
        [commit] = h.events_of(StepCommitted)[n:]
        assert list(commit.group_ids) == gids
        self.trained_gids += gids

    @precondition(lambda self: not self.ended and self.h.refit_cmd is not None)
    @rule()
    def refit(self) -> None:
        v = self.h.refit()
        assert v == self.h.ledger.version

    @precondition(lambda self: not self.ended and self.h.cut_cmd is not None)
    @rule()
    def cut_written(self) -> None:
        self.h.cut_written()

    @precondition(lambda self: not self.ended)
    @rule(rounds=st.integers(1, 6))
    def run_a_while(self, rounds: int) -> None:
        """The well-behaved runner for a few rounds: poll, then answer everything in flight
        with completions, or finish one Cut / Train / Refit (so that runs get somewhere)."""
        h = self.h
        for _ in range(rounds):
            self.guarded(self._poll)
            if self.ended:
                return
            if h.in_flight:
                for k in sorted(h.in_flight):
                    if k in h.in_flight and not self.ended:
                        self.guarded(h.answer, k, None)
            elif h.cut_cmd is not None:
                h.cut_written()
            elif h.train_cmd is not None:
                self.train()
            elif h.refit_cmd is not None:
                self.refit()
            elif self.last_wake is not None:
                h.now = self.last_wake

    @precondition(lambda self: not self.ended)
    @rule(n=st.integers(0, 7))
    def signal(self, n: int) -> None:
        if n == 0:  # rarely: a signal ends the run
            self.h.sched.on_signal()

    # -- invariants

    @invariant()
    def custody_audit_passes(self) -> None:
        report = audit(self.h.ledger)
        assert report.ok, str(report)

    @invariant()
    def phase_is_one_of_train_table(self) -> None:
        assert self.h.sched.phase in PHASES

    @invariant()
    def sealed_rows_are_held_until_trained(self) -> None:
        h = self.h
        missing = [r for r in sealed_rows(h.ledger.groups()) if r not in h.rows]
        assert not missing, missing

    @invariant()
    def nothing_is_trained_twice(self) -> None:
        commits = self.h.events_of(StepCommitted)
        gids = [g for c in commits for g in c.group_ids]
        assert len(gids) == len(set(gids))
        prompts = [p for c in commits for p in c.prompts]
        assert len(prompts) == len(set(prompts))  # one epoch: each dataset row at most once
        assert [c.step for c in commits] == list(range(1, len(commits) + 1))

    def teardown(self) -> None:
        h = getattr(self, "h", None)
        if h is None or self.ended:
            return
        try:
            stop = h.run_to_stop()
        except ExternalError as e:
            assert failed_out(e), e
            return
        assert stop.reason in (Reason.FINISHED, Reason.DATA_EXHAUSTED, Reason.SIGNAL)
        assert not h.in_flight and audit(h.ledger).ok
        counts = h.ledger.counts()
        if stop.reason is not Reason.SIGNAL:
            # Every prompt taken is trained or dropped (or still spare): nothing is left in custody.
            assert counts["reserved"] + counts["generating"] + counts["finalizing"] + counts["claimed"] == 0
        if stop.reason is Reason.DATA_EXHAUSTED:
            assert h.ledger.exhausted and not h.ledger.spare


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(
    max_examples=50, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

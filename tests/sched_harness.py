"""A synchronous runner for `Scheduler` on a fake clock, for scheduler-level tests.

No threads, no asyncio, no sleeps: `h.now` is a float the test advances, every command
the scheduler returns is recorded, and nothing is carried out until the test says so:

    h = Harness(sampler="in_order", num_prompts_per_step=2, timeout_s=5.0)
    cmds = h.poll()                 # Refit(0) first: nothing generates before it
    h.refit(); cmds = h.poll()      # Dispatches
    h.answer(key)                   # a completion; or h.answer(key, Failure(INFRA, "x"))
    h.train(); h.cut_written()      # finish the Train / Cut the scheduler asked for
    h.run_to_stop()                 # answer everything at once until Stop

A Cut carries its custody, captured at the end of the poll that returned it
(`Cut.custody`). Every ledger event is appended to `h.events`.
"""

from __future__ import annotations

import numpy as np

from rollkeep.core.custody.events import Event
from rollkeep.core.custody.ledger import AttemptStatus, Ledger
from rollkeep.core.rollout.generation import Completion, GenRequest
from rollkeep.core.rollout.rows import RowId
from rollkeep.core.rollout.rowstore import RowStore
from rollkeep.core.rollout.samplers import check_limits, make_sampler
from rollkeep.core.rollout.source import PromptSource, SequenceDataset
from rollkeep.core.schedule import (
    Cancel,
    Command,
    Cut,
    Dispatch,
    Generated,
    Outcome,
    Refit,
    Scheduler,
    Settings,
    Stop,
    Train,
    WakeAt,
)

Key = tuple[str, int, int]


def sealed_rows(groups) -> list[RowId]:
    """The rows of every sealed current attempt of `groups` ((gid, record) pairs, or a
    captured state's {gid: record})."""
    items = groups.items() if hasattr(groups, "items") else groups
    return [RowId(gid, g, rec.attempts[g]) for gid, rec in items
            for g, st in enumerate(rec.status) if st == AttemptStatus.SEALED]


def completion(version: int, n: int = 2) -> Completion:
    ids = np.arange(1, n + 1, dtype=np.int32)
    return Completion(prompt_ids=np.arange(3, dtype=np.int32), completion_ids=ids,
                      logprobs=np.full(n, -0.5, np.float32), versions=np.full(n, version, np.int32),
                      finish_reason="stop", text="x")


class Harness:
    def __init__(self, *, n_rows: int = 8, sampler: str = "in_order", num_prompts_per_step: int = 2,
                 window: int = 1, epochs: int | None = 1, seed: int = 7,
                 max_inflight_prompts: int | None = None, max_buffered_rollouts: int | None = None,
                 min_step_batch_fraction: float = 1.0, start: float = 0.0, **settings) -> None:
        self.source = PromptSource(SequenceDataset([{"prompt": f"p{i}", "answer": i} for i in range(n_rows)]),
                                   seed=seed, epochs=epochs)
        self.limits = check_limits(sampler, num_prompts_per_step=num_prompts_per_step, window=window,
                                   max_inflight_prompts=max_inflight_prompts,
                                   max_buffered_rollouts=max_buffered_rollouts,
                                   min_step_batch_fraction=min_step_batch_fraction)
        self.settings = Settings(**settings)
        self.ledger = Ledger(n_rows=n_rows, seed=seed, epochs=epochs)
        self.rows = RowStore()
        self.sched = Scheduler(ledger=self.ledger, rows=self.rows, source=self.source,
                               sampler=make_sampler(sampler, self.limits), settings=self.settings)
        self.events: list[Event] = []
        self.sched.subscribe(self.events.append)
        self.sched.start(None, epochs=epochs)
        self.now = start
        self.in_flight: dict[Key, GenRequest] = {}  # dispatched, not answered, not cancelled
        self.dispatched: list[tuple[float, GenRequest]] = []  # every Dispatch, with its time
        self.cancelled: list[Key] = []
        self.commands: list[Command] = []  # every command, in order
        self.train_cmd: Train | None = None
        self.refit_cmd: Refit | None = None
        self.cut_cmd: Cut | None = None
        self.captures: list[tuple[Cut, object]] = []
        self.stop: Stop | None = None

    # -- the scheduler's side

    def poll(self, now: float | None = None) -> list[Command]:
        if now is not None:
            assert now >= self.now, "the fake clock never goes back"
            self.now = now
        cmds = self.sched.poll(self.now)
        for cmd in cmds:
            self.commands.append(cmd)
            if isinstance(cmd, Dispatch):
                assert cmd.key not in self.in_flight
                self.in_flight[cmd.key] = cmd.request
                self.dispatched.append((self.now, cmd.request))
            elif isinstance(cmd, Cancel):
                for k in cmd.attempts:
                    self.in_flight.pop(k, None)
                    self.cancelled.append(k)
            elif isinstance(cmd, Train):
                assert self.train_cmd is None, "two Train commands at once"
                self.train_cmd = cmd
            elif isinstance(cmd, Refit):
                assert self.refit_cmd is None, "two Refit commands at once"
                self.refit_cmd = cmd
            elif isinstance(cmd, Cut):
                assert self.cut_cmd is None, "two cuts written at once"
                self.cut_cmd = cmd
                self.captures.append((cmd, cmd.custody))
            elif isinstance(cmd, Stop):
                assert self.stop is None, "Stop twice"
                self.stop = cmd
        return cmds

    # -- the runner's side

    def answer(self, key: Key, outcome: Outcome | None = None) -> None:
        req = self.in_flight.pop(key)
        if outcome is None:
            v = self.sched.engine_version if req.pinned_version is None else req.pinned_version
            outcome = Generated(completion(v), reward=float(hash(key) % 3))
        self.sched.on_result(key, outcome, self.now)

    def refit(self) -> int:
        cmd, self.refit_cmd = self.refit_cmd, None
        assert cmd is not None, "no Refit to finish"
        self.sched.on_refit(cmd.version)
        return cmd.version

    def train(self) -> int:
        cmd, self.train_cmd = self.train_cmd, None
        assert cmd is not None, "no Train to finish"
        self.sched.on_trained(cmd.step)
        return cmd.step

    def cut_written(self) -> int:
        """The write is done: every row the captured ledger names was still readable
        through the cut's pin (whatever the scheduler freed since), then the pin goes."""
        cmd, self.cut_cmd = self.cut_cmd, None
        assert cmd is not None, "no Cut to finish"
        captured = self.captures[-1][1]
        for rid in sealed_rows(captured.ledger.groups):
            captured.rows.get(rid)
        captured.rows.release()
        self.sched.on_cut_written(cmd.step)
        return cmd.step

    # -- shorthands

    @staticmethod
    def of(cmds: list[Command], kind: type) -> list:
        return [c for c in cmds if isinstance(c, kind)]

    def wake(self, cmds: list[Command]) -> float | None:
        wakes = self.of(cmds, WakeAt)
        assert len(wakes) <= 1
        return wakes[0].time if wakes else None

    def events_of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def settle(self, *, answer: bool = True, limit: int = 10_000) -> list[Command]:
        """Poll and finish everything the scheduler asked for (answering every attempt
        with a completion if `answer`), at the current time, until it waits for nothing
        the harness holds (or stops); return the last poll's commands."""
        for _ in range(limit):
            cmds = self.poll()
            if self.stop is not None:
                return cmds
            if answer and self.in_flight:
                for k in list(self.in_flight):
                    if k in self.in_flight:
                        self.answer(k)
            elif self.cut_cmd is not None:
                self.cut_written()
            elif self.train_cmd is not None:
                self.train()
            elif self.refit_cmd is not None:
                self.refit()
            else:
                return cmds
        raise AssertionError("the scheduler never settled")

    def run_to_stop(self, *, limit: int = 10_000) -> Stop:
        for _ in range(limit):
            cmds = self.settle()
            if self.stop is not None:
                return self.stop
            wake = self.wake(cmds)
            assert wake is not None, f"the scheduler waits for nothing (phase {self.sched.phase.value})"
            self.now = max(self.now, wake)
        raise AssertionError("the run never stopped")

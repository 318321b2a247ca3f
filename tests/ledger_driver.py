"""A synchronous stand-in for the controller, for ledger-level tests.

`Driver` owns a Ledger, a PromptSource and a sampler and moves prompts the way the rollout
and train pumps would, one event at a time, with the custody audit after every call:

    d = Driver(n_rows=12, sampler="in_order", num_prompts_per_step=3, window=1)
    gid = d.take_and_admit()          # RESERVED groups first, then spare, then source
    d.dispatch(gid); d.seal(gid, 0); d.fail(gid, 1, INFRA)
    d.complete(gid)                   # dispatch + seal what is left, then finalize
    d.train_step()                    # select, claim, commit -> StepCommitted | None
    d.checkpoint_restore()            # capture -> encode -> decode -> from_state -> normalize

Every applied event is appended to `d.events` (across restores), every committed step to
`d.committed`, every freed row to `d.freed`.
"""

from __future__ import annotations

from rollkeep.core.custody import codec
from rollkeep.core.custody.audit import audit
from rollkeep.core.custody.events import (
    SIBLING,
    Admitted,
    Claimed,
    Dispatched,
    Event,
    Evicted,
    Failed,
    Finalizing,
    Ready,
    Sealed,
    StepCommitted,
)
from rollkeep.core.custody.keys import group_id, parse_group_id
from rollkeep.core.custody.ledger import AttemptStatus, GroupState, Ledger
from rollkeep.core.rollout.datasets import SequenceDataset
from rollkeep.core.rollout.samplers import check_limits, make_sampler
from rollkeep.core.rollout.source import PromptSource
from rollkeep.core.rollout.take import drop_event, next_origin, spare_event, take_event


def dataset(n_rows: int) -> SequenceDataset:
    return SequenceDataset([{"prompt": f"prompt {i}", "answer": i} for i in range(n_rows)])


def ordinal(gid: str) -> int:
    return parse_group_id(gid).ordinal


class Driver:
    def __init__(
        self,
        *,
        n_rows: int,
        sampler: str = "in_order",
        num_prompts_per_step: int,
        window: int = 1,
        group_size: int = 2,
        granularity: str = SIBLING,
        max_inflight_prompts: int | None = None,
        max_buffered_rollouts: int | None = None,
        min_step_batch_fraction: float = 1.0,
        seed: int = 1234,
        epochs: int | None = 1,
    ) -> None:
        self.source = PromptSource(dataset(n_rows), seed=seed, epochs=epochs)
        self.limits = check_limits(
            sampler,
            num_prompts_per_step=num_prompts_per_step,
            window=window,
            max_inflight_prompts=max_inflight_prompts,
            max_buffered_rollouts=max_buffered_rollouts,
            min_step_batch_fraction=min_step_batch_fraction,
        )
        self.sampler = make_sampler(sampler, self.limits)
        self.group_size = group_size
        self.granularity = granularity
        self.events: list[Event] = []
        self.committed: list[StepCommitted] = []
        self.freed: list[tuple[str, int, int]] = []
        self._attach(Ledger(n_rows=n_rows, seed=seed, epochs=epochs))

    def _attach(self, ledger: Ledger) -> None:
        self.ledger = ledger
        ledger.subscribe(self.events.append)

    # -- plumbing

    def apply(self, event: Event) -> None:
        self.freed.extend(self.ledger.apply(event))
        self.check()

    def check(self) -> None:
        report = audit(self.ledger)
        assert report.ok, str(report)

    def state(self, gid: str) -> GroupState:
        return GroupState(self.ledger.group(gid).state)

    def trained_ordinals(self) -> list[int]:
        """Ordinals of every committed step, in commit order (duplicates kept)."""
        return [ordinal(g) for ev in self.committed for g in ev.group_ids]

    def dispatched(self, gid: str) -> list[int]:
        """Generation indices dispatched for `gid` by the events logged so far."""
        return [
            g
            for ev in self.events
            if isinstance(ev, Dispatched) and ev.group_id == gid
            for g in ev.generations
        ]

    # -- rollout pump

    def take(self) -> str | None:
        """Hand out the next prompt (spare pool, then source) as a RESERVED group."""
        ev = take_event(
            self.ledger, self.source, group_size=self.group_size, granularity=self.granularity
        )
        if ev is None:
            return None
        self.apply(ev)
        return group_id((ev.epoch, ev.ordinal))

    def spare(self) -> None:
        ev = spare_event(self.ledger)
        assert ev is not None, "the source is exhausted"
        self.apply(ev)

    def admit(self, gid: str) -> bool:
        """Admit an already taken (RESERVED) group if the step gate lets it through."""
        open_, target = self.sampler.admission(self.ledger, new=False)
        if open_:
            self.apply(Admitted(group_id=gid, target_step=target, version=self.ledger.version))
        return open_

    def take_and_admit(self) -> str | None:
        """Admit the oldest RESERVED group if the gate lets it through; else, if the gate is
        open for a new prompt, take one (spare pool, then source) and admit it. None if the
        gate is closed or nothing is left."""
        reserved = [r.key for _, r in self.ledger.groups() if r.state == GroupState.RESERVED]
        if reserved:
            gid = group_id(min(reserved))
            return gid if self.admit(gid) else None
        open_, target = self.sampler.admission(self.ledger)
        gid = self.take() if open_ else None
        if gid is not None:
            self.apply(Admitted(group_id=gid, target_step=target, version=self.ledger.version))
        return gid

    def dispatch(self, gid: str, gens: tuple[int, ...] | None = None) -> tuple[int, ...]:
        rec = self.ledger.group(gid)
        gens = tuple(rec.generations_with(AttemptStatus.RESERVED)) if gens is None else gens
        self.apply(Dispatched(group_id=gid, generations=gens, version=self.ledger.version))
        return gens

    def seal(self, gid: str, gen: int) -> None:
        attempt = self.ledger.group(gid).attempts[gen]
        self.apply(
            Sealed(
                group_id=gid, generation=gen, attempt=attempt, version=self.ledger.version, tokens=8
            )
        )

    def fail(self, gid: str, gen: int, kind: str) -> None:
        attempt = self.ledger.group(gid).attempts[gen]
        self.apply(Failed(group_id=gid, generation=gen, attempt=attempt, kind=kind, error="test"))

    def finalize(self, gid: str) -> None:
        """READY_TO_FINALIZE -> FINALIZING -> READY, with one advantage per sibling."""
        self.apply(Finalizing(group_id=gid))
        self.apply(Ready(group_id=gid, advantages=tuple([0.5] * self.ledger.group(gid).group_size)))

    def complete(self, gid: str) -> None:
        """Dispatch what is unsent, seal what is dispatched, then finalize."""
        if self.state(gid) == GroupState.GENERATING:
            if self.ledger.group(gid).generations_with(AttemptStatus.RESERVED):
                self.dispatch(gid)
            for g in self.ledger.group(gid).generations_with(AttemptStatus.DISPATCHED):
                self.seal(gid, g)
        if self.state(gid) == GroupState.FINALIZING:
            self.apply(
                Ready(group_id=gid, advantages=tuple([0.5] * self.ledger.group(gid).group_size))
            )
        elif self.state(gid) == GroupState.READY_TO_FINALIZE:
            self.finalize(gid)

    def drop(self, gid: str, reason: str, on_dropped_prompt: str = "replace") -> None:
        self.apply(
            drop_event(
                self.ledger,
                self.source,
                gid,
                reason,
                on_dropped_prompt=on_dropped_prompt,
                group_size=self.group_size,
                granularity=self.granularity,
            )
        )

    def evict(self, gid: str, reason: str = "stale") -> None:
        self.apply(Evicted(group_id=gid, reason=reason))

    # -- train pump

    def nothing_left(self) -> bool:
        """No prompt left to take and nothing in flight: no group can still arrive."""
        return next_origin(self.ledger) is None and self.ledger.n_inflight() == 0

    def train_step(self, *, final: bool | None = None) -> StepCommitted | None:
        step = self.ledger.version + 1
        final = self.nothing_left() if final is None else final
        gids = self.sampler.select(self.ledger, step, final=final)
        if gids is None:
            return None
        self.apply(Claimed(step=step, group_ids=tuple(gids)))
        ev = self.ledger.commit_event(step)
        self.apply(ev)
        self.committed.append(ev)
        return ev

    def run_to_end(self, max_rounds: int = 10_000) -> None:
        """Admit, generate, evict stale groups and train until every prompt is settled."""
        for _ in range(max_rounds):
            while self.take_and_admit() is not None:
                pass
            for gid, rec in self.ledger.groups():
                if rec.state != GroupState.RESERVED:
                    self.complete(gid)
            for gid in self.sampler.stale(self.ledger):
                self.evict(gid)
            if self.train_step() is None and self.nothing_left() and self.ledger.n_ready() == 0:
                return
        raise AssertionError(f"no end after {max_rounds} rounds: {self.ledger.counts()}")

    # -- checkpoint

    def checkpoint_restore(self) -> None:
        """The atomic cut through the codec into a fresh ledger, normalized for restart."""
        data = codec.encode(self.ledger.capture())
        restored = Ledger.from_state(codec.decode(data))
        assert codec.encode(restored.capture()) == data
        self._attach(restored)
        self.check()
        for ev in restored.normalize_for_restart():
            self.apply(ev)
        assert restored.normalize_for_restart() == []

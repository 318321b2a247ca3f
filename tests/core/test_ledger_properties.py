"""Property-based custody tests (hypothesis stateful testing).

Random sequences of operations across every owner, mixed with random checkpoints. After
every step: the audit passes, nothing was trained twice, `decode(encode(s)) == s`, and
every ledger restored at an earlier checkpoint — fed the same later events — is in exactly
the state of the original (restore continues exactly as the original would).

Random events are also thrown at the ledger, legal or not: an illegal one must raise
`IllegalTransition` and change nothing.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rollkeep.core.custody import codec
from rollkeep.core.custody.audit import audit
from rollkeep.core.custody.events import (
    FROM_SOURCE,
    FROM_SPARE,
    GRANULARITIES,
    Abandoned,
    Admitted,
    Claimed,
    Dispatched,
    Dropped,
    Evicted,
    Failed,
    Finalizing,
    Ready,
    Released,
    Sealed,
    Spared,
    StepCommitted,
    Taken,
)
from rollkeep.core.custody.ledger import AttemptStatus, GroupState, Ledger, Owner
from rollkeep.core.errors import IllegalTransition

N_ROWS = 7
EPOCHS = 3


def encoded(led: Ledger) -> bytes:
    return codec.encode(led.capture())


class CustodyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.led = Ledger(n_rows=N_ROWS, seed=11, epochs=EPOCHS)
        self.shadows: list[Ledger] = []  # ledgers restored from earlier checkpoints
        self.trained: list[tuple[int, int]] = []  # (epoch, ordinal) of every committed group

    # ---------------------------------------------------------------- driving

    def apply(self, event) -> None:
        """Apply to the ledger and to every restored shadow; all must agree."""
        self.led.apply(event)
        for shadow in self.shadows:
            shadow.apply(event)

    def gids(self, *states: GroupState) -> list[str]:
        return sorted(g for g, r in self.led.groups() if r.state in states)

    def next_key(self, data, origin_choice: bool):
        led = self.led
        options = []
        if led.spare:
            options.append((data.draw(st.sampled_from(led.spare)), FROM_SPARE))
        if not led.exhausted:
            options.append((led.cursor, FROM_SOURCE))
        if not options:
            return None
        return options[0] if not origin_choice else options[-1]

    def taken_event(self, data, granularity: str) -> Taken | None:
        nxt = self.next_key(data, data.draw(st.booleans()))
        if nxt is None:
            return None
        key, origin = nxt
        return Taken(epoch=key[0], ordinal=key[1], idx=(key[1] * 3) % N_ROWS, task="t",
                     row_fingerprint=key[1], group_size=data.draw(st.integers(1, 4)),
                     granularity=granularity, origin=origin)

    # ---------------------------------------------------------------- rules

    @rule(data=st.data(), granularity=st.sampled_from(GRANULARITIES))
    def take(self, data, granularity) -> None:
        ev = self.taken_event(data, granularity)
        if ev is not None:
            self.apply(ev)

    @precondition(lambda self: not self.led.exhausted)
    @rule()
    def spare(self) -> None:
        c = self.led.cursor
        self.apply(Spared(epoch=c.epoch, ordinal=c.ordinal))

    @rule(data=st.data())
    def admit(self, data) -> None:
        gids = self.gids(GroupState.RESERVED)
        if gids:
            v = self.led.version
            target = data.draw(st.one_of(st.none(), st.integers(v + 1, v + 3)))
            self.apply(Admitted(group_id=data.draw(st.sampled_from(gids)), target_step=target,
                                version=data.draw(st.integers(0, v))))

    def sibling(self, data, status: AttemptStatus):
        pairs = [(g, i) for g, r in self.led.groups() if r.state == GroupState.GENERATING
                 for i, s in enumerate(r.status) if s == status]
        return data.draw(st.sampled_from(sorted(pairs))) if pairs else None

    @rule(data=st.data())
    def dispatch(self, data) -> None:
        gids = [g for g, r in self.led.groups() if r.state == GroupState.GENERATING
                and AttemptStatus.RESERVED in r.status]
        if gids:
            gid = data.draw(st.sampled_from(sorted(gids)))
            free = self.led.group(gid).generations_with(AttemptStatus.RESERVED)
            gens = data.draw(st.lists(st.sampled_from(free), min_size=1, unique=True))
            self.apply(Dispatched(group_id=gid, generations=tuple(gens), version=self.led.version))

    @rule(data=st.data())
    def seal(self, data) -> None:
        pick = self.sibling(data, AttemptStatus.DISPATCHED)
        if pick:
            gid, g = pick
            att = self.led.group(gid).attempts[g]
            self.apply(Sealed(group_id=gid, generation=g, attempt=att, version=self.led.version, tokens=5))

    @rule(data=st.data(), kind=st.sampled_from(["infra", "data"]))
    def fail(self, data, kind) -> None:
        pick = self.sibling(data, AttemptStatus.DISPATCHED)
        if pick:
            gid, g = pick
            self.apply(Failed(group_id=gid, generation=g, attempt=self.led.group(gid).attempts[g], kind=kind))

    @rule(data=st.data())
    def abandon(self, data) -> None:
        pick = self.sibling(data, AttemptStatus.DISPATCHED)
        if pick:
            self.apply(Abandoned(group_id=pick[0], generations=(pick[1],), reason="test"))

    @rule(data=st.data())
    def finalize(self, data) -> None:
        gids = self.gids(GroupState.READY_TO_FINALIZE)
        if gids:
            gid = data.draw(st.sampled_from(gids))
            self.apply(Finalizing(group_id=gid))
            if data.draw(st.booleans()):
                n = self.led.group(gid).group_size
                self.apply(Ready(group_id=gid, advantages=tuple(float(i) for i in range(n))))

    @rule(data=st.data())
    def finish_finalizing(self, data) -> None:
        gids = self.gids(GroupState.FINALIZING)
        if gids:
            gid = data.draw(st.sampled_from(gids))
            if data.draw(st.booleans()):
                self.apply(Released(group_id=gid))
            else:
                self.apply(Ready(group_id=gid, advantages=(0.5,) * self.led.group(gid).group_size))

    @rule(data=st.data())
    def claim(self, data) -> None:
        step = self.led.version + 1
        if self.led.claimed(step):
            return
        eligible = [g for g in self.gids(GroupState.READY)
                    if self.led.group(g).target_step in (None, step)]
        if eligible:
            gids = data.draw(st.lists(st.sampled_from(eligible), min_size=1, unique=True))
            self.apply(Claimed(step=step, group_ids=tuple(gids)))

    @rule(data=st.data())
    def commit_or_release(self, data) -> None:
        step = self.led.version + 1
        claimed = self.led.claimed(step)
        if not claimed:
            return
        if data.draw(st.booleans()):
            ev = self.led.commit_event(step)
            self.trained.extend(self.led.group(g).key for g in ev.group_ids)
            self.apply(ev)
        else:
            self.apply(Released(group_id=data.draw(st.sampled_from(sorted(claimed)))))

    @rule(data=st.data())
    def evict(self, data) -> None:
        gids = self.gids(GroupState.READY)
        if gids:
            self.apply(Evicted(group_id=data.draw(st.sampled_from(gids)), reason="stale"))

    @rule(data=st.data())
    def drop(self, data) -> None:
        gids = [g for g, r in self.led.groups() if r.state != GroupState.CLAIMED]
        if not gids:
            return
        gid = data.draw(st.sampled_from(sorted(gids)))
        rec = self.led.group(gid)
        prompt = (rec.epoch, rec.idx)
        if rec.target_step is None:
            self.apply(Dropped(group_id=gid, reason="budget", prompt=prompt, step=self.led.version + 1))
            return
        replacement = None
        if data.draw(st.booleans()):
            replacement = self.taken_event(data, data.draw(st.sampled_from(GRANULARITIES)))
            if replacement is not None and replacement.epoch * N_ROWS + replacement.ordinal == -1:
                replacement = None
        self.apply(Dropped(group_id=gid, reason="budget", prompt=prompt, step=rec.target_step,
                           shrink=replacement is None, replacement=replacement))

    @rule()
    def checkpoint(self) -> None:
        """Capture, encode, decode: the restored ledger must equal the original, now and
        after every later event (it joins the shadows)."""
        state = self.led.capture()
        blob = codec.encode(state)
        restored_state = codec.decode(blob)
        assert codec.encode(restored_state) == blob
        restored = Ledger.from_state(restored_state)
        assert audit(restored).ok
        self.shadows.append(restored)
        if len(self.shadows) > 3:
            self.shadows.pop(0)
        # The capture must not change as the live ledger moves on.
        self._frozen = (state, blob)

    @rule()
    def restart(self) -> None:
        """What a resumed process does right after restore."""
        for ev in self.led.normalize_for_restart():
            self.apply(ev)
        for _, rec in self.led.groups():
            assert AttemptStatus.DISPATCHED not in rec.status
            assert rec.state not in (GroupState.CLAIMED, GroupState.FINALIZING)

    @rule(data=st.data())
    def random_event(self, data) -> None:
        """Anything at all: legal events apply, illegal ones raise and change nothing."""
        gids = sorted(g for g, _ in self.led.groups()) + ["e0.0", "e9.9"]
        gid = data.draw(st.sampled_from(gids))
        small = st.integers(-1, 4)
        ev = data.draw(st.sampled_from([
            Admitted(group_id=gid, target_step=data.draw(st.one_of(st.none(), small)), version=data.draw(small)),
            Dispatched(group_id=gid, generations=tuple(data.draw(st.lists(small, max_size=3))), version=0),
            Sealed(group_id=gid, generation=data.draw(small), attempt=data.draw(small), version=0, tokens=1),
            Failed(group_id=gid, generation=data.draw(small), attempt=data.draw(small), kind=data.draw(st.sampled_from(["infra", "data", "x"]))),
            Abandoned(group_id=gid, generations=tuple(data.draw(st.lists(small, max_size=3))), reason="r"),
            Finalizing(group_id=gid),
            Ready(group_id=gid, advantages=(0.0,) * data.draw(st.integers(0, 4))),
            Claimed(step=data.draw(small), group_ids=(gid,)),
            StepCommitted(step=data.draw(small), weight_version=data.draw(small), group_ids=(gid,),
                          prompts=((0, data.draw(small)),)),
            Released(group_id=gid),
            Evicted(group_id=gid, reason="r"),
            Dropped(group_id=gid, reason="r", prompt=(0, data.draw(small)), step=data.draw(small),
                    shrink=data.draw(st.booleans())),
            Spared(epoch=data.draw(small), ordinal=data.draw(small)),
            Taken(epoch=data.draw(small), ordinal=data.draw(small), idx=data.draw(small), task="t",
                  row_fingerprint=0, group_size=data.draw(small), origin=data.draw(st.sampled_from([FROM_SOURCE, FROM_SPARE]))),
        ]))
        before = encoded(self.led)
        ready_before = (self.led.n_ready(), self.led.n_inflight(), self.led.n_claimed())
        if isinstance(ev, StepCommitted) and ev == self.led.commit_event(self.led.version + 1):
            self.trained.extend(self.led.group(g).key for g in ev.group_ids)
        try:
            self.led.apply(ev)
        except IllegalTransition:
            assert encoded(self.led) == before
            assert (self.led.n_ready(), self.led.n_inflight(), self.led.n_claimed()) == ready_before
            return
        for shadow in self.shadows:
            shadow.apply(ev)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def custody_holds(self) -> None:
        report = audit(self.led)
        assert report.ok, str(report)

    @invariant()
    def trained_exactly_once(self) -> None:
        assert len(self.trained) == len(set(self.trained))
        assert len(self.trained) == self.led.trained_count()
        for key in self.trained:
            assert self.led.owner(key) == Owner.TRAINED

    @invariant()
    def shadows_agree(self) -> None:
        now = encoded(self.led)
        for shadow in self.shadows:
            assert encoded(shadow) == now
            assert shadow.n_ready() == self.led.n_ready()
            assert shadow.n_inflight() == self.led.n_inflight()
            assert shadow.stamped_steps() == self.led.stamped_steps()

    @invariant()
    def captures_are_immutable(self) -> None:
        frozen = getattr(self, "_frozen", None)
        if frozen is not None:
            assert codec.encode(frozen[0]) == frozen[1]

    @invariant()
    def derived_counts_match(self) -> None:
        states = [r.state for _, r in self.led.groups()]
        assert self.led.n_ready() == states.count(GroupState.READY)
        assert self.led.n_claimed() == states.count(GroupState.CLAIMED)
        groups = list(self.led.groups())
        assert self.led.reserved_ids() == sorted(
            (g for g, r in groups if r.state == GroupState.RESERVED), key=lambda g: self.led.group(g).key)
        assert set(self.led.pending_ids()) == {
            g for g, r in groups if r.state == GroupState.GENERATING and AttemptStatus.RESERVED in r.status}
        for shadow in self.shadows:
            assert shadow.pending_ids() == self.led.pending_ids()
            assert shadow.reserved_ids() == self.led.reserved_ids()


TestCustody = CustodyMachine.TestCase
TestCustody.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

"""Table-driven transition tests: every (group state, event) and (attempt status, event)
pair is tried. Pairs in the tables must succeed and lead to the state the table names
(GONE: the record leaves the ledger); every other pair must raise IllegalTransition and
leave the ledger byte-identical (h11's habit)."""

from __future__ import annotations

import pytest

from rollkeep.core.custody import codec
from rollkeep.core.custody.audit import audit
from rollkeep.core.custody.events import (
    LOST_VERSION,
    PROMPT_GROUP,
    SIBLING,
    Abandoned,
    Admitted,
    Claimed,
    Dispatched,
    Dropped,
    EffectDone,
    EffectIntent,
    Evicted,
    Failed,
    Finalizing,
    Progressed,
    Ready,
    Released,
    Sealed,
    Spared,
    StepCommitted,
    Taken,
    TurnSealed,
)
from rollkeep.core.custody.ledger import AttemptStatus, GroupState, Ledger
from rollkeep.core.custody.transitions import ATTEMPT_TABLE, GONE, GROUP_TABLE
from rollkeep.core.errors import IllegalTransition

G = 3
GID = "e0.0"


def fingerprint(led: Ledger) -> tuple:
    """Everything observable: the canonical encoding plus the derived indices."""
    return (
        codec.encode(led.capture()),
        led.n_ready(),
        led.n_inflight(),
        led.n_claimed(),
        tuple(led.stamped_steps()),
        tuple(led.ready_ids()),
    )


def taken(ordinal: int, granularity: str = SIBLING) -> Taken:
    return Taken(epoch=0, ordinal=ordinal, idx=ordinal, task="t", row_fingerprint=ordinal,
                 group_size=G, granularity=granularity)


def ledger_in(state: GroupState, granularity: str = SIBLING) -> Ledger:
    """A ledger whose group e0.0 is in `state` (stamped for step 1)."""
    led = Ledger(n_rows=10, seed=0, epochs=1)
    led.apply(taken(0, granularity))
    if state == GroupState.RESERVED:
        return led
    led.apply(Admitted(group_id=GID, target_step=1, version=0))
    if state == GroupState.GENERATING:
        led.apply(Dispatched(group_id=GID, generations=(0,), version=0))
        return led
    led.apply(Dispatched(group_id=GID, generations=tuple(range(G)), version=0))
    for g in range(G):
        led.apply(Sealed(group_id=GID, generation=g, attempt=0, version=0, tokens=1))
    if state == GroupState.READY_TO_FINALIZE:
        return led
    led.apply(Finalizing(group_id=GID))
    if state == GroupState.FINALIZING:
        return led
    led.apply(Ready(group_id=GID, advantages=(0.0,) * G))
    if state == GroupState.READY:
        return led
    led.apply(Claimed(step=1, group_ids=(GID,)))
    assert state == GroupState.CLAIMED
    return led


def group_event(edge: str, led: Ledger):
    """A well-formed event of kind `edge` for e0.0: legal iff the state allows `edge`."""
    rec = led.group(GID)
    g = next((i for i, s in enumerate(rec.status) if s == AttemptStatus.DISPATCHED), 0)
    return {
        "admitted": Admitted(group_id=GID, target_step=1, version=0),
        "dispatched": Dispatched(group_id=GID, generations=(G - 1,), version=0),
        "progressed": Progressed(group_id=GID, generation=g, attempt=0, tokens=1),
        "turn_sealed": TurnSealed(group_id=GID, generation=g, attempt=0, turn=0, tokens=1),
        "effect_intent": EffectIntent(group_id=GID, generation=g, attempt=0, turn=0, index=0, kind="judge", key="k",
                                      digest=1, policy="retry"),
        "effect_done": EffectDone(group_id=GID, generation=g, attempt=0, key="k", ok=True, result=b"1"),
        "sealed": Sealed(group_id=GID, generation=g, attempt=0, version=0, tokens=1),
        "failed": Failed(group_id=GID, generation=g, attempt=0, kind="infra"),
        # A complete group is abandoned only for a lost version (`_special_rules_abandon`).
        "abandoned": Abandoned(group_id=GID, generations=(g,), reason="test" if rec.state <= GroupState.GENERATING
                               else LOST_VERSION),
        "finalizing": Finalizing(group_id=GID),
        "ready": Ready(group_id=GID, advantages=(0.0,) * G),
        "claimed": Claimed(step=1, group_ids=(GID,)),
        "step_committed": StepCommitted(step=1, weight_version=1, group_ids=(GID,), prompts=((0, 0),)),
        "released": Released(group_id=GID),
        "evicted": Evicted(group_id=GID, reason="stale"),
        "dropped": Dropped(group_id=GID, reason="test", prompt=(0, 0), step=1,
                           shrink=rec.target_step is not None),
    }[edge]


EDGES = ["admitted", "dispatched", "progressed", "turn_sealed", "effect_intent", "effect_done", "sealed", "failed", "abandoned", "finalizing", "ready",
         "claimed", "step_committed", "released", "evicted", "dropped"]

# A seal repeated for the sealed current attempt is a no-op in any later state (the
# special rule `_special_rules_duplicate_seal`); it is neither legal nor an error.
DUPLICATE_SEAL_NOOP = {GroupState.READY_TO_FINALIZE, GroupState.FINALIZING, GroupState.READY,
                       GroupState.CLAIMED}


@pytest.mark.parametrize("state", list(GroupState), ids=lambda s: s.name)
@pytest.mark.parametrize("edge", EDGES)
def test_group_table(state: GroupState, edge: str) -> None:
    led = ledger_in(state)
    before = fingerprint(led)
    event = group_event(edge, led)
    if edge == "sealed" and state in DUPLICATE_SEAL_NOOP:
        assert led.apply(event) == ()
        assert fingerprint(led) == before
        return
    if (state, edge) in GROUP_TABLE:
        led.apply(event)
        assert audit(led).ok, audit(led)
        nxt = GROUP_TABLE[(state, edge)]
        if nxt == GONE:
            assert GID not in led
        else:
            assert GroupState(led.group(GID).state) == nxt
        # `progressed` and `turn_sealed` record tokens only, the effect events calls: custody does not change.
        assert (fingerprint(led) == before) == (edge in ("progressed", "turn_sealed", "effect_intent", "effect_done"))
    else:
        with pytest.raises(IllegalTransition) as err:
            led.apply(event)
        assert GroupState(state).name in str(err.value) or "not current" in str(err.value)
        assert fingerprint(led) == before


@pytest.mark.parametrize("state", [GroupState.READY_TO_FINALIZE, GroupState.READY], ids=lambda s: s.name)
def test_a_complete_group_goes_back_to_generating_only_for_a_lost_version(state) -> None:
    led = ledger_in(state)
    before = fingerprint(led)
    with pytest.raises(IllegalTransition, match="a complete one only for reason"):
        led.apply(Abandoned(group_id=GID, generations=(0,), reason="restart"))
    assert fingerprint(led) == before
    freed = led.apply(Abandoned(group_id=GID, generations=(0, 2), reason=LOST_VERSION))
    rec = led.group(GID)
    assert freed == ((GID, 0, 0), (GID, 2, 0))
    assert rec.state == GroupState.GENERATING and rec.advantages is None and rec.target_step == 1
    assert list(rec.status) == [AttemptStatus.RESERVED, AttemptStatus.SEALED, AttemptStatus.RESERVED]
    assert rec.attempts == [1, 0, 1] and GID not in led.ready_ids() and GID in led.pending_ids()
    assert audit(led).ok


def test_a_sibling_group_abandons_a_sealed_sibling_only_for_a_lost_version() -> None:
    led = generating_with(AttemptStatus.SEALED, SIBLING)
    led.apply(Abandoned(group_id=GID, generations=(0,), reason=LOST_VERSION))
    assert led.group(GID).status[0] == AttemptStatus.RESERVED and led.group(GID).attempts[0] == 1


def generating_with(status: AttemptStatus, granularity: str) -> Ledger:
    """A GENERATING group whose sibling 0 is `status` (sibling 2 stays dispatched)."""
    led = Ledger(n_rows=10, seed=0, epochs=1)
    led.apply(taken(0, granularity))
    led.apply(Admitted(group_id=GID, target_step=1, version=0))
    led.apply(Dispatched(group_id=GID, generations=(2,), version=0))
    if status != AttemptStatus.RESERVED:
        led.apply(Dispatched(group_id=GID, generations=(0,), version=0))
    if status == AttemptStatus.SEALED:
        led.apply(Sealed(group_id=GID, generation=0, attempt=0, version=0, tokens=1))
    return led


ATTEMPT_EDGES = {
    "dispatched": Dispatched(group_id=GID, generations=(0,), version=0),
    "progressed": Progressed(group_id=GID, generation=0, attempt=0, tokens=1),
    "turn_sealed": TurnSealed(group_id=GID, generation=0, attempt=0, turn=0, tokens=1),
    "effect_intent": EffectIntent(group_id=GID, generation=0, attempt=0, turn=0, index=0, kind="judge", key="k",
                                  digest=1, policy="retry"),
    "effect_done": EffectDone(group_id=GID, generation=0, attempt=0, key="k", ok=True, result=b"1"),
    "sealed": Sealed(group_id=GID, generation=0, attempt=0, version=0, tokens=1),
    "failed": Failed(group_id=GID, generation=0, attempt=0, kind="data"),
    "abandoned": Abandoned(group_id=GID, generations=(0,), reason="test"),
}


@pytest.mark.parametrize("granularity", [SIBLING, PROMPT_GROUP])
@pytest.mark.parametrize(
    "status", [AttemptStatus.RESERVED, AttemptStatus.DISPATCHED, AttemptStatus.SEALED],
    ids=lambda s: s.name,
)
@pytest.mark.parametrize("edge", list(ATTEMPT_EDGES))
def test_attempt_table(status: AttemptStatus, edge: str, granularity: str) -> None:
    led = generating_with(status, granularity)
    before = fingerprint(led)
    event = ATTEMPT_EDGES[edge]
    legal = (status, edge) in ATTEMPT_TABLE
    if (status, edge) == (AttemptStatus.SEALED, "abandoned") and granularity == SIBLING:
        legal = False  # _special_rules_abandon: a sibling group keeps finished siblings
    if (status, edge) == (AttemptStatus.SEALED, "sealed"):
        assert led.apply(event) == ()  # duplicate seal: no-op
        assert fingerprint(led) == before
        return
    if legal:
        led.apply(event)
        assert audit(led).ok
        rec = led.group(GID)
        assert rec.status[0] == ATTEMPT_TABLE[(status, edge)]
        # "failed" and "abandoned" end the attempt: the RESERVED one is a fresh attempt.
        assert rec.attempts[0] == (1 if edge in ("failed", "abandoned") else 0)
        assert rec.state == GroupState.GENERATING  # sibling 2 is still dispatched
    else:
        with pytest.raises(IllegalTransition):
            led.apply(event)
        assert fingerprint(led) == before


def test_the_parametrizations_cover_every_entry_of_both_tables() -> None:
    """A table entry for an event the tests above do not try would go unchecked."""
    assert set(GROUP_TABLE) <= {(s, e) for s in GroupState for e in EDGES}
    assert set(ATTEMPT_TABLE) <= {(s, e) for s in (AttemptStatus.RESERVED, AttemptStatus.DISPATCHED,
                                                   AttemptStatus.SEALED) for e in ATTEMPT_EDGES}
    assert {e for _, e in GROUP_TABLE} == set(EDGES)


def test_the_last_sibling_sealed_makes_the_group_ready_to_finalize() -> None:
    """The one GROUP_TABLE entry whose next state depends on the other siblings."""
    led = ledger_in(GroupState.GENERATING)
    led.apply(Dispatched(group_id=GID, generations=tuple(range(1, G)), version=0))
    for g in range(G - 1):
        led.apply(Sealed(group_id=GID, generation=g, attempt=0, version=0, tokens=1))
        assert led.group(GID).state == GROUP_TABLE[(GroupState.GENERATING, "sealed")]
    led.apply(Sealed(group_id=GID, generation=G - 1, attempt=0, version=0, tokens=1))
    assert led.group(GID).state == GroupState.READY_TO_FINALIZE and audit(led).ok


def test_prompt_group_failure_abandons_the_whole_group() -> None:
    led = generating_with(AttemptStatus.SEALED, PROMPT_GROUP)
    freed = led.apply(Failed(group_id=GID, generation=2, attempt=0, kind="infra"))
    rec = led.group(GID)
    assert freed == ((GID, 0, 0),)  # the sealed sibling's row is garbage now
    assert list(rec.status) == [AttemptStatus.RESERVED] * G
    assert rec.attempts == [1, 0, 1]  # sibling 1 had never been dispatched
    assert rec.infra_failures[2] == 1 and rec.infra_failures[0] == 0


def test_sibling_failure_keeps_sealed_siblings() -> None:
    led = generating_with(AttemptStatus.SEALED, SIBLING)
    assert led.apply(Failed(group_id=GID, generation=2, attempt=0, kind="data")) == ()
    rec = led.group(GID)
    assert rec.status[0] == AttemptStatus.SEALED and rec.attempts == [0, 0, 1]
    assert rec.data_failures[2] == 1


def test_stale_attempt_results_are_refused() -> None:
    led = generating_with(AttemptStatus.DISPATCHED, SIBLING)
    led.apply(Abandoned(group_id=GID, generations=(0,), reason="restart"))
    assert not led.is_current(GID, 0, 0)
    before = fingerprint(led)
    with pytest.raises(IllegalTransition, match="not current"):
        led.apply(Sealed(group_id=GID, generation=0, attempt=0, version=0, tokens=1))
    assert fingerprint(led) == before


@pytest.mark.parametrize(
    "event",
    [
        taken(1),  # not the cursor
        Taken(epoch=0, ordinal=0, idx=99, task="t", row_fingerprint=0, group_size=G),  # idx range
        Taken(epoch=0, ordinal=0, idx=0, task="t", row_fingerprint=0, group_size=0),
        Taken(epoch=0, ordinal=0, idx=0, task="t", row_fingerprint=0, group_size=G, granularity="x"),
        Taken(epoch=0, ordinal=0, idx=0, task="t", row_fingerprint=0, group_size=G, origin="spare"),
        Spared(epoch=0, ordinal=3),
        Claimed(step=2, group_ids=("e0.0",)),
        StepCommitted(step=1, weight_version=1, group_ids=(), prompts=()),
        Admitted(group_id="e0.5", target_step=1, version=0),
    ],
    ids=lambda e: type(e).__name__,
)
def test_ledger_level_illegal_events(event) -> None:
    led = Ledger(n_rows=10, seed=0, epochs=1)
    before = fingerprint(led)
    with pytest.raises(IllegalTransition) as err:
        led.apply(event)
    assert err.value.expected and err.value.found is not None
    assert fingerprint(led) == before


def test_exhausted_source_refuses_takes() -> None:
    led = Ledger(n_rows=2, seed=0, epochs=1)
    led.apply(taken(0))
    led.apply(taken(1))
    assert led.exhausted
    with pytest.raises(IllegalTransition, match="exhausted"):
        led.apply(Taken(epoch=1, ordinal=0, idx=0, task="t", row_fingerprint=0, group_size=G))


def test_claim_respects_stamps() -> None:
    led = ledger_in(GroupState.READY)
    # e0.0 is stamped for step 1; a second group stamped for step 2 cannot join step 1.
    led.apply(taken(1))
    led.apply(Admitted(group_id="e0.1", target_step=2, version=0))
    led.apply(Dispatched(group_id="e0.1", generations=tuple(range(G)), version=0))
    for g in range(G):
        led.apply(Sealed(group_id="e0.1", generation=g, attempt=0, version=0, tokens=1))
    led.apply(Finalizing(group_id="e0.1"))
    led.apply(Ready(group_id="e0.1", advantages=(0.0,) * G))
    before = fingerprint(led)
    with pytest.raises(IllegalTransition, match="stamped for step 2"):
        led.apply(Claimed(step=1, group_ids=(GID, "e0.1")))
    assert fingerprint(led) == before


def test_commit_must_match_the_claim_exactly() -> None:
    led = ledger_in(GroupState.CLAIMED)
    before = fingerprint(led)
    with pytest.raises(IllegalTransition):
        led.apply(StepCommitted(step=1, weight_version=1, group_ids=(GID,), prompts=((0, 5),)))
    assert fingerprint(led) == before
    freed = led.apply(led.commit_event(1))
    assert set(freed) == {(GID, g, 0) for g in range(G)}
    assert led.version == 1 and led.trained_count() == 1

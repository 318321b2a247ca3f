"""Effect records (docs/design.md §13): the store's rule table, its decisions, the
checkpoint file's strict decoding, the scheduler's part (intents, outcomes, the
FINALIZATION_UNKNOWN guard) and the restore's checks of records against the ledger."""

from __future__ import annotations

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import given, settings
from sched_harness import Harness, completion

from rollkeep.core.custody.events import (
    DATA,
    INFRA,
    Abandoned,
    Dropped,
    EffectDone,
    EffectIntent,
    Evicted,
    Failed,
    Sealed,
    StepCommitted,
)
from rollkeep.core.custody.ledger import AttemptStatus
from rollkeep.core.errors import CheckpointCustodyError
from rollkeep.core.restore.chain import check_effect_owners
from rollkeep.core.rollout.effects import (
    EFFECT_UNKNOWN,
    FAIL,
    RETRY,
    REWARD_TURN,
    Answer,
    Call,
    EffectRecord,
    EffectStore,
    Unknown,
    decode_effects,
    effect_key,
    encode_effects,
)
from rollkeep.core.schedule import Cut, Dispatch, Failure, Generated, RetryPolicy

RETRIES = RetryPolicy(max_infra_attempts=3, max_data_attempts=3, backoff_ms=0.0, backoff_max_ms=0.0)

GID = "e0.1"


def intent(*, gen: int = 0, attempt: int = 0, turn: int = REWARD_TURN, index: int = 0, kind: str = "judge",
           key: str | None = None, digest: int = 7, policy: str = RETRY) -> EffectIntent:
    return EffectIntent(group_id=GID, generation=gen, attempt=attempt, turn=turn, index=index, kind=kind,
                        key=key or effect_key("run", GID, gen, attempt, turn, index), digest=digest, policy=policy)


def done(ev: EffectIntent, ok: bool = True, result: bytes = b'{"score":1}') -> EffectDone:
    return EffectDone(group_id=ev.group_id, generation=ev.generation, attempt=ev.attempt, key=ev.key, ok=ok,
                      result=result)


def store_with(*events) -> EffectStore:
    s = EffectStore()
    for ev in events:
        s.apply(ev)
    return s


# ------------------------------------------------------------------ the rule table

KEEP, GONE = True, False


@pytest.mark.parametrize(("event", "kept"), [
    (Sealed(group_id=GID, generation=0, attempt=0, version=0, tokens=3), KEEP),  # the audit reads them
    (Failed(group_id=GID, generation=0, attempt=0, kind=INFRA), KEEP),  # the next attempt continues the work
    (Failed(group_id=GID, generation=0, attempt=0, kind=DATA), GONE),  # new calls with new keys
    (Abandoned(group_id=GID, generations=(0,), reason="restart"), KEEP),
    (Abandoned(group_id=GID, generations=(0,), reason="shutdown"), KEEP),
    (Abandoned(group_id=GID, generations=(0,), reason="stale"), GONE),
    (Abandoned(group_id=GID, generations=(0,), reason="lost version"), GONE),
    (Evicted(group_id=GID, reason="stale"), GONE),
    (Dropped(group_id=GID, reason="x", prompt=(0, 1), step=1), GONE),
    (StepCommitted(step=1, weight_version=1, group_ids=(GID,), prompts=((0, 1),)), GONE),
])
def test_records_live_as_long_as_the_work_they_were_made_for(event, kept) -> None:
    ev = intent()
    s = store_with(ev, done(ev))
    s.apply(event)
    assert (s.record(GID, 0, REWARD_TURN, 0) is not None) is kept


def test_another_siblings_and_another_groups_records_are_untouched() -> None:
    a, b = intent(gen=0), intent(gen=1)
    other = EffectIntent(**{**msgspec.structs.asdict(intent()), "group_id": "e0.2", "key": "k2"})
    s = store_with(a, b, other)
    s.apply(Failed(group_id=GID, generation=0, attempt=0, kind=DATA))
    assert s.record(GID, 0, REWARD_TURN, 0) is None and s.record(GID, 1, REWARD_TURN, 0) is not None
    s.apply(Evicted(group_id=GID, reason="stale"))
    assert s.record(GID, 1, REWARD_TURN, 0) is None and s.record("e0.2", 0, REWARD_TURN, 0) is not None


def test_an_outcome_is_recorded_once_and_only_after_its_intent() -> None:
    ev = intent()
    s = store_with(ev)
    with pytest.raises(ValueError, match="ends no recorded intent"):
        s.apply(done(intent(key="never-announced")))
    s.apply(done(ev))
    with pytest.raises(ValueError, match="second outcome"):
        s.apply(done(ev))


def test_a_new_intent_at_the_same_place_supersedes_the_old_one() -> None:
    old = intent(digest=1)
    new = intent(digest=2, key="k-new")
    s = store_with(old, done(old), new)
    assert s.record(GID, 0, REWARD_TURN, 0).key == "k-new" and len(s) == 1


# ------------------------------------------------------------------ decisions


def decide(s: EffectStore, *, digest: int = 7, kind: str = "judge", turn: int = REWARD_TURN, index: int = 0):
    return s.decide(GID, 0, turn=turn, index=index, kind=kind, digest=digest, new_key="fresh")


def test_a_recorded_outcome_answers_the_same_call_and_nothing_else() -> None:
    ev = intent()
    s = store_with(ev, done(ev, result=b"[1]"))
    assert decide(s) == Answer(True, b"[1]", ev.key)
    assert decide(s, digest=8) == Call("fresh")  # another request
    assert decide(s, kind="tool") == Call("fresh")  # another kind
    assert decide(s, index=1) == Call("fresh") and decide(s, turn=0) == Call("fresh")  # another place


def test_an_error_outcome_is_answered_too() -> None:
    ev = intent()
    s = store_with(ev, done(ev, ok=False, result=b"boom"))
    assert decide(s) == Answer(False, b"boom", ev.key)


def test_an_intent_without_outcome_is_resolved_by_its_policy() -> None:
    retry = store_with(intent(policy=RETRY))
    assert decide(retry) == Call(intent().key, again=True)  # the same key is sent again
    assert decide(retry, digest=8) == Call("fresh")  # a different request is a new call
    fail = store_with(intent(policy=FAIL))
    assert decide(fail) == Unknown(intent().key, "judge")
    assert decide(fail, digest=8) == Unknown(intent().key, "judge")  # what the lost call did is unknown
    assert [r.key for r in fail.unknown(GID, 0, policy=FAIL)] == [intent().key]


def test_keys_are_deterministic_and_distinct_per_place() -> None:
    keys = {effect_key("r", g, s, a, t, i) for g in ("e0.1", "e0.12") for s in (0, 1) for a in (0, 1)
            for t in (REWARD_TURN, 0, 1) for i in (0, 1)}
    assert len(keys) == 2 * 2 * 2 * 3 * 2
    assert effect_key("r", "e0.1", 0, 0, REWARD_TURN, 0) == "rk-r-e0.1-0-0-r-0"


# ------------------------------------------------------------------ the checkpoint file

records = st.lists(st.builds(
    EffectRecord, attempt=st.integers(0, 5), turn=st.integers(-1, 4), index=st.integers(0, 3),
    kind=st.sampled_from(["judge", "tool"]), key=st.text(min_size=1, max_size=20), digest=st.integers(0, 2**64 - 1),
    policy=st.sampled_from([RETRY, FAIL]), ok=st.none(), result=st.just(b"")), max_size=4)


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.tuples(st.sampled_from(["e0.1", "e0.2", "e1.0"]), st.integers(0, 3)), records))
def test_the_file_round_trips(table) -> None:
    table = {sib: tuple({(r.turn, r.index): r for r in {r.key: r for r in rs}.values()}.values())
             for sib, rs in table.items()}
    table = {sib: rs for sib, rs in table.items() if rs}
    assert decode_effects(encode_effects(table)) == table


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_bytes_that_are_not_an_effects_file_are_refused(data) -> None:
    try:
        decode_effects(data)
    except ValueError:
        return
    assert decode_effects(data) == {}  # only an empty file of the right schema decodes


@pytest.mark.parametrize("bad", [
    {"attempt": -1}, {"turn": -2}, {"index": -1}, {"kind": ""}, {"kind": "k" * 65}, {"key": ""},
    {"policy": "maybe"}, {"digest": -1}, {"result": b"x"},  # a result without an outcome
])
def test_a_record_no_honest_run_writes_is_refused(bad) -> None:
    rec = msgspec.structs.replace(EffectRecord(0, -1, 0, "judge", "k", 1, RETRY), **bad)
    with pytest.raises(ValueError, match="a record with"):
        decode_effects(encode_effects({(GID, 0): (rec,)}))


def test_two_records_at_one_place_are_refused() -> None:
    a = EffectRecord(0, -1, 0, "judge", "k1", 1, RETRY)
    with pytest.raises(ValueError, match="second record"):
        decode_effects(encode_effects({(GID, 0): (a, msgspec.structs.replace(a, key="k2"))}))


# ------------------------------------------------------------------ the scheduler


def dispatched(h: Harness) -> list:
    h.poll()
    h.refit()
    return [c.key for c in h.poll() if isinstance(c, Dispatch)]


def test_the_scheduler_records_a_new_call_and_its_outcome_and_answers_it_after() -> None:
    h = Harness(group_size=1)
    key = dispatched(h)[0]
    d = h.sched.on_effect(key, turn=REWARD_TURN, index=0, kind="judge", digest=5, policy=RETRY, run="r")
    assert isinstance(d, Call) and not d.again and d.key == effect_key("r", key[0], key[1], key[2], REWARD_TURN, 0)
    assert isinstance(h.events[-1], EffectIntent) and h.events[-1].key == d.key
    assert h.sched.on_effect_done(key, d.key, True, b"1")
    assert isinstance(h.events[-1], EffectDone)
    again = h.sched.on_effect(key, turn=REWARD_TURN, index=0, kind="judge", digest=5, policy=RETRY, run="r")
    assert again == Answer(True, b"1", d.key)


def test_an_attempt_no_longer_in_flight_records_nothing() -> None:
    h = Harness(group_size=1)
    key = dispatched(h)[0]
    h.answer(key)
    n = len(h.events)
    assert h.sched.on_effect(key, turn=REWARD_TURN, index=0, kind="judge", digest=5, policy=RETRY, run="r") is None
    assert not h.sched.on_effect_done(key, "k", True, b"1")
    assert len(h.events) == n


@pytest.mark.parametrize("policy", [RETRY, FAIL])
def test_finalization_unknown_a_fail_intent_without_outcome_is_never_sealed(policy) -> None:
    h = Harness(group_size=1, retry=RETRIES)
    key = dispatched(h)[0]
    h.sched.on_effect(key, turn=REWARD_TURN, index=0, kind="judge", digest=5, policy=policy, run="r")
    n = len(h.events)
    h.answer(key)  # a completion arrives with the call's outcome never recorded
    last = h.events[n]
    if policy == FAIL:
        assert isinstance(last, Failed) and last.kind == DATA and last.error.startswith(EFFECT_UNKNOWN)
        assert h.sched.effects.record(key[0], key[1], REWARD_TURN, 0) is None  # the next attempt calls anew
    else:
        assert isinstance(last, Sealed)


def test_a_data_failure_gives_the_next_attempt_new_keys() -> None:
    h = Harness(group_size=1, retry=RETRIES)
    key = dispatched(h)[0]
    first = h.sched.on_effect(key, turn=REWARD_TURN, index=0, kind="judge", digest=5, policy=RETRY, run="r")
    h.sched.on_effect_done(key, first.key, True, b"1")
    h.answer(key, Failure(DATA, "bad"))
    key2 = next(c.key for c in h.poll(h.now + 1) if isinstance(c, Dispatch))
    second = h.sched.on_effect(key2, turn=REWARD_TURN, index=0, kind="judge", digest=5, policy=RETRY, run="r")
    assert isinstance(second, Call) and second.key != first.key and key2[2] == key[2] + 1


def test_a_cut_captures_the_records() -> None:
    h = Harness(group_size=1, checkpoint_every=1)
    key = dispatched(h)[0]
    d = h.sched.on_effect(key, turn=REWARD_TURN, index=0, kind="judge", digest=5, policy=RETRY, run="r")
    h.sched.on_effect_done(key, d.key, True, b"1")
    for k in list(h.in_flight):
        h.answer(k, Generated(completion(0), 1.0))
    h.poll()
    h.train()
    h.poll()
    cut = h.cut_cmd
    # The trained group's records left with it (step_committed); the cut holds only live ones.
    assert cut is not None and cut.custody.ledger.version == 1
    assert (key[0], key[1]) not in cut.custody.effects


# ------------------------------------------------------------------ the restore's checks


def test_records_are_checked_against_the_ledger() -> None:
    h = Harness(group_size=2)
    key = dispatched(h)[0]
    gid, g = key[0], key[1]
    state = h.ledger.capture()

    def refuse(what, found):
        return CheckpointCustodyError(what, found=found)

    rec = EffectRecord(0, REWARD_TURN, 0, "judge", "k", 1, FAIL)
    check_effect_owners({(gid, g): (rec,)}, state, refuse)  # a live attempt's: fine
    with pytest.raises(CheckpointCustodyError, match="no place for"):
        check_effect_owners({("e9.9", 0): (rec,)}, state, refuse)
    with pytest.raises(CheckpointCustodyError, match="no place for"):
        check_effect_owners({(gid, 7): (rec,)}, state, refuse)
    with pytest.raises(CheckpointCustodyError, match="never started"):
        check_effect_owners({(gid, g): (msgspec.structs.replace(rec, attempt=3),)}, state, refuse)
    h.answer(key)
    sealed = h.ledger.capture()
    assert sealed.groups[gid].status[g] == AttemptStatus.SEALED
    with pytest.raises(CheckpointCustodyError, match="FINALIZATION_UNKNOWN"):
        check_effect_owners({(gid, g): (rec,)}, sealed, refuse)
    check_effect_owners({(gid, g): (msgspec.structs.replace(rec, ok=True, result=b"1"),)}, sealed, refuse)


# ------------------------------------------------------------------ the cut's environment phase


def _phase(h: Harness):
    """Step 1 trained with an environment step of a step-2 attempt in flight; the poll
    that would cut. Returns (that attempt's key, another step-2 attempt's key, the poll's commands)."""
    keys = dispatched(h)
    target = {k: h.ledger.group(k[0]).target_step for k in keys}
    later = [k for k in keys if target[k] == 2]
    assert h.sched.env_step_begin(later[0])
    for k in keys:
        if target[k] == 1:
            h.answer(k)
    h.poll()
    h.train()
    return later[0], later[1], h.poll()


def test_the_cut_waits_for_environment_steps_in_flight_and_no_new_one_starts() -> None:
    h = Harness(group_size=1, window=1, checkpoint_every=1, env_phase_s=5.0)
    stepping, other, cmds = _phase(h)
    assert not h.of(cmds, Cut) and h.wake(cmds) == h.now + 5.0, "the cut waits, at most env_phase_s"
    assert not h.sched.env_step_begin(other), "the gate is closed: no new environment step starts"
    h.now += 1.5
    h.sched.env_step_end(stepping)
    cut = h.of(h.poll(), Cut)
    assert cut and cut[0].env_wait_s == 1.5 and cut[0].env_retired == 0
    assert h.sched.env_step_begin(other), "the gate opens with the cut"


def test_the_environment_phase_never_waits_past_its_timeout() -> None:
    h = Harness(group_size=1, window=1, checkpoint_every=1, env_phase_s=2.0)
    stepping, _, cmds = _phase(h)
    assert not h.of(cmds, Cut)
    assert not h.of(h.poll(h.now + 1.999), Cut)
    cut = h.of(h.poll(h.now + 0.001), Cut)
    assert cut and cut[0].env_wait_s == pytest.approx(2.0) and cut[0].env_retired == 1, "the step was retired"


def test_without_a_step_in_flight_or_a_phase_the_cut_does_not_wait() -> None:
    for phase in (None, 5.0):
        h = Harness(group_size=1, window=1, checkpoint_every=1, env_phase_s=phase)
        keys = dispatched(h)
        for k in keys:
            if h.ledger.group(k[0]).target_step == 1:
                h.answer(k)
        h.poll()
        h.train()
        cut = h.of(h.poll(), Cut)
        assert cut and cut[0].env_wait_s == 0.0

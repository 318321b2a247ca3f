"""Calls to the outside in the simulation (`simulate.effects`, docs/design.md §13): the
schedules with effects keep the judge's invariant through crashes at every point around a
call, and the check catches a runner or a core that breaks it."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from rollkeep.core import crashpoints
from rollkeep.core.journal.segments import JournalWriter, read_journal
from rollkeep.core.rollout.effects import FAIL, RETRY, Call, EffectStore, Unknown
from rollkeep.core.rollout.rows import ENV_VERSION, Row
from rollkeep.simulate import Crash, check, plan, simulate
from rollkeep.simulate.effects import EffectBook, Judge, digest, expected_reward, step_request
from rollkeep.simulate.memfs import MemFS, SimCrash
from rollkeep.simulate.schedules import EFFECT_POINTS, crash_points, schedule_seed
from rollkeep.simulate.world import World, _Process


def effect_plans(seed: int, n: int) -> list:
    """The first `n` schedules of the sweep of `seed` that call the judge."""
    out, i = [], 0
    while len(out) < n:
        p = plan(schedule_seed(seed, i), index=i)
        if p.effects:
            out.append(p)
        i += 1
    return out


def test_schedules_with_effects_find_no_violation():
    plans = effect_plans(11, 150)
    outs = [check(p) for p in plans]
    bad = [(p.seed, p.index, o.problems) for p, o in zip(plans, outs, strict=True) if o.problems]
    assert not bad
    assert {p.on_unknown for p in plans} == {RETRY, FAIL} and {p.journal for p in plans} == {True, False}
    assert sum(o.effect_calls for o in outs) > 1000
    assert sum(o.effect_resent for o in outs) > 0 and sum(o.effect_answered for o in outs) > 0
    assert sum(o.effect_unknown for o in outs) > 0
    fired = [f for o in outs for f in o.fired]
    assert all(point in fired for point in EFFECT_POINTS)


def test_effects_are_drawn_in_half_the_schedules_with_both_policies():
    plans = [plan(schedule_seed(0, i), index=10**6) for i in range(400)]
    on = [p for p in plans if p.effects]
    assert 140 < len(on) < 260
    assert 0.3 < sum(p.on_unknown == FAIL for p in on) / len(on) < 0.7
    assert any(c.point in EFFECT_POINTS for p in on for c in p.crashes)
    off = [p for p in plans if not p.effects]
    assert all(p.judge_calls == 1 and p.judge_errors == 0.0 and p.on_unknown == RETRY for p in off)
    assert not any(c.point in EFFECT_POINTS for p in off for c in p.crashes)
    # a schedule whose first crash is pinned at an effect's event calls the judge
    for point in EFFECT_POINTS:
        assert plan(schedule_seed(0, 3), index=crash_points().index(point)).effects


def _deterministic(policy: str, power: bool) -> object:
    p = plan(schedule_seed(1, 6), index=10**6)
    assert p.settings.deterministic and p.script.turns == 1
    return dataclasses.replace(p, journal=True, effects=True, on_unknown=policy, judge_calls=2,
                               crashes=(Crash(at=3, point="ledger.effect_done", power=power),),
                               fault_rate=0.0, max_faults=0)


@pytest.mark.parametrize("power", [False, True])
def test_an_outcome_lost_at_a_crash_is_sent_again_under_retry_and_the_weights_are_identical(power):
    out = check(_deterministic(RETRY, power))  # also the digest of the same plan run without the crash
    assert out.fired == ["ledger.effect_done"] and not out.problems and out.digest
    assert out.effect_resent >= 1 and out.effect_unknown == 0


def test_an_outcome_lost_at_a_crash_fails_the_attempt_under_fail_and_is_never_sent_again():
    p = _deterministic(FAIL, False)
    w = World(p)
    out = w.run()
    assert out.fired == ["ledger.effect_done"] and not out.problems and out.digest
    assert out.effect_unknown >= 1 and out.effect_resent == 0
    assert set(w.judge.calls.values()) == {1}
    # the failed attempt samples anew (a data failure's new seed): the weights differ by design
    assert not check(p).problems


def test_without_the_journal_a_key_may_be_called_again_at_least_once():
    plans = [dataclasses.replace(p, journal=False) for p in effect_plans(4, 40) if p.crashes]
    worlds = [World(p) for p in plans]
    outs = [w.run() for w in worlds]
    assert not [o.problems for o in outs if o.problems]
    assert sum(sum(w.book.vanished.values()) for w in worlds) > 0
    assert sum(o.effect_resent for o in outs) > 0


# -- the check fails when the invariant is broken (a test that could not fail proves nothing)


def test_a_runner_that_calls_before_the_intent_is_durable_is_caught(monkeypatch):
    monkeypatch.setattr(_Process, "_when_durable", lambda self, key, seq, then: then())
    found = simulate(300, seed=0)
    assert found.violations
    p, outcome = found.violations[0]
    assert p.effects and p.journal and p.crashes
    assert any(x.startswith("effects: key") for x in outcome.problems)


def test_an_unknown_outcome_sent_again_under_fail_is_caught(monkeypatch):
    real = EffectStore.decide

    def resend(self, *args, **kwargs):
        d = real(self, *args, **kwargs)
        return Call(d.key, again=True) if isinstance(d, Unknown) else d

    monkeypatch.setattr(EffectStore, "decide", resend)
    found = simulate(300, seed=0)
    assert found.violations
    p, outcome = found.violations[0]
    assert p.on_unknown == FAIL
    assert any("on_unknown=fail" in x for x in outcome.problems)


def test_a_record_that_answers_another_request_is_caught(monkeypatch):
    # A store that answers from the record at the call's place whatever was asked: the
    # reward trained is then not the judge's answer to the sibling's request.
    real = EffectStore.decide

    def any_request(self, gid, gen, *, turn, index, kind, digest, new_key):
        rec = self.record(gid, gen, turn, index)
        if rec is not None and rec.ok is not None:
            digest = rec.digest
        return real(self, gid, gen, turn=turn, index=index, kind=kind, digest=digest, new_key=new_key)

    monkeypatch.setattr(EffectStore, "decide", any_request)
    found = simulate(600, seed=2)
    assert found.violations
    assert any("was trained with reward" in x for x in found.violations[0][1].problems)


# -- the book and the judge


def test_the_book_allows_a_resend_only_under_retry_after_a_lost_outcome():
    judge = Judge()
    for _ in range(2):
        judge.call("rk-sim-e0.1-0-0-r-0", b"{}")
    lost = EffectStore()
    assert EffectBook(FAIL).problems(judge)  # twice, and nothing was lost
    retry = EffectBook(RETRY)
    assert retry.problems(judge)
    retry.restored(lost, judge.calls, weak=False)  # a restore with no outcome of it
    assert not retry.problems(judge)
    fail = EffectBook(FAIL)
    fail.restored(lost, judge.calls, weak=False)
    assert fail.problems(judge)  # under fail a lost outcome is never sent again
    fail.restored(lost, judge.calls, weak=True)  # unless a restore from a checkpoint alone lost its intent
    assert not fail.problems(judge)


def test_the_book_refuses_a_key_sent_with_two_requests_and_a_key_of_another_place():
    judge, book = Judge(), EffectBook(RETRY)
    judge.call("rk-sim-e0.1-0-0-r-0", b'{"a":1}')
    judge.call("rk-sim-e0.1-0-0-r-0", b'{"a":2}')
    book.lost["rk-sim-e0.1-0-0-r-0"] = 1
    assert any("2 different requests" in x for x in book.problems(judge))
    book.called("rk-sim-e0.1-0-0-r-0", gid="e0.1", gen=0, attempt=2, turn=-1, index=0)  # a resend: fine
    assert not book.seen
    for key in ("rk-other-e0.1-0-0-r-0", "rk-sim-e0.1-1-0-r-0", "rk-sim-e0.1-0-3-r-0", "rk-sim-e0.1-0-0-r-1",
                "rk-sim-e0.1-0-0-0-0", "garbage"):
        book.called(key, gid="e0.1", gen=0, attempt=2, turn=-1, index=0)
    assert len(book.seen) == 6


def test_an_episodes_reward_is_the_judges_answer_to_its_last_step():
    # turn 0 (3 4), the environment's 7 7, turn 1 (5): the last step is turn 1's, text "5"
    ids = np.array([3, 4, 7, 7, 5], np.int32)
    versions = np.array([0, 0, ENV_VERSION, ENV_VERSION, 1], np.int32)
    row = Row(prompt_ids=np.arange(3, dtype=np.int32), completion_ids=ids, logprobs=np.zeros(5, np.float32),
              versions=versions, reward=0.0, finish_reason="stop")
    want = Judge.answer(digest(step_request("e0.1", 1, 1, "5"))[0])
    assert expected_reward("e0.1", 1, row, turns=2, calls=1) == want
    cut = dataclasses.replace(row, completion_ids=ids[:4], logprobs=np.zeros(4, np.float32), versions=versions[:4])
    assert expected_reward("e0.1", 1, cut, turns=2, calls=1) == Judge.answer(digest(step_request("e0.1", 1, 0, "3 4"))[0])


# -- what the simulation found in the core (fixed: JournalWriter._prepare fsyncs the journal
# directory once it made older segments durable, so a segment created by a flush killed before
# its fsyncs, which a restore read and acted on -- an effect's resend under retry --, survives a
# power cut)


def test_records_a_restore_read_survive_a_power_cut_once_the_next_writer_is_open():
    fs = MemFS(random.Random(0))
    fs.makedirs_durable(Path("/r"))
    journal = Path("/r/journal")

    def killed(name: str) -> None:
        if name == "journal.before_fsync":
            fs.freeze(SimCrash(name))
            raise fs.frozen

    crashpoints.set_handler(killed)
    try:
        writer = JournalWriter(journal, 1, fs=fs)
        writer.append(b"effect_intent")
        with pytest.raises(SimCrash):
            writer.flush()  # written to the page cache; the segment's name is not durable
    finally:
        crashpoints.set_handler(None)
    fs.kill()
    read = [payload for _, payload in read_journal(journal, after=0, fs=fs).records]
    assert read == [b"effect_intent"]  # the restore replays it (a resend under retry is sent at once)
    JournalWriter(journal, len(read) + 1, fs=fs)  # the next process's writer, before its first flush
    fs.power_cut()
    assert [payload for _, payload in read_journal(journal, after=0, fs=fs).records] == read

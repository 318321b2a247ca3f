"""What the ledger records so a checkpoint can be bounded by its own state (invariants I5
and I6): the limits of the `configured` event, one record per committed step, and the
schema-1 migration. Every refused event leaves the ledger byte-identical."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkeep.core.custody import codec
from rollkeep.core.custody.audit import audit, check_steps
from rollkeep.core.custody.events import (
    Admitted,
    Claimed,
    Configured,
    Dispatched,
    Dropped,
    Finalizing,
    Ready,
    Sealed,
    Taken,
)
from rollkeep.core.custody.ledger import MAX_ADVANTAGE, MAX_REASON, Ledger, StepRun
from rollkeep.core.errors import IllegalTransition, LedgerDecodeError

G = 2


def take(led: Ledger, target: int | None, version: int | None = None) -> str:
    o = led.cursor.ordinal
    led.apply(Taken(epoch=led.cursor.epoch, ordinal=o, idx=o, task="t", row_fingerprint=o, group_size=G))
    gid = f"e{led.cursor.epoch if o + 1 < led.n_rows else led.cursor.epoch - 1}.{o}"
    led.apply(Admitted(group_id=gid, target_step=target, version=led.version if version is None else version))
    return gid


def ready(led: Ledger, gid: str, advantages=(1.0, -1.0)) -> None:
    led.apply(Dispatched(group_id=gid, generations=tuple(range(G)), version=0))
    for g in range(G):
        led.apply(Sealed(group_id=gid, generation=g, attempt=0, version=0, tokens=1))
    led.apply(Finalizing(group_id=gid))
    led.apply(Ready(group_id=gid, advantages=advantages))


def commit(led: Ledger, gids: list[str]) -> None:
    step = led.version + 1
    led.apply(Claimed(step=step, group_ids=tuple(gids)))
    led.apply(led.commit_event(step))


def configured(p: int = 2, window: int = 1, epochs: int | None = 1) -> Ledger:
    led = Ledger(n_rows=40, seed=0, epochs=1)
    led.apply(Configured(num_prompts_per_step=p, window=window, epochs=epochs))
    return led


def refused(led: Ledger, event) -> IllegalTransition:
    before = codec.encode(led.capture())
    with pytest.raises(IllegalTransition) as e:
        led.apply(event)
    assert codec.encode(led.capture()) == before
    return e.value


def test_configured_keeps_the_widest_limits_and_epochs_only_grow():
    led = configured(p=4, window=2)
    led.apply(Configured(num_prompts_per_step=2, window=0, epochs=3))  # a resume that narrows
    assert (led.max_prompts_per_step, led.max_window, led.epochs) == (4, 2, 3)
    led.apply(Configured(num_prompts_per_step=8, window=1, epochs=None))
    assert (led.max_prompts_per_step, led.max_window, led.epochs) == (8, 2, None)
    assert "can only grow" in refused(led, Configured(num_prompts_per_step=8, window=1, epochs=5)).what
    refused(configured(epochs=1), Configured(num_prompts_per_step=2, window=1, epochs=0))
    refused(led, Configured(num_prompts_per_step=0, window=1, epochs=None))
    refused(led, Configured(num_prompts_per_step=1, window=-1, epochs=None))


def test_a_claim_larger_than_num_prompts_per_step_is_refused():
    led = configured(p=2, window=1)
    gids = [take(led, 1) for _ in range(3)]
    for gid in gids:
        ready(led, gid)
    refused(led, Claimed(step=1, group_ids=tuple(gids)))
    commit(led, gids[:2])


def test_a_stamp_beyond_the_window_is_refused():
    led = configured(p=2, window=1)
    o = led.cursor.ordinal
    led.apply(Taken(epoch=0, ordinal=o, idx=o, task="t", row_fingerprint=o, group_size=G))
    refused(led, Admitted(group_id="e0.0", target_step=3, version=0))  # at most 0 + 1 + 1
    led.apply(Admitted(group_id="e0.0", target_step=2, version=0))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, MAX_ADVANTAGE * 10])
def test_non_finite_or_huge_advantages_are_refused(bad):
    led = configured()
    gid = take(led, 1)
    led.apply(Dispatched(group_id=gid, generations=(0, 1), version=0))
    for g in range(G):
        led.apply(Sealed(group_id=gid, generation=g, attempt=0, version=0, tokens=1))
    led.apply(Finalizing(group_id=gid))
    refused(led, Ready(group_id=gid, advantages=(bad, 0.0)))


def test_an_overlong_drop_reason_is_refused():
    led = configured()
    gid = take(led, 1)
    refused(led, Dropped(group_id=gid, reason="x" * (MAX_REASON + 1), prompt=(0, 0), step=1, shrink=True))


def test_commits_are_recorded_as_runs_of_equal_counts():
    led = configured(p=2, window=0)
    for n in (2, 2, 2, 1, 2):
        gids = [take(led, led.version + 1) for _ in range(n)]
        if n == 1:
            doomed = take(led, led.version + 1)
            led.apply(Dropped(group_id=doomed, reason="spent", prompt=(0, led.group(doomed).idx),
                              step=led.version + 1, shrink=True))
        for gid in gids:
            ready(led, gid)
        commit(led, gids)
    assert led.steps() == [StepRun(1, 3, 2, 0), StepRun(4, 4, 1, 1), StepRun(5, 5, 2, 0)]
    state = codec.decode(codec.encode(led.capture()))
    assert list(state.steps) == led.steps() and audit(state).ok


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 3), min_size=1, max_size=12))
def test_step_records_account_for_every_trained_key(counts):
    led = configured(p=3, window=0)
    for n in counts:
        gids = [take(led, led.version + 1) for _ in range(n)]
        for gid in gids:
            ready(led, gid)
        commit(led, gids)
    state = led.capture()
    assert check_steps(state) == []
    assert sum(r.groups * r.n_steps for r in state.steps) == led.trained_count() == sum(counts)
    # Any forged total, gap or overfull step is caught.
    runs = list(state.steps)
    assert check_steps(msgspec.structs.replace(state, steps=runs[:-1] if len(runs) > 1 else ()))
    assert check_steps(msgspec.structs.replace(state, steps=[StepRun(2, state.version, 1, 0)]))
    assert check_steps(msgspec.structs.replace(state, steps=[StepRun(1, state.version, 4, 0)]))
    assert check_steps(msgspec.structs.replace(state, max_prompts_per_step=0))


def _as_schema_1(led: Ledger) -> bytes:
    doc = msgspec.msgpack.decode(codec.encode(led.capture()))
    for key in ("steps", "max_prompts_per_step", "max_window", "max_version"):
        del doc[key]
    doc["schema"] = 1
    return msgspec.msgpack.encode(doc)


def test_a_schema_2_ledger_is_read_through_its_migration():
    led = Ledger(n_rows=40, seed=0, epochs=1)
    led.apply(Configured(num_prompts_per_step=2, window=1, epochs=1))
    for _ in range(2):
        gids = [take(led, led.version + 1) for _ in range(2)]
        for gid in gids:
            ready(led, gid)
        commit(led, gids)
    doc = msgspec.msgpack.decode(codec.encode(led.capture()))
    del doc["max_version"]
    doc["schema"] = 2
    state = codec.decode(msgspec.msgpack.encode(doc))
    assert state.max_version == state.version == 2  # a schema-2 ledger never went back
    assert codec.encode(state) == codec.encode(led.capture())


def test_a_max_version_below_the_version_is_refused():
    led = Ledger(n_rows=40, seed=0, epochs=1)
    gids = [take(led, 1)]
    ready(led, gids[0])
    commit(led, gids)
    doc = msgspec.msgpack.decode(codec.encode(led.capture()))
    doc["max_version"] = 0
    with pytest.raises(LedgerDecodeError, match="max_version 0 below the version 1"):
        codec.decode(msgspec.msgpack.encode(doc))


def test_a_schema_1_ledger_is_read_through_its_migration():
    led = Ledger(n_rows=40, seed=0, epochs=1)  # 0.1.0 had no `configured` event
    for _ in range(3):
        gids = [take(led, led.version + 1) for _ in range(2)]
        for gid in gids:
            ready(led, gid)
        commit(led, gids)
    take(led, 4)
    state = codec.decode(_as_schema_1(led))
    assert list(state.steps) == [StepRun(1, 3, None, None)]
    assert (state.max_prompts_per_step, state.max_window) == (None, None)
    assert audit(state).ok
    resumed = Ledger.from_state(state)
    resumed.apply(Configured(num_prompts_per_step=2, window=1, epochs=1))
    assert audit(resumed).ok  # 6 trained in 3 unrecorded steps of at most 2


def test_a_schema_1_ledger_with_fewer_trained_keys_than_steps_is_refused():
    led = Ledger(n_rows=40, seed=0, epochs=1)
    gids = [take(led, 1)]
    ready(led, gids[0])
    commit(led, gids)
    doc = msgspec.msgpack.decode(_as_schema_1(led))
    doc["version"] = 5  # five steps committed, one key trained
    with pytest.raises(LedgerDecodeError, match="I5"):
        codec.decode(msgspec.msgpack.encode(doc))

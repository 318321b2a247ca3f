"""The audit's column pass picks every record the per-record check would fault.

`check_records` runs `_check_group` (the reference, record by record) only on the records
`_picked` flags over columns. A record it missed would be a violation nobody reports, so
the property: on any state, regular or damaged, the messages are exactly those of running
the reference on every record, in the state's order.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollkeep.core.custody import audit as audit_mod
from rollkeep.core.custody.audit import audit, check_records
from rollkeep.core.custody.columns import GroupColumns
from rollkeep.core.custody.keys import Key
from rollkeep.core.custody.ledger import GroupRecord, LedgerState

WIDE = [2**52 + 1, 2**53 + 1, 2**62, 2**63 - 1, -(2**63), 2**63, 2**64 - 1]
wrong_int = st.one_of(st.integers(-2, 14), st.sampled_from(WIDE))
#: One fault per field: what a damaged file or a bug could leave there.
FAULTS = {
    "epoch": wrong_int, "ordinal": wrong_int, "idx": wrong_int, "granularity": wrong_int, "state": wrong_int,
    "target_step": st.none() | wrong_int, "start_version": st.none() | wrong_int, "claim_step": st.none() | wrong_int,
    "status": st.lists(st.integers(0, 4), max_size=5).map(bytearray),
    "attempts": st.lists(st.integers(0, 3) | st.sampled_from([2**63, 2**70]), max_size=5),
    "infra_failures": st.lists(st.integers(0, 3), max_size=5).map(bytearray),
    "data_failures": st.lists(st.integers(0, 3), max_size=5).map(bytearray),
    "advantages": st.none() | st.lists(st.floats(-3, 3) | st.sampled_from([float("nan"), float("inf"), -1e31, 1e30]),
                                       max_size=5),
}


@st.composite
def records(draw, n_rows: int, version: int, window: int | None):
    """A sound record, then, often, one field replaced by a fault."""
    n = draw(st.integers(1, 4))
    state = draw(st.integers(0, 5))
    sealed_all = state >= 2
    if state == 0:
        status = bytearray(n)
    elif sealed_all:
        status = bytearray([2] * n)
    else:
        status = bytearray(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
        if all(x == 2 for x in status):
            status[0] = 1
    attempts = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    infra = bytearray(draw(st.integers(0, a)) for a in attempts)
    data = bytearray(draw(st.integers(0, a - f)) for a, f in zip(attempts, infra, strict=True))
    start = None if state == 0 else draw(st.integers(0, version))
    target, last = None, (start or 0) + 1 + (window if window is not None else 3)
    if state in (1, 2, 3, 4) and last > version and draw(st.booleans()):
        target = draw(st.integers(version + 1, last))
    fields = dict(
        epoch=draw(st.integers(0, 2)), ordinal=draw(st.integers(0, n_rows - 1)), idx=draw(st.integers(0, n_rows - 1)),
        task="t", row_fingerprint=0, granularity=draw(st.integers(0, 1)), state=state, target_step=target,
        start_version=start, claim_step=version + 1 if state == 5 else None, status=status, attempts=attempts,
        infra_failures=infra, data_failures=data,
        advantages=draw(st.lists(st.floats(-3, 3), min_size=n, max_size=n)) if state >= 4 else None)
    if draw(st.integers(0, 2)) == 0:
        name = draw(st.sampled_from(sorted(FAULTS)))
        fields[name] = draw(FAULTS[name])
    return GroupRecord(**fields)


@st.composite
def states(draw):
    n_rows = draw(st.integers(1, 12))
    version = draw(st.integers(0, 8))
    window = draw(st.none() | st.integers(0, 3))
    groups = {}
    for r in draw(st.lists(records(n_rows, version, window), max_size=10)):
        gid = f"e{r.epoch}.{r.ordinal}" if draw(st.integers(0, 10)) else draw(st.sampled_from(["x", "e0.0", "e1.1"]))
        groups[gid] = r
    return LedgerState(n_rows=n_rows, seed=0, epochs=None, cursor=Key(0, 0), version=version, spare=(),
                       groups=groups, trained={}, dropped={}, shortfall={}, max_window=window,
                       max_version=version + draw(st.integers(0, 2)))


def reference(state: LedgerState) -> list[str]:
    """`check_records` with every record through the per-record check."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(audit_mod, "_suspects", lambda state, lim, cols: state.groups.items())
        return check_records(state)


@settings(max_examples=400, deadline=None)
@given(states())
def test_column_pass_misses_no_faulty_record(state):
    assert check_records(state) == reference(state)


def sound(code: int, n: int = 3, version: int = 4, **changes) -> GroupRecord:
    """A record in state `code` that passes every check at `version` (window 2), with `changes`."""
    state = code
    fields = dict(epoch=0, ordinal=1, idx=1, task="t", row_fingerprint=0, granularity=0, state=state,
                  target_step=None if state in (0, 5) else version + 1, start_version=None if state == 0 else version,
                  claim_step=version + 1 if state == 5 else None,
                  status=bytearray([0] * n if state == 0 else [2] * n if state >= 2 else [2] * (n - 1) + [1]),
                  attempts=[1] * n, infra_failures=bytearray([1] + [0] * (n - 1)), data_failures=bytearray(n),
                  advantages=[0.5] * n if state >= 4 else None)
    return GroupRecord(**{**fields, **changes})


SINGLE_FAULTS = {
    "epoch": [-1, 2**63], "ordinal": [-1, 9, 2**63], "idx": [-1, 9, 2**64 - 1], "granularity": [-1, 7],
    "state": [-1, 0, 1, 2, 4, 5, 6], "target_step": [None, 0, 4, 5, 8, 2**53 + 1], "start_version": [None, -1, 0, 5, 2**60],
    "claim_step": [None, 4, 6, 2**53 + 5], "status": [bytearray([2, 2, 3]), bytearray([0, 1, 2]), bytearray([2, 2]),
                                                      bytearray([4, 2, 2]), bytearray([2, 2, 2])],
    "attempts": [[0, 1, 1], [1, 1], [2**63, 1, 1]], "infra_failures": [bytearray([2, 0, 0]), bytearray([1, 1])],
    "data_failures": [bytearray([1, 0, 0]), bytearray([0, 2, 0])],
    "advantages": [None, [0.5, 0.5], [0.5, float("nan"), 0.5], [1e31, 0, 0], [0.5] * 3],
}


@pytest.mark.parametrize("state", range(6))
def test_every_single_fault_is_reported_as_the_reference_reports_it(state):
    for field, values in SINGLE_FAULTS.items():
        for value in values:
            bad = sound(state, **{field: value})
            groups = {"e0.0": sound(4, ordinal=0, idx=0), f"e{bad.epoch}.{bad.ordinal}": bad,
                      "e0.2": sound(1, ordinal=2, idx=2)}
            st_ = LedgerState(n_rows=8, seed=0, epochs=None, cursor=Key(0, 0), version=4, spare=(), groups=groups,
                              trained={}, dropped={}, shortfall={}, max_window=2, max_version=4)
            assert check_records(st_) == reference(st_), (field, value)


@settings(max_examples=100, deadline=None)
@given(states())
def test_group_columns_are_the_records_sorted_by_key(state):
    cols = GroupColumns(state.groups)
    by_key = sorted(state.groups.items(), key=lambda kv: (kv[1].epoch, kv[1].ordinal))
    assert cols.ids == [gid for gid, _ in by_key]
    assert cols.records == [r for _, r in by_key]
    assert [list(state.groups)[i] for i in cols.order.tolist()] == cols.ids
    if cols.regular and not any(a >= 2**63 for r in cols.records for a in r.attempts):
        assert cols.attempts.tolist() == list(chain.from_iterable(r.attempts for r in cols.records))
        assert cols.status.tolist() == list(chain.from_iterable(r.status for r in cols.records))


def test_a_clean_ledger_of_many_groups_has_no_suspect():
    """Honest records at scale take the column pass only: nothing is re-checked one by one."""
    from rollkeep.bench.ledger import inflight_ledger

    state = inflight_ledger(300, 8).capture()
    lim = audit_mod._Limits(state.version, state.max_version, state.max_window, state.n_rows)
    pick = audit_mod._picked(GroupColumns(state.groups), lim)
    assert pick is not None and not pick.any()
    assert audit(state).ok


def test_retried_siblings_keep_their_attempt_numbers():
    state = _retried_state()
    cols = GroupColumns(state.groups)
    assert cols.attempts.tolist() == list(chain.from_iterable(r.attempts for r in cols.records))
    assert np.array_equal(np.frombuffer(b"".join(r.status for r in cols.records), np.uint8), cols.status)


def _retried_state() -> LedgerState:
    from rollkeep.bench.ledger import inflight_ledger
    from rollkeep.core.custody.events import INFRA, Failed

    led = inflight_ledger(40, 4)
    for o in range(0, 40, 7):  # a few siblings failed once: their next attempt is 1
        led.apply(Failed(group_id=f"e0.{o}", generation=1, attempt=0, kind=INFRA))
    state = led.capture()
    assert any(any(r.attempts) for r in state.groups.values())
    return state


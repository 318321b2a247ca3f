"""`GroupColumns`: the records in key order and their per-sibling arrays as columns, which
the rows a checkpoint lists and the ledger's canonical encoding are built from."""

from __future__ import annotations

from itertools import chain

from hypothesis import given, settings
from hypothesis import strategies as st

from rollkeep.core.custody.columns import GroupColumns
from rollkeep.core.custody.ledger import GroupRecord


def record(epoch: int, ordinal: int, status: list[int], attempts: list[int]) -> GroupRecord:
    n = len(status)
    return GroupRecord(epoch=epoch, ordinal=ordinal, idx=0, task="t", row_fingerprint=0, granularity=0, state=1,
                       target_step=None, start_version=0, claim_step=None, status=bytearray(status),
                       attempts=attempts, infra_failures=bytearray(n), data_failures=bytearray(n), advantages=None)


@st.composite
def groups(draw):
    out = {}
    for i in range(draw(st.integers(0, 30))):
        n = draw(st.integers(1, 5))
        # Keys may repeat under other ids (a damaged state): ties keep the mapping's order.
        epoch, ordinal = draw(st.integers(0, 2) | st.just(2**63)), draw(st.integers(0, 9))
        many_retries = draw(st.booleans())
        attempts = draw(st.lists(st.integers(0, 3) if many_retries else st.sampled_from([0] * 6 + [1]),
                                 min_size=n, max_size=n))
        out[f"g{i}"] = record(epoch, ordinal, draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)), attempts)
    return out


@settings(max_examples=300, deadline=None)
@given(groups())
def test_records_in_key_order_and_their_siblings_flat(g):
    cols = GroupColumns(g)
    by_key = sorted(g.items(), key=lambda kv: (kv[1].epoch, kv[1].ordinal))
    assert cols.ids == [gid for gid, _ in by_key]
    assert cols.records == [r for _, r in by_key]
    assert cols.sizes.tolist() == [len(r.status) for _, r in by_key]
    assert cols.status.tolist() == list(chain.from_iterable(r.status for _, r in by_key))
    assert cols.attempts.tolist() == list(chain.from_iterable(r.attempts for _, r in by_key))
    assert [int(s) for s in cols.starts] == [sum(len(r.status) for _, r in by_key[:i]) for i in range(len(by_key))]

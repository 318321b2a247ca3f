"""The prefix store's rules (docs/design.md §9): which events extend, keep or end a
sibling's chain of streamed tokens, and what a chain gives back as a prefix."""

from __future__ import annotations

import numpy as np
import pytest

from rollkeep.core.custody.events import (
    DATA,
    INFRA,
    Abandoned,
    Dropped,
    Evicted,
    Failed,
    Progressed,
    Sealed,
)
from rollkeep.core.errors import RowsMismatch
from rollkeep.core.rollout.generation import Tokens
from rollkeep.core.rollout.prefixes import Link, PrefixStore, chunk_row
from rollkeep.core.rollout.rows import RowId
from rollkeep.core.rowlog.segments import RowLogReader
from rollkeep.core.rowlog.writer import RowLogWriter


def toks(*ids: int, version: int = 0) -> Tokens:
    n = len(ids)
    return Tokens(np.array(ids, np.int32), -np.arange(1, n + 1, dtype=np.float32) / 8, np.full(n, version, np.int32))


def progressed(store: PrefixStore, tokens: Tokens, *, attempt: int = 0, gid: str = "e0.1", gen: int = 0,
               resumed_from: int = 0) -> None:
    store.stage(gid, gen, tokens)
    store.apply(Progressed(group_id=gid, generation=gen, attempt=attempt,
                           tokens=store.length(gid, gen) + len(tokens), resumed_from=resumed_from))


def test_chunks_join_in_order_and_the_prefix_is_their_concatenation() -> None:
    store = PrefixStore()
    progressed(store, toks(3, 4))
    progressed(store, toks(5))
    assert store.length("e0.1", 0) == 3 and len(store) == 1 and store.tokens() == 3
    p = store.prefix("e0.1", 0)
    assert p.completion_ids.tolist() == [3, 4, 5]
    assert p.logprobs.tobytes() == np.concatenate([toks(3, 4).logprobs, toks(5).logprobs]).tobytes()
    assert store.prefix("e0.1", 1) is None


KEEP, GONE = True, False


@pytest.mark.parametrize(("event", "kept"), [
    (Sealed(group_id="e0.1", generation=0, attempt=0, version=0, tokens=3), GONE),
    (Failed(group_id="e0.1", generation=0, attempt=0, kind=INFRA), KEEP),  # the same seed continues
    (Failed(group_id="e0.1", generation=0, attempt=0, kind=DATA), GONE),  # a new seed starts over
    (Abandoned(group_id="e0.1", generations=(0,), reason="restart"), KEEP),
    (Abandoned(group_id="e0.1", generations=(0,), reason="shutdown"), KEEP),
    (Abandoned(group_id="e0.1", generations=(0,), reason="stale"), GONE),
    (Evicted(group_id="e0.1", reason="stale"), GONE),
    (Dropped(group_id="e0.1", reason="budget", prompt=(0, 1), step=1, shrink=True), GONE),
    (Sealed(group_id="e0.1", generation=1, attempt=0, version=0, tokens=3), KEEP),  # another sibling
    (Dropped(group_id="e0.2", reason="budget", prompt=(0, 2), step=1, shrink=True), KEEP),  # another group
])
def test_what_each_event_does_to_a_chain(event, kept) -> None:
    store = PrefixStore()
    progressed(store, toks(1, 2, 3))
    store.apply(event)
    assert (store.length("e0.1", 0) == 3) is kept


def test_a_chain_that_does_not_reach_the_attempts_prefix_is_dropped() -> None:
    """An attempt that resumed from 5 tokens, but the store holds none of them (a checkpoint
    whose chunks were not durable): its tokens before 5 are unknown, so nothing is kept."""
    store = PrefixStore()
    progressed(store, toks(9), attempt=1, resumed_from=5)
    assert store.length("e0.1", 0) == 0


def test_a_chain_held_by_reference_is_read_back_and_its_lengths_checked(tmp_path) -> None:
    log = RowLogWriter(tmp_path / "rows")
    a, b = toks(1, 2), toks(3, 4, 5, version=1)
    at_a = log.append(RowId("e0.1", 0, 0), chunk_row(a))
    at_b = log.append(RowId("e0.1", 0, 1), chunk_row(b))
    log.close()
    reader = RowLogReader(tmp_path / "rows").read
    store = PrefixStore(reader=reader)
    store.restore({("e0.1", 0): (Link(0, 2, None, at_a), Link(1, 5, None, at_b))})
    p = store.prefix("e0.1", 0)
    assert p.completion_ids.tolist() == [1, 2, 3, 4, 5] and p.versions.tolist() == [0, 0, 1, 1, 1]
    store.restore({("e0.1", 0): (Link(0, 3, None, at_a),)})  # says 3 tokens, the frame holds 2
    with pytest.raises(RowsMismatch, match="wrong length"):
        store.prefix("e0.1", 0)

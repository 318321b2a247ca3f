"""Finalize: a group whose siblings are all sealed gets its advantages (docs/design.md §1).

Rewards → group-relative advantages (`trainer.scale_rewards`, formulas in
`rollkeep.core.rollout.advantages`). Pure computation, so it runs inside one synchronous section:
FINALIZING is never left half done by a live run (a restore finalizes again)."""

from __future__ import annotations

from collections.abc import Callable

from ..custody.events import Event, Finalizing, Ready
from ..custody.ledger import Ledger
from ..rollout.advantages import ScaleRewards, stored_advantages
from ..rollout.rows import row_id_of
from ..rollout.rowstore import RowStore


def finalize(
    ledger: Ledger, rows: RowStore, gid: str, scale_rewards: ScaleRewards, apply: Callable[[Event], object]
) -> None:
    apply(Finalizing(group_id=gid))
    rec = ledger.group(gid)
    rewards = [rows.get(row_id_of((gid, g, a))).reward for g, a in enumerate(rec.attempts)]
    apply(Ready(group_id=gid, advantages=stored_advantages(rewards, scale_rewards)))

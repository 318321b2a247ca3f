"""Deterministic version pinning (docs/design.md §7).

With `deterministic: true` (the in_order sampler), the groups of step k generate under
exactly weight version max(0, k - 1 - window): a function of the config alone, whatever
the timing. So an attempt is dispatched only once the engine holds that version, the
engine is not refit past a version still needed, and a checkpoint is not cut while a
group must still generate under an older version than the trainer's (a resumed engine
could not go back to it)."""

from __future__ import annotations

from dataclasses import dataclass

from ..custody.ledger import GroupState, Ledger


@dataclass(frozen=True)
class Pinning:
    enabled: bool
    window: int
    num_prompts_per_step: int
    total_steps: int

    def version_for(self, target_step: int | None) -> int | None:
        """The version a group stamped for `target_step` generates under (None: any)."""
        if not self.enabled or target_step is None:
            return None
        return max(0, target_step - 1 - self.window)

    def start_version(self, target_step: int | None, version: int) -> int:
        """The start version `admitted` records: the pinned one, or the current one."""
        pinned = self.version_for(target_step)
        return version if pinned is None else pinned

    def work_done(self, ledger: Ledger) -> bool:
        """Before the engine moves past the trainer's version v, every group of the steps
        up to v + window must have finished generating (and every such step be full)."""
        if not self.enabled:
            return True
        last_step = min(ledger.version + self.window, self.total_steps)
        for k in range(ledger.version + 1, last_step + 1):
            gids = ledger.stamped(k)
            full = len(gids) + ledger.shortfall(k) >= self.num_prompts_per_step
            if not full and not (ledger.exhausted and not ledger.spare):
                return False
            if any(ledger.group(g).state <= GroupState.GENERATING for g in gids):
                return False
        return True

"""The admission gate: which prompts leave SOURCE and SPARE, and for which step.

In the rollout pump's order (docs/design.md §2): the spare pool is topped up, restored RESERVED
groups are admitted again first, then new prompts are taken (spare pool, then source) for
as long as the sampler's gate is open and the run still wants them."""

from __future__ import annotations

from collections.abc import Callable

from ..custody.events import Admitted, Event
from ..custody.keys import group_id
from ..custody.ledger import Ledger
from ..rollout.samplers import Sampler
from ..rollout.source import PromptSource
from ..rollout.take import spare_event, take_event


def top_up_spare(ledger: Ledger, spare_prompts: int, apply: Callable[[Event], object]) -> None:
    while len(ledger.spare) < spare_prompts:
        ev = spare_event(ledger)
        if ev is None:
            return
        apply(ev)


def admit_and_take(
    ledger: Ledger,
    source: PromptSource,
    sampler: Sampler,
    *,
    group_size: int,
    granularity: str,
    total_steps: int,
    start_version: Callable[[int | None], int],
    apply: Callable[[Event], object],
) -> None:
    """Admit restored RESERVED groups, then take and admit new prompts, while the gate is
    open, the target step is one the run will train, and (unstamped samplers) the
    remaining steps are not covered yet."""

    def wanted(target: int | None) -> bool:
        return target is None or target <= total_steps

    def more_wanted() -> bool:
        if sampler.stamps:
            return True
        remaining = total_steps - ledger.version
        return len(ledger) < remaining * sampler.limits.num_prompts_per_step

    for gid in ledger.reserved_ids():
        ok, target = sampler.admission(ledger, new=False)
        if not ok or not wanted(target):
            return
        apply(Admitted(group_id=gid, target_step=target, version=start_version(target)))
    while True:
        ok, target = sampler.admission(ledger)
        if not ok or not wanted(target) or not more_wanted():
            return
        taken = take_event(ledger, source, group_size=group_size, granularity=granularity)
        if taken is None:
            return
        apply(taken)
        gid = group_id((taken.epoch, taken.ordinal))
        apply(Admitted(group_id=gid, target_step=target, version=start_version(target)))

"""Handing prompts out: the events that move keys out of SOURCE and SPARE, and the drop
that refills or shrinks a step (docs/design.md §6). Each function builds an event from the ledger
and the source (reading the dataset row first: I/O before a transition, never inside);
the caller applies it.

Where a taken prompt comes from, in order: the spare pool, then the source. The spare
pool is filled only on request (`spare_event`), for runs that want replacements for
dropped prompts set aside up front.
"""

from __future__ import annotations

from ..custody.events import FROM_SOURCE, FROM_SPARE, SIBLING, Dropped, Spared, Taken
from ..custody.keys import Key
from ..custody.ledger import Ledger
from ..errors import ExternalError
from .samplers import Limits
from .source import PromptSource


def next_origin(ledger: Ledger) -> tuple[Key, str] | None:
    """The key the next take hands out, and where from; None when nothing is left."""
    if ledger.spare:
        return ledger.spare[0], FROM_SPARE
    if not ledger.exhausted:
        return ledger.cursor, FROM_SOURCE
    return None


def take_event(
    ledger: Ledger, source: PromptSource, *, group_size: int, granularity: str = SIBLING
) -> Taken | None:
    """The `Taken` event for the next prompt, or None when source and spare are empty."""
    nxt = next_origin(ledger)
    if nxt is None:
        return None
    key, origin = nxt
    ref = source.describe(key)
    return Taken(
        epoch=key.epoch,
        ordinal=key.ordinal,
        idx=ref.idx,
        task=ref.task,
        row_fingerprint=ref.row_fingerprint,
        group_size=group_size,
        granularity=granularity,
        origin=origin,
    )


def spare_event(ledger: Ledger) -> Spared | None:
    """Set the prompt at the cursor aside into the spare pool (None if exhausted)."""
    if ledger.exhausted:
        return None
    return Spared(epoch=ledger.cursor.epoch, ordinal=ledger.cursor.ordinal)


def drop_event(
    ledger: Ledger,
    source: PromptSource,
    gid: str,
    reason: str,
    *,
    on_dropped_prompt: str,
    group_size: int,
    granularity: str = SIBLING,
) -> Dropped:
    """Drop `gid` and, if it was stamped for a step, refill or shrink that step.

    `on_dropped_prompt="replace"` takes a replacement (spare pool first, then the
    source) into the same step; when nothing is left to take it shrinks instead.
    """
    rec = ledger.group(gid)
    prompt = (rec.epoch, rec.idx)
    if rec.target_step is None:
        return Dropped(group_id=gid, reason=reason, prompt=prompt, step=ledger.version + 1)
    step = rec.target_step
    if on_dropped_prompt == "replace":
        taken = take_event(ledger, source, group_size=group_size, granularity=granularity)
        if taken is not None:
            return Dropped(group_id=gid, reason=reason, prompt=prompt, step=step, replacement=taken)
    elif on_dropped_prompt != "shrink":
        raise ValueError(f"on_dropped_prompt must be 'replace' or 'shrink', got {on_dropped_prompt!r}")
    return Dropped(group_id=gid, reason=reason, prompt=prompt, step=step, shrink=True)


def check_step_size(ledger: Ledger, limits: Limits, step: int, *, replacing: bool = False,
                    reason: str | None = None) -> None:
    """Stop the run if drops shrank `step` below `min_step_batch_fraction` (docs/design.md §6).
    `replacing`: the run replaces dropped prompts (`on_dropped_prompt: replace`), so a
    shrink means there was no prompt left to replace it with; `reason`: the last drop's."""
    remaining = limits.num_prompts_per_step - ledger.shortfall(step)
    if remaining < limits.min_step_groups:
        last = f"; the last drop: {reason}" if reason else ""
        if replacing:
            remedy = ("every prompt left was dropped too: the data ran out to failures, so look at the "
                      "'dropped' events in trace.jsonl (most often one cause, such as a reward function "
                      "or environment that fails on every completion), fix it, and run again (the run "
                      "resumes from its last checkpoint); or raise the failure budgets")
        else:
            remedy = ("look at the 'dropped' events in trace.jsonl for the failures; raise the failure "
                      "budgets, use on_dropped_prompt: replace, or lower min_step_batch_fraction")
        raise ExternalError(
            f"step {step} lost {ledger.shortfall(step)} of {limits.num_prompts_per_step} prompts "
            "to failures" + (" and no prompt is left to replace them" if replacing else "") + last,
            expected=f"at least {limits.min_step_groups} groups per step "
            f"(min_step_batch_fraction {limits.min_step_batch_fraction})",
            found=f"{remaining} left",
            remedy=remedy,
        )

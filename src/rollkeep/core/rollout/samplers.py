"""Samplers: admission (may the rollout pump take another prompt, and for which step?)
and selection (which READY groups does the next train step claim?).

A sampler is a policy with no state of its own: everything it decides from — target
steps stamped on records, shortfalls, start versions, the trainer's version — lives in the
ledger and is checkpointed with it. That is why every sampler resumes losslessly: the
groups generated ahead are REPLAY-owned records in the checkpoint, and the step they were
stamped for is still the step that trains them (loops that keep this state outside their
checkpoint lose or re-stamp the groups generated ahead when they resume).

    in_order     admission stamps `target_step`; step k trains exactly the groups stamped k;
                 the gate lets admission run at most `window` (= max_lookahead_versions)
                 steps ahead of the trainer. The only sampler for `deterministic: true`.
    weight_fifo  no stamps; a group admitted at version s is due by step s + window + 1
                 (window = max_staleness_versions). The gate admits only while fewer than
                 capacity = P × (window + 1) groups are alive, counting the claimed ones;
                 step k claims the oldest READY groups (by start version, then key), but
                 only if every group left behind can still be trained by its due step,
                 else it waits. Without failures no group is ever evicted (see WeightFifo).
    windowed     weight_fifo's gate (capacity P × (window + 1) live groups); step k claims
                 the oldest READY groups within the window and waits for no one; READY
                 groups that fall out of the window are evicted — regenerated or dropped,
                 by `on_stale`. Only a group overtaken while it generates can go stale
                 (see Windowed).

`P` is `num_prompts_per_step`. Counts are in groups (one group = one prompt × its
siblings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from ..custody.ledger import GroupState, Ledger
from ..errors import ConfigError, UserInputError

_READY = int(GroupState.READY)
_CLAIMED = int(GroupState.CLAIMED)

SAMPLERS = ("in_order", "weight_fifo", "windowed")
STALE_POLICIES = ("regenerate", "drop")


@dataclass(frozen=True)
class Limits:
    """Sizes shared by every sampler, checked once at start-up by `check_limits`."""

    num_prompts_per_step: int
    window: int
    max_inflight_prompts: int
    max_buffered_rollouts: int
    min_step_batch_fraction: float = 1.0

    @property
    def capacity(self) -> int:
        return self.num_prompts_per_step * (self.window + 1)

    @property
    def min_step_groups(self) -> int:
        return max(1, math.ceil(self.min_step_batch_fraction * self.num_prompts_per_step))


def check_limits(
    sampler: str,
    *,
    num_prompts_per_step: int,
    window: int,
    max_inflight_prompts: int | None,
    max_buffered_rollouts: int | None,
    min_step_batch_fraction: float = 1.0,
) -> Limits:
    """Validate the sizes together and fill defaults (both limits default to capacity).

    All problems are reported at once, as one `ConfigError`.
    """
    problems: list[str] = []
    if sampler not in SAMPLERS:
        problems.append(f"sampler.name is {sampler!r}; expected one of {', '.join(SAMPLERS)}")
    if num_prompts_per_step < 1:
        problems.append(f"train.num_prompts_per_step is {num_prompts_per_step}; it must be >= 1")
    if window < 0:
        key = "sampler.max_lookahead_versions" if sampler == "in_order" else "sampler.max_staleness_versions"
        problems.append(f"{key} (the {sampler} window) is {window}; it must be >= 0")
    capacity = max(1, num_prompts_per_step) * (max(0, window) + 1)
    inflight = capacity if max_inflight_prompts is None else max_inflight_prompts
    buffered = capacity if max_buffered_rollouts is None else max_buffered_rollouts
    if inflight < 1:
        problems.append(f"max_inflight_prompts is {inflight}; it must be >= 1")
    if buffered < num_prompts_per_step:
        problems.append(
            f"max_buffered_rollouts is {buffered} but a step needs {num_prompts_per_step} "
            "finished groups buffered at once (train.num_prompts_per_step): the run would stall; "
            f"set it to at least {num_prompts_per_step}"
        )
    if buffered > capacity:
        problems.append(
            f"max_buffered_rollouts is {buffered} but the {sampler} gate never buffers more than "
            f"its capacity num_prompts_per_step × (window + 1) = {capacity}; set it to at most "
            f"{capacity} or leave it unset"
        )
    if not (0.0 < min_step_batch_fraction <= 1.0):
        problems.append(f"min_step_batch_fraction is {min_step_batch_fraction}; expected 0 < f <= 1")
    if problems:
        raise ConfigError(
            f"{len(problems)} problem(s) with the sampler sizes: " + "; ".join(problems),
            expected="consistent sampler sizes",
            found="; ".join(problems),
            remedy="fix the keys named above",
        )
    return Limits(num_prompts_per_step, window, inflight, buffered, min_step_batch_fraction)


class Sampler(Protocol):
    name: str
    stamps: bool  # whether admission stamps target steps
    limits: Limits

    def admission(self, ledger: Ledger, *, new: bool = True) -> tuple[bool, int | None]:
        """(open, target_step): may the pump admit one more group now, and for which step.

        `new=False` asks for a group already taken (RESERVED): it is in flight already,
        so only the step gate applies, not the in-flight and buffer limits."""
        ...

    def select(self, ledger: Ledger, step: int, *, final: bool) -> list[str] | None:
        """Group ids the train step `step` claims, sorted by key; None = not ready yet.

        `final` = no more groups can ever arrive (source and spare drained, nothing in
        flight): train what is there, if anything.
        """
        ...

    def stale(self, ledger: Ledger) -> list[str]:
        """READY groups that can no longer be trained (outside the window), by key."""
        ...


def _by_key(ledger: Ledger, gids: list[str]) -> list[str]:
    return sorted(gids, key=lambda g: ledger.group(g).key)


def _room(ledger: Ledger, limits: Limits) -> bool:
    return ledger.n_inflight() < limits.max_inflight_prompts and ledger.n_ready() < limits.max_buffered_rollouts


def _capacity_gate(ledger: Ledger, limits: Limits, *, new: bool) -> tuple[bool, None]:
    """weight_fifo's and windowed's admission: open while fewer than capacity = P·(W+1)
    groups are alive, claimed ones included (WeightFifo says why that is the bound)."""
    if new:  # every live group counts: claimed ones, and RESERVED ones waiting to be admitted
        return _room(ledger, limits) and len(ledger) < limits.capacity, None
    return len(ledger) - len(ledger.reserved_ids()) < limits.capacity, None


@dataclass(frozen=True)
class InOrder:
    limits: Limits
    name: str = "in_order"
    stamps: bool = True

    def next_target(self, ledger: Ledger) -> int:
        """The lowest uncommitted step not yet full (stamped + shortfall < P)."""
        p = self.limits.num_prompts_per_step
        k = ledger.version + 1
        while ledger.n_stamped(k) + ledger.shortfall(k) >= p:
            k += 1
        return k

    def admission(self, ledger: Ledger, *, new: bool = True) -> tuple[bool, int | None]:
        k = self.next_target(ledger)
        open_ = k <= ledger.version + 1 + self.limits.window and (not new or _room(ledger, self.limits))
        return open_, k

    def select(self, ledger: Ledger, step: int, *, final: bool) -> list[str] | None:
        gids = ledger.stamped(step)
        if not gids:
            return None
        if any(ledger.group(g).state != _READY for g in gids):
            return None
        full = len(gids) + ledger.shortfall(step) >= self.limits.num_prompts_per_step
        return _by_key(ledger, gids) if full or final else None

    def stale(self, ledger: Ledger) -> list[str]:
        return []  # the gate bounds age by construction


def _fresh_enough(ledger: Ledger, gid: str, window: int) -> bool:
    # Step version+1 trains with weights of `version`; age = version - start_version.
    return ledger.version - ledger.group(gid).start_version <= window


def _oldest_ready(ledger: Ledger, window: int) -> list[str]:
    """READY groups within the window, oldest first: by start version, then key. A group
    admitted under a version the ledger has not reached (after a journal replay took back
    the steps it was admitted after: a lost version, docs/design.md §5.1) waits until it
    has: trained earlier, its rows would be newer than the weights they train."""
    v = ledger.version
    fresh = [g for g in ledger.ready_ids() if _fresh_enough(ledger, g, window) and ledger.group(g).start_version <= v]
    return sorted(fresh, key=lambda g: (ledger.group(g).start_version, ledger.group(g).key))


@dataclass(frozen=True)
class WeightFifo:
    """Gated by capacity; trains the oldest READY groups; never lets a group go stale.

    A group admitted at weight version s may be trained with weights up to s + W
    (W = window = max_staleness_versions), so it is *due* by step s + W + 1. Let v be the
    trainer's version and N(t) the live admitted groups (GENERATING .. CLAIMED) started at
    a version <= t. Steps v+1 .. t+W+1 have P·(t+W+1-v) places, so the invariant is

        (I)  N(t) <= P·(t + W + 1 - v)   for every t in [v - W, v].

    Admission (at version v, start version v): open while fewer than P·(W+1) groups are
    alive, claimed ones included. It adds to N(v) only, and keeps N(v) <= P·(W+1): (I) at
    t = v. (The gate used to leave claimed groups out of the count, so while step v+1
    trained it admitted P groups more than steps v+1 .. v+W+1 can hold: they went stale.)

    Selection of step v+1: take the P oldest READY groups S; after the commit (version
    v+1) the groups left are N(t) - |S ∩ N(t)|, which (I) at v+1 bounds by P·(t+W-v). So
    claim S only if |S ∩ N(t)| >= need(t) = N(t) - P·(t+W-v) for every t, else wait:
    at t = v-W, need = N(t) means the groups due at this step must all be in it. (I) gives
    need(t) <= P, so the P oldest alive groups always qualify; the P oldest READY ones
    hold the most of every N(t) that READY groups can, so if they do not qualify, no
    choice does, and waiting for the older groups still generating is the only way to keep
    them in time. (Selection used to claim the P oldest READY groups without this check,
    so newer groups overtook an older, slower one until it was past its due step.) Groups
    admitted while step v+1 trains start at v, and the gate still counts S: after the
    commit N(v) - P <= P·W.

    By (I) at version s + W + 1, N(s) = 0: every group started at s was trained with
    weights of version <= s + W. So in an uninterrupted run no group is ever stale and
    nothing is regenerated. Progress: selection waits only for admitted groups that are
    still generating, whose siblings are dispatched without any gate.

    Failures: an infra or data failure with a retry keeps its group alive and counted, so
    the trainer waits for it when it is due (until a retry seals it, or its budget is spent
    and it is dropped) rather than letting it go stale. A group dropped (budget spent) leaves every N(t): (I) only gets easier. A
    restart restores the ledger as cut, so (I) holds on resume too (claims are released,
    start versions kept). Only a change of P or W on resume can break (I); need(t) is
    capped at P, so selection then waits for the oldest groups first, some groups may go
    stale, and `stale` evicts them (regenerate or drop, by `on_stale`).
    """

    limits: Limits
    name: str = "weight_fifo"
    stamps: bool = False

    def admission(self, ledger: Ledger, *, new: bool = True) -> tuple[bool, int | None]:
        return _capacity_gate(ledger, self.limits, new=new)

    def select(self, ledger: Ledger, step: int, *, final: bool) -> list[str] | None:
        p = self.limits.num_prompts_per_step
        ready = _oldest_ready(ledger, self.limits.window)
        if len(ready) < p and not (final and ready):
            return None
        chosen = ready[:p]
        return _by_key(ledger, chosen) if self.leaves_every_group_in_time(ledger, chosen) else None

    def leaves_every_group_in_time(self, ledger: Ledger, chosen: list[str]) -> bool:
        """Whether claiming `chosen` for step version+1 keeps invariant (I): for every
        start version t, at least need(t) = N(t) - P·(t+W-v) (capped to 0..P) of the
        groups started at <= t are in `chosen`."""
        if ledger.n_inflight() == 0:
            return True  # every live group is READY: the oldest are chosen
        p, w, v = self.limits.num_prompts_per_step, self.limits.window, ledger.version
        oldest = v - w  # groups started before it are stale already: nothing can save them
        alive = [0] * (w + 1)  # alive[i]: live admitted groups started at version oldest + i
        taken = [0] * (w + 1)  # of them, in `chosen`
        picked = set(chosen)
        for gid, rec in ledger.groups():
            s = rec.start_version
            # Started after `v`: a journal replay took back the steps it was admitted under;
            # it is due after this window, so nothing here must make room for it yet.
            if s is None or s < oldest or s > v or rec.state == _CLAIMED:
                continue
            alive[s - oldest] += 1
            taken[s - oldest] += gid in picked
        n = k = 0
        for i in range(w + 1):  # t = oldest + i, due by step v + 1 + i: i steps after this one
            n, k = n + alive[i], k + taken[i]
            if k < min(p, max(0, n - p * i)):
                return False
        return True

    def stale(self, ledger: Ledger) -> list[str]:
        w = self.limits.window
        return _by_key(ledger, [g for g in ledger.ready_ids() if not _fresh_enough(ledger, g, w)])


@dataclass(frozen=True)
class Windowed:
    """weight_fifo's gate; trains the oldest READY groups within the window, waiting for
    no one; evicts the stale ones.

    Admission is weight_fifo's: open while fewer than P·(W+1) groups are alive, claimed
    ones included, so invariant (I) of WeightFifo holds at admission: no more is generated
    than the W+1 steps of the window can train. (Admission used to be bounded only by
    max_inflight_prompts and max_buffered_rollouts, which could exceed P·(W+1): the READY
    groups beyond it aged out of the window with no kill at all, and about half of all
    generation was evicted and done again.)

    Selection is what sets windowed apart: it takes the P oldest READY groups within the
    window and waits for no one, so a step never stalls behind a slow group. Selection
    keeps (I) whenever the groups it takes include those of weight_fifo's `need(t)`; it
    breaks it only when a group still generating is overtaken by newer READY ones. Hence
    the rule: **a group goes stale only if it is still generating when W+1 steps after its
    admission have claimed their groups without it** — a straggler, whose generation took
    longer than the window's steps did. In the steady state the gate leaves step v+2 with
    the P groups started at v and the P just admitted at v+1 as its only candidates, so a
    straggler started at v is overtaken only by a group that started a whole train step
    later and finished first. Such a group is evicted — with `on_stale: regenerate`
    generated again from fresh weights (the ledger keeps custody: each prompt is still
    trained exactly once), with `drop` dropped with the reason "stale". Use weight_fifo to
    wait for stragglers and waste nothing; windowed trades that waste for never waiting.
    Failures, restarts and a change of P or W on resume act as for weight_fifo.
    """

    limits: Limits
    name: str = "windowed"
    stamps: bool = False

    def admission(self, ledger: Ledger, *, new: bool = True) -> tuple[bool, int | None]:
        return _capacity_gate(ledger, self.limits, new=new)

    def select(self, ledger: Ledger, step: int, *, final: bool) -> list[str] | None:
        p = self.limits.num_prompts_per_step
        ready = _oldest_ready(ledger, self.limits.window)
        if len(ready) < p and not (final and ready):
            return None
        return _by_key(ledger, ready[:p])

    def stale(self, ledger: Ledger) -> list[str]:
        w = self.limits.window
        return _by_key(ledger, [g for g in ledger.ready_ids() if not _fresh_enough(ledger, g, w)])


def make_sampler(name: str, limits: Limits) -> Sampler:
    if name == "in_order":
        return InOrder(limits)
    if name == "weight_fifo":
        return WeightFifo(limits)
    if name == "windowed":
        return Windowed(limits)
    raise UserInputError(
        f"unknown sampler {name!r}",
        field="sampler.name",
        expected=", ".join(SAMPLERS),
        found=repr(name),
        remedy="choose one of the samplers listed",
    )

"""Samplers: admission (may the rollout pump take another prompt, and for which step?)
and selection (which READY groups does the next train step claim?).

A sampler is a policy with no state of its own: everything it decides from — target
steps stamped on records, shortfalls, start versions, the trainer's version — lives in the
ledger and is checkpointed with it. That is why every sampler resumes losslessly: the
groups generated ahead are REPLAY-owned records in the checkpoint, and the step they were
stamped for is still the step that trains them (the bug of `reference/001_*` cannot occur).

    in_order     admission stamps `target_step`; step k trains exactly the groups stamped k;
                 the gate lets admission run at most `window` (= max_lookahead_versions)
                 steps ahead of the trainer. The only sampler for `deterministic: true`.
    weight_fifo  no stamps; step k trains the oldest READY groups (by start version, then
                 key) whose age at step k is within `window` (= max_staleness_versions);
                 the gate keeps at most capacity = P × (window + 1) groups alive.
    windowed     like weight_fifo but ungated (only max_inflight_prompts and
                 max_buffered_rollouts bound it); READY groups that fall out of the window
                 are evicted — regenerated or dropped, by `on_stale`.

`P` is `num_prompts_per_step`. Counts are in groups (one group = one prompt × its
siblings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from .errors import ConfigError, UserInputError
from .ledger import GroupState, Ledger

_READY = int(GroupState.READY)

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
    if sampler in ("in_order", "weight_fifo") and buffered > capacity:
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


@dataclass(frozen=True)
class InOrder:
    limits: Limits
    name: str = "in_order"
    stamps: bool = True

    def next_target(self, ledger: Ledger) -> int:
        """The lowest uncommitted step not yet full (stamped + shortfall < P)."""
        p = self.limits.num_prompts_per_step
        k = ledger.version + 1
        while len(ledger.stamped(k)) + ledger.shortfall(k) >= p:
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


@dataclass(frozen=True)
class _Windowed:
    limits: Limits
    name: str
    gated: bool
    stamps: bool = False

    def admission(self, ledger: Ledger, *, new: bool = True) -> tuple[bool, int | None]:
        open_ = not new or _room(ledger, self.limits)
        if self.gated and new:
            live = len(ledger) - ledger.n_claimed()
            open_ = open_ and live < self.limits.capacity
        return open_, None

    def _fresh_enough(self, ledger: Ledger, gid: str) -> bool:
        # Step version+1 trains with weights of `version`; age = version - start_version.
        return ledger.version - ledger.group(gid).start_version <= self.limits.window

    def select(self, ledger: Ledger, step: int, *, final: bool) -> list[str] | None:
        eligible = [g for g in ledger.ready_ids() if self._fresh_enough(ledger, g)]
        p = self.limits.num_prompts_per_step
        if len(eligible) < p and not (final and eligible):
            return None
        eligible.sort(key=lambda g: (ledger.group(g).start_version, ledger.group(g).key))
        return _by_key(ledger, eligible[:p])

    def stale(self, ledger: Ledger) -> list[str]:
        return _by_key(ledger, [g for g in ledger.ready_ids() if not self._fresh_enough(ledger, g)])


def make_sampler(name: str, limits: Limits) -> Sampler:
    if name == "in_order":
        return InOrder(limits)
    if name == "weight_fifo":
        return _Windowed(limits, name="weight_fifo", gated=True)
    if name == "windowed":
        return _Windowed(limits, name="windowed", gated=False)
    raise UserInputError(
        f"unknown sampler {name!r}",
        field="sampler.name",
        expected=", ".join(SAMPLERS),
        found=repr(name),
        remedy="choose one of the samplers listed",
    )

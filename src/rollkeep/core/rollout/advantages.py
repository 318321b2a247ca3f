"""Group-relative advantages (GRPO) and reward scaling (`trainer.scale_rewards`).

Every sibling's advantage is its reward minus its group's mean reward, optionally divided
by a spread of the rewards. For a group of G rewards r_1..r_G with mean m:

    group_population  A_i = (r_i - m) / (std_pop(r) + eps)      std_pop² = Σ (r_j - m)² / G
                      (the default: rollkeep's behaviour before the option existed)
    group             A_i = (r_i - m) / (std_sample(r) + eps)   std_sample² = Σ (r_j - m)² / (G-1)
                      (TRL's `scale_rewards="group"`, verl's `norm_adv_by_std_in_grpo: true`)
    batch             A_i = (r_i - m) / (std_sample(R) + eps), R = every reward of the step's
                      batch (TRL's `scale_rewards="batch"`)
    none              A_i = r_i - m
                      (TRL's `scale_rewards="none"`, verl's `norm_adv_by_std_in_grpo: false`,
                      Dr. GRPO)

eps = 1e-6 in every mode (verl's default; TRL adds 1e-4). For a fixed G, `group_population`
advantages are those of `group` times sqrt(G / (G - 1)) (x1.41 at G = 2, x1.07 at G = 8):
the same direction, but a KL coefficient or a gradient clip tuned under TRL or verl bites
differently, so a ported run should set `group`.

Where they are computed
-----------------------
Advantages are computed once per group when it is finalized and stored in the ledger
(`stored_advantages`), so they are part of custody: a resumed run reads the same numbers
(and a group restored mid-finalize computes them again from the same stored rewards).
`batch` needs the whole step's batch, which is not known at finalize (in an asynchronous
run a group may be trained in any of several steps). So for `batch` the ledger stores the
group-centred advantages r_i - m (exactly what `none` stores) and the trainer divides them
by std_sample over the rewards of all rows of the step's batch at train time
(`batch_scaled`). The batch is a deterministic function of the step's claim and the rows
are immutable, so a resumed run divides by the same number.

Properties that hold in every mode (tests check them)
-----------------------------------------------------
1. A group whose siblings all scored the same carries no signal and gets advantages that
   are exactly 0.0 -- not (r_i - m) / eps of rounding noise, which other frameworks return
   there -- and `batch_scaled` keeps them exactly 0.0.
2. Stored advantages are group-centred: they sum to 0 per group up to float rounding, and
   they are finite for finite rewards.
3. Their size depends on the mode, so a bound on stored advantages must not assume they are
   normalised: |A_i| < sqrt(G - 1) for `group_population`, |A_i| < (G - 1) / sqrt(G) for
   `group`, and |A_i| <= max(r) - min(r) (the group's reward range) for `none` and `batch`
   (stored, before the train-time division).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

__all__ = ["MAX_REWARD", "SCALE_REWARDS", "ScaleRewards", "batch_scaled", "group_advantages", "stored_advantages"]

ScaleRewards = Literal["group_population", "group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = ("group_population", "group", "batch", "none")
EPS = 1e-6
# A reward beyond this is a data failure of its attempt (`Scheduler.on_result`): within it a
# group's mean, spread and advantages stay far inside float range and inside the ledger's
# bound on stored advantages (1e30, invariant I6), e.g. |r_i - m| <= 2e15 for `none`.
MAX_REWARD = 1e15


def group_advantages(
    rewards: Sequence[float], *, eps: float = EPS, normalize_std: bool = True, ddof: int = 0
) -> tuple[float, ...]:
    """(r_i - mean) / (std + eps) over one group; std has divisor G - ddof (0: population,
    1: sample); `normalize_std=False` returns r_i - mean. No signal: exactly zero."""
    n = len(rewards)
    if max(rewards) == min(rewards):
        return (0.0,) * n  # exactly zero, not rounding noise over eps
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if not normalize_std:
        return tuple(centred)
    std = math.sqrt(sum(c * c for c in centred) / (n - ddof))  # n >= 2 here: max != min
    return tuple(c / (std + eps) for c in centred)


def stored_advantages(rewards: Sequence[float], scale_rewards: ScaleRewards) -> tuple[float, ...]:
    """What the ledger stores for one group at finalize under `scale_rewards`: normalised
    for the two group modes, group-centred for `none` and `batch` (the trainer divides
    `batch` at train time)."""
    if scale_rewards == "group_population":
        return group_advantages(rewards)
    if scale_rewards == "group":
        return group_advantages(rewards, ddof=1)
    if scale_rewards in ("batch", "none"):
        return group_advantages(rewards, normalize_std=False)
    raise ValueError(f"unknown scale_rewards {scale_rewards!r}; expected one of {SCALE_REWARDS}")


def batch_scaled(
    advantages: Sequence[float], batch_rewards: Sequence[float], *, eps: float = EPS
) -> tuple[float, ...]:
    """`batch` mode at train time: the stored (group-centred) advantages of a step's rows
    divided by std_sample(batch_rewards) + eps, over the rewards of the same rows. A zero
    advantage stays exactly zero; a batch of one row (no sample std) has std 0."""
    n = len(batch_rewards)
    std = 0.0
    if n >= 2:
        mean = sum(batch_rewards) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in batch_rewards) / (n - 1))
    return tuple(a / (std + eps) for a in advantages)

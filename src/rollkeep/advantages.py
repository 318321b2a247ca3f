"""Group-relative advantages (GRPO): each sibling's reward minus the group mean, divided
by the group's standard deviation. A group whose siblings all scored the same carries no
signal and gets zero advantages."""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], *, eps: float = 1e-6, normalize_std: bool = True) -> tuple[float, ...]:
    n = len(rewards)
    if max(rewards) == min(rewards):
        return (0.0,) * n  # exactly zero, not rounding noise over eps
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if not normalize_std:
        return tuple(centred)
    std = math.sqrt(sum(c * c for c in centred) / n)
    return tuple(c / (std + eps) for c in centred)

"""Held-out problems of the generated tasks: operand pairs drawn from their own seeded
stream, none of them a training problem."""

from __future__ import annotations

import numpy as np


def distinct_pairs(rng: np.random.Generator, lo: int, hi: int, n: int, seen: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """`n` operand pairs in [lo, hi)², each new to `seen` (which grows with them), in the
    order `rng` draws them (4n candidates per round). The caller checks enough are left."""
    out: list[tuple[int, int]] = []
    while len(out) < n:
        for x, y in zip(rng.integers(lo, hi, 4 * n), rng.integers(lo, hi, 4 * n), strict=True):
            pair = (int(x), int(y))
            if pair in seen:
                continue
            seen.add(pair)
            out.append(pair)
            if len(out) == n:
                break
    return out

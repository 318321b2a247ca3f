"""The simulation's side of a multi-turn episode (docs/design.md §5.4): a deterministic
environment and a tokenizer for the world's engine, which drives the real episode machine
(`core.schedule.episode.Episode`) with them (`world._Process._episode`).

Model tokens are digits (the world's engine makes each one a function of the request's
seed and its position); the tokenizer writes ids as space-separated numbers and reads them
back, so a response's tokens are exactly the ids it names. The environment answers every
turn with `RESPONSE` (two environment tokens, 7 7), a function of nothing but how many
turns it has seen since `reset` (a replay answers as recorded), which is also its snapshot.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..envs.base import REPLAY, SNAPSHOT, Step

__all__ = ["RESPONSE", "SimEnv", "SimTokenizer"]

RESPONSE = "7 7"


class SimTokenizer:
    """ids <-> text as space-separated numbers (`encode(decode(ids)) == ids`)."""

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: Any) -> str:
        return " ".join(str(int(i)) for i in np.asarray(ids).tolist())


class SimEnv:
    """Deterministic: after its n-th step since `reset` it answers RESPONSE, done at
    `done_at` steps (None: never, `env.max_turns` ends the episode), rewarded with the
    parity of the turn's first token."""

    def __init__(self, recovery: str = REPLAY, done_at: int | None = None) -> None:
        assert recovery in (REPLAY, SNAPSHOT)
        self.recovery, self.done_at, self.n = recovery, done_at, 0

    def reset(self, row: Any, seed: int) -> None:
        self.n = 0

    def step(self, text: str) -> Step:
        self.n += 1
        first = text.split()[0] if text.split() else "0"
        return Step(RESPONSE, self.done_at is not None and self.n >= self.done_at, float(int(first) % 2))

    def snapshot(self) -> bytes:
        return str(self.n).encode()

    def restore(self, data: bytes) -> None:
        self.n = int(data.decode())

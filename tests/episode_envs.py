"""Environments for the multi-turn tests, imported by `env.factory` ("episode_envs:...").

Both count the model's turns and answer with the count; the episode ends at turn `turns`.
`CountEnv` recovers by replay; `SnapCountEnv` by snapshot, and its state includes a number
a replay could not rebuild (its own counter of how often it was restored), so a test can
tell that the snapshot, not a replay, brought it back.
"""

from __future__ import annotations

import json

from rollkeep.envs import Step


class CountEnv:
    recovery = "replay"

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns

    def reset(self, row, seed) -> None:
        self.n = 0

    def step(self, text: str) -> Step:
        self.n += 1
        if self.n == self.turns:
            return Step(done=True, reward=float(len(text) % 2))
        return Step(response=f"={self.n};")


class SnapCountEnv(CountEnv):
    recovery = "snapshot"
    restores = 0  # in this process

    def snapshot(self) -> bytes:
        return json.dumps({"n": self.n}).encode()

    def restore(self, data: bytes) -> None:
        self.n = json.loads(data)["n"]
        type(self).restores += 1


class FlakyEnv(CountEnv):
    """Raises on every turn of some episodes (a data failure), by the row."""

    def reset(self, row, seed) -> None:
        super().reset(row, seed)
        self.bad = int(str(row["answer"])[-1]) == 7

    def step(self, text: str) -> Step:
        if self.bad:
            raise RuntimeError("flaky environment")
        return super().step(text)


class DriftingEnv(CountEnv):
    """Declares replay but answers differently in every process: not deterministic."""

    import os as _os

    def step(self, text: str) -> Step:
        out = super().step(text)
        return out if out.done else Step(response=f"={self.n}:{self._os.getpid()};")  # pids are not reused at once

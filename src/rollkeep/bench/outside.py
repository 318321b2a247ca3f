"""A simulated outside for the effects benchmark and the real-kill tests (`rollkeep bench
--suite effects`, tests/controller/test_effect_runs.py): reward functions and environments
that call it through `rollkeep.effects`.

The outside is a file every call appends its idempotency key to (`ROLLKEEP_TEST_CALLS`): it
outlives the process, as a judge server's log would, so calls are counted per key across
kills. `ROLLKEEP_TEST_KILL_AT=n` makes the process SIGKILL itself right after its n-th call
has happened and before its outcome is recorded: the window where only the intent is
durable. `ROLLKEEP_TEST_POLICY` is the `on_unknown` policy (retry by default);
`ROLLKEEP_TEST_LATENCY_S` a judge's latency (awaited, as an HTTP call would be);
`ROLLKEEP_TEST_LEASES` the directory the lease environments' "server" keeps its state in.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import xxhash

from rollkeep import effects
from rollkeep.envs import Step

_made = 0  # calls this process made (a forked child starts from the parent's 0)


def _policy() -> str:
    return os.environ.get("ROLLKEEP_TEST_POLICY", "retry")


def _called(key: str) -> None:
    """The outside records the call (and the process may die right after it)."""
    global _made
    fd = os.open(os.environ["ROLLKEEP_TEST_CALLS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{key}\n".encode())
    finally:
        os.close(fd)
    _made += 1
    if _made == int(os.environ.get("ROLLKEEP_TEST_KILL_AT", "0")):
        os.kill(os.getpid(), signal.SIGKILL)  # the call happened; its outcome dies with the process


def _outside(request, key: str):
    """The external service: it records the call, then answers as a pure function of the request."""
    _called(key)
    return {"score": xxhash.xxh3_64_intdigest(repr(sorted(request.items())).encode()) % 3 / 2}


async def _outside_later(request, key: str):
    await asyncio.sleep(float(os.environ.get("ROLLKEEP_TEST_LATENCY_S", "0")))
    return _outside(request, key)


async def judge(completion: str, row) -> float:
    """An async reward through one recorded call."""
    out = await effects.call("judge", {"text": completion, "prompt": row["prompt"]}, _outside_later,
                             on_unknown=_policy())
    return out["score"]


def judge_sync(completion: str, row) -> float:
    out = effects.call_sync("judge", {"text": completion, "prompt": row["prompt"]}, _outside, on_unknown=_policy())
    return out["score"]


class ToolEnv:
    """A multi-turn episode whose every step calls a tool outside (recovered by replay: a
    replayed step's call is answered from its record); the episode ends at turn `turns`."""

    recovery = "replay"

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns

    def reset(self, row, seed) -> None:
        self.n, self.prompt = 0, row["prompt"]

    def step(self, text: str) -> Step:
        self.n += 1
        out = effects.call_sync("tool", {"turn": self.n, "text": text, "prompt": self.prompt}, _outside,
                                on_unknown=_policy())
        if self.n == self.turns:
            return Step(done=True, reward=out["score"])
        return Step(response=f"={out['score']};")


class LeaseEnv:
    """An episode whose state lives on "a server" (a directory, `ROLLKEEP_TEST_LEASES`): the
    lease is opened through a recorded call (a restart reuses it), each finished turn is
    committed as a version the handle names, and `release` ends the lease (logged, so a
    test counts releases per lease)."""

    recovery = "lease"

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns
        self.root = os.environ["ROLLKEEP_TEST_LEASES"]

    def reset(self, row, seed) -> None:
        self.lease = effects.call_sync("lease.open", {"prompt": row["prompt"], "seed": seed}, _open_lease)["lease"]
        self.n = 0

    def step(self, text: str) -> Step:
        self.n += 1
        if self.n == self.turns:
            return Step(done=True, reward=float(len(text) % 2))
        return Step(response=f"={self.n};")

    def commit(self) -> bytes:
        path = os.path.join(self.root, f"{self.lease}.v{self.n}")
        with open(path, "w") as f:
            f.write(str(self.n))
        return f"{self.lease}:{self.n}".encode()

    def resume(self, handle: bytes) -> None:
        self.lease, _, n = handle.decode().partition(":")
        if os.path.exists(os.path.join(self.root, f"{self.lease}.released")):
            raise RuntimeError(f"lease {self.lease} was released")
        with open(os.path.join(self.root, f"{self.lease}.v{n}")) as f:
            self.n = int(f.read())

    def release(self) -> None:
        with open(os.path.join(self.root, f"{self.lease}.released"), "a") as f:
            f.write("x")


def _open_lease(request, key: str):
    """The server opens one lease per idempotency key (a repeated key gets the same one)."""
    root = os.environ["ROLLKEEP_TEST_LEASES"]
    lease = xxhash.xxh3_64_hexdigest(key.encode())
    with open(os.path.join(root, f"{lease}.opened"), "a") as f:
        f.write("x")
    _called(key)
    return {"lease": lease}


class SlowLeaseEnv(LeaseEnv):
    """A lease environment whose steps take `step_s` seconds (a slow sandbox)."""

    def __init__(self, turns: int = 3, step_s: float = 0.2) -> None:
        super().__init__(turns)
        self.step_s = step_s

    def step(self, text: str) -> Step:
        time.sleep(self.step_s)  # the work of a slow step, not a synchronisation
        return super().step(text)

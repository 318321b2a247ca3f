"""The environment protocol: multi-turn episodes (docs/design.md §5.4).

An episode starts from a dataset row and a seed, then alternates model turns and the
environment's responses until the environment says it is done or `env.max_turns` turns
were taken:

    env = factory(**env.kwargs)          one object per episode
    env.reset(row, seed)
    step = env.step(model_text)          the model's turn, decoded (EOS ended)
    ... step.response is appended to the trajectory (its tokens masked out of the loss)
    ... until step.done; the episode's reward is the last step's (an environment that
    ... scores its turns folds their scores into it)

(The last step's, not a sum: after a restore from a snapshot, the rewards of the turns
before it are not known again, and an outcome reward is what GRPO uses.)

The trajectory a trainer sees is the prompt, then each model turn and environment response
in order; environment tokens carry `ENV_VERSION` instead of a weight version, and that is
what masks them out of the loss.

How an episode's state comes back after a restore (`recovery`):

    replay     (the default) a fresh environment is reset and given the recorded model
               turns again; it must answer them as it did (a deterministic function of
               row, seed and turns). The runner checks the replayed responses against the
               recorded ones: a difference is a data failure of the attempt.
    snapshot   the environment exports its state as bytes after each finished turn
               (`snapshot()`, at most `env.max_snapshot_bytes`), stored with the turn; a
               restore calls `restore(data)` on a fresh environment instead of replaying.
    lease      the episode's state lives in a server (a sandbox, a browser, a game): after
               each finished turn `commit()` has the server persist it and returns a small
               handle (at most `env.max_snapshot_bytes`), stored with the turn; a restore
               calls `resume(handle)` on a fresh environment. `release()` ends the
               episode's lease on the server: rollkeep calls it once the episode is over
               for good (its seal or its data failure durable), and, for an episode whose
               recorded turns will not be continued (dropped, evicted, regenerated), on a
               fresh environment resumed from its last handle. A handle must stay valid
               until its lease is released (commits are versions, not overwrites), and a
               release the server already saw must be a no-op (a kill may repeat it).

An exception from the factory, `reset`, `step`, `snapshot` or `restore`, a call past
`env.timeout_s`, or a response longer than `env.max_response_bytes` (UTF-8) is a data
failure of that attempt (within `rollout.max_data_attempts`). Every call runs on a worker
thread of the run's own (`controller.usercode`): one past its deadline is abandoned, left
to finish or hang, and never holds up later calls or the process's exit. SystemExit or
KeyboardInterrupt from an environment stops the run (final checkpoint, exit 2).
Environments of one run are called from several threads at once (one object per episode,
each used by one episode at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

from ..core.rollout.rows import ENV_VERSION

__all__ = ["ENV_VERSION", "LEASE", "RECOVERY_METHODS", "RECOVERY_MODES", "REPLAY", "SNAPSHOT", "Environment",
           "EnvFactory", "LeaseEnvironment", "Step"]

# ENV_VERSION, in a trajectory's `versions`: a token the environment wrote, not the model.
# Masked out of the loss; its behaviour log-probability is 0. (Defined with the row it marks.)

REPLAY = "replay"
SNAPSHOT = "snapshot"
LEASE = "lease"
RECOVERY_MODES = (REPLAY, SNAPSHOT, LEASE)
#: What each recovery mode needs besides reset(row, seed) and step(text).
RECOVERY_METHODS = {REPLAY: (), SNAPSHOT: ("snapshot", "restore"), LEASE: ("commit", "resume", "release")}


class Step(NamedTuple):
    """The environment's answer to one model turn."""

    response: str = ""  # appended after the model's turn when the episode goes on
    done: bool = False  # the episode ends with this turn
    reward: float = 0.0  # the episode's reward, read from the step that ends it


@runtime_checkable
class Environment(Protocol):
    recovery: str  # REPLAY or SNAPSHOT

    def reset(self, row: Mapping[str, Any], seed: int) -> None:
        """Start an episode on dataset row `row` (every field) with seed `seed`."""
        ...

    def step(self, text: str) -> Step:
        """The model's turn, decoded: the environment's response, whether the episode is
        done, and the turn's reward."""
        ...


class SnapshotEnvironment(Environment, Protocol):
    def snapshot(self) -> bytes:
        """The episode's state after the last step, as bytes."""
        ...

    def restore(self, data: bytes) -> None:
        """Continue from a `snapshot()` (on a fresh environment, instead of `reset`)."""
        ...


class LeaseEnvironment(Environment, Protocol):
    def commit(self) -> bytes:
        """Have the server persist the episode's state after the last step; its handle."""
        ...

    def resume(self, handle: bytes) -> None:
        """Continue from a `commit()`'s handle (on a fresh environment, instead of `reset`)."""
        ...

    def release(self) -> None:
        """End the episode's lease on the server (after `reset` or `resume`)."""
        ...


EnvFactory = Callable[..., Environment]  # called as factory(**env.kwargs), once per episode

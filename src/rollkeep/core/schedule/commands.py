"""What the scheduler asks its runner to do, and what the runner reports back.

The scheduler (h11's pattern) never waits and never does IO: `Scheduler.poll(now)`
returns commands, and the runner carries each one out and reports the outcome through a
callback (`on_result`, `on_trained`, `on_refit`, `on_cut_written`, `on_signal`). Commands
are frozen records; carrying them out never changes custody by itself.

    Dispatch(request,      start one generation attempt; `stream`: report its chunks
             stream)       as they come (on_progress)             -> on_result(key, outcome)
    Cancel(attempts)       stop these attempts' work (results are ignored anyway)
    Train(step, batch)     run one optimizer step on `batch`      -> on_trained(step)
    Cut(step, final,       custody captured at the end of the poll: take the journal's
        custody)           position and snapshot the trainer before any other scheduler
                           call, then write all in the
                           background (`rollkeep.core.schedule.cutting`)   -> on_cut_written(step)
    Refit(version)         load the trainer's weights into the
                           engine                                 -> on_refit(version)
    Evaluate(version)      the held-out evaluation of the weights
                           of `version` (eval.every_steps); the
                           train side waits for it                -> on_evaluated(version)
    Note(event)            record this trace event (`rollkeep.core.custody.trace_schema`)
    WakeAt(time)           poll again at `time` even if nothing reports before
    Stop(reason)           the run is over: nothing is in flight, the final cut is written
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from ..checkpoint.cut import Cut as Custody
from ..custody.events import (
    DATA,
    INFRA,
    Reason,  # kept in this namespace: `rollkeep.core.schedule.Reason`
)
from ..custody.trace_schema import RunEvent
from ..rollout.batch import Batch
from ..rollout.generation import Completion, DataError, GenRequest, InfraError

AttemptKey = tuple[str, int, int]  # (group id, generation index, attempt)


# Dispatch, Generated and Failure: msgspec Structs rather than frozen dataclasses, being
# built once per sibling on the scheduler's hot path (~0.2 µs against ~1 µs).
class Dispatch(msgspec.Struct, frozen=True):
    request: GenRequest
    stream: bool = False  # the engine's chunks go to `on_progress` (partial generations are recorded)

    @property
    def key(self) -> AttemptKey:
        r = self.request
        return (r.group_id, r.generation, r.attempt)


@dataclass(frozen=True)
class Cancel:
    attempts: tuple[AttemptKey, ...]


@dataclass(frozen=True)
class Train:
    step: int
    batch: Batch


@dataclass(frozen=True)
class Cut:
    step: int
    final: bool  # the last cut of the run (written before Stop)
    env_wait_s: float = 0.0  # the environment phase: how long the step boundary waited for environment steps
    env_retired: int = 0  # environment steps still running when it ended (not in this cut)
    # the ledger, rows and prefixes as the poll that returned it left them (O(1)); not compared
    custody: Custody | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Refit:
    version: int


@dataclass(frozen=True)
class Evaluate:
    version: int


@dataclass(frozen=True)
class Note:
    event: RunEvent


@dataclass(frozen=True)
class WakeAt:
    time: float


@dataclass(frozen=True)
class Stop:
    reason: Reason


Command = Dispatch | Cancel | Train | Cut | Refit | Evaluate | Note | WakeAt | Stop


class Generated(msgspec.Struct, frozen=True):
    """A finished attempt: the completion and its reward (computed by the runner, which
    owns the reward functions)."""

    completion: Completion
    reward: float
    replica: int = 0  # the engine replica that ran it


class Failure(msgspec.Struct, frozen=True):
    """A failed attempt: `kind` is infra or data (docs/design.md §6)."""

    kind: str
    error: str
    replica: int = 0


Outcome = Generated | Failure


def classify(exc: BaseException) -> Failure | None:
    """The failure an attempt's exception is (docs/design.md §6): DataError a data failure
    (an environment's or a reward's too), InfraError and a lost connection infra failures;
    None for anything else, which is a bug and stops the run, never a silent retry."""
    replica = getattr(exc, "replica", 0)
    if isinstance(exc, DataError):
        return Failure(DATA, str(exc), replica)
    if isinstance(exc, InfraError | ConnectionError):
        return Failure(INFRA, f"{type(exc).__name__}: {exc}", replica)
    return None

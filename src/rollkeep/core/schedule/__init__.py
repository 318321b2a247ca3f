"""The scheduler: a pure, synchronous object that makes every decision of a run
(docs/design.md §2), and the commands it talks in. `rollkeep.Scheduler` is the public entry point."""

from .commands import (
    AttemptKey,
    Cancel,
    Command,
    Cut,
    Dispatch,
    Evaluate,
    Failure,
    Generated,
    Note,
    Outcome,
    Reason,
    Refit,
    Stop,
    Train,
    WakeAt,
    classify,
)
from .retry import RetryPolicy
from .scheduler import TRAIN_TABLE, Phase, Scheduler, Settings, Sinks, crash_point

__all__ = [
    "TRAIN_TABLE",
    "AttemptKey",
    "Cancel",
    "Command",
    "Cut",
    "Dispatch",
    "Evaluate",
    "Failure",
    "Generated",
    "Note",
    "Outcome",
    "Phase",
    "Reason",
    "Refit",
    "RetryPolicy",
    "Scheduler",
    "Settings",
    "Sinks",
    "Stop",
    "Train",
    "WakeAt",
    "classify",
    "crash_point",
]

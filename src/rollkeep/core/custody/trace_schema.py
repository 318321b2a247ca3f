"""The trace's schema: every event `trace.jsonl` carries, its name and its fields, defined
once (docs/design.md §8: a public contract).

Each line is `{"t": <unix s>, "run_id": <12 hex>, "event": <name>, <fields>}`. The ledger's
own events (`rollkeep.core.custody.events`: taken, admitted, dispatched, sealed, ...) are traced as
they are applied; the events below are the run's. Writers build these records
(`Trace.emit(RunStarted(...))`), readers compare `line["event"]` with the names here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .events import (
    ALL_EVENTS,
    Abandoned,
    Admitted,
    Dispatched,
    Dropped,
    EffectDone,
    EffectIntent,
    Evicted,
    Failed,
    Progressed,
    Sealed,
    StepCommitted,
    Taken,
    TurnSealed,
    event_name,
)


class RunEvent(msgspec.Struct, frozen=True, kw_only=True, tag_field="event"):
    """Base of the run's trace events (not ledger transitions)."""


class RunStarted(RunEvent, tag="run_started"):
    resumed_from_step: int | None  # the checkpoint's step; None for a fresh run
    checkpoint: str | None  # the checkpoint's name
    pid: int = 0
    config_fingerprint: str = ""  # sha256 of the semantic config
    cleaned_tmp: list[str] = []  # leftover temp files removed at start-up
    abandoned_checkpoints: dict[str, Any] | None = None  # --resume-from: {"names", "into"}


class Restored(RunEvent, tag="restored"):
    """What a restart reuses, regenerates and re-admits (`restart.restored_fields`)."""

    checkpoint: str | None  # None: a run that never checkpointed, resumed from its journal
    step: int
    cut_time: float | None
    groups_reused: int
    groups_finalize_again: int
    siblings_reused: int
    siblings_regenerated: int
    siblings_pending: int
    groups_readmitted: int
    spare_prompts: int
    groups_lost: int
    recovery_mode: str
    config_changes: list[list[Any]] = []
    siblings_resent: int = 0  # of siblings_regenerated: waiting after an abandoned/failed attempt
    steps_redone: list[int] = []  # [first, last] step trained after the checkpoint, to train again
    journal_events_replayed: int = 0  # the journal's tail after the checkpoint (docs/design.md §5.1)
    journal_dropped: list[list[int]] = []  # [epoch, idx] of the drops that tail kept
    partial_generations: int = 0  # siblings cut off mid-generation that continue from their tokens
    partial_tokens: int = 0  # the tokens they continue from (recovery.partial: resume)
    turns_reused: int = 0  # finished turns of multi-turn episodes they continue after (docs/design.md §5.4)
    # Work the journal's tail generated under lost versions (newer than the checkpoint, whose
    # weights died with the process; docs/design.md §5.1), and what `lost_versions` (keep |
    # regenerate) did with it: with regenerate these siblings are dispatched again too.
    lost_versions: str = "keep"
    lost_version_rows: int = 0
    lost_version_chains: int = 0
    # Calls to the outside (docs/design.md §13): records with an outcome, which answer the
    # resumed attempts' calls instead of calling again, and intents whose outcome died.
    effects_replayed: int = 0
    effects_unknown: int = 0


class CheckpointPublished(RunEvent, tag="checkpoint_published"):
    step: int
    name: str
    cut_time: float  # unix time of the atomic cut
    bytes: int = 0
    cut_hold_seconds: float = 0.0  # custody: ledger capture + row pin
    trainer_snapshot_seconds: float = 0.0  # the trainer's copy, in the same hold
    write_seconds: float = 0.0  # encode + fsync + publish, off the loop
    env_wait_seconds: float = 0.0  # the environment phase before the cut (lease environments)
    env_steps_retired: int = 0  # environment steps it did not wait for (env.cut_timeout_s)
    # trainer.world_size > 1: per rank, the bytes of its shard and the seconds it took to write it
    shard_bytes: list[int] = []
    shard_write_seconds: list[float] = []


class CheckpointSkipped(RunEvent, tag="checkpoint_skipped"):
    step: int
    reason: str


class Eval(RunEvent, tag="eval"):
    step: int
    accuracy: float = msgspec.field(default=0.0, name="eval/accuracy")
    reward_mean: float = msgspec.field(default=0.0, name="eval/reward_mean")


class EngineReplicaStarted(RunEvent, tag="engine_replica_started"):
    """An engine replica (`cluster.backend: ray`) is up, holds the current weights and gets
    work: at start, and after Ray restarted a replica that died."""

    replica: int  # 0 .. engine.replicas - 1
    pid: int
    node: str  # the Ray node it runs on
    restart: int = 0  # how many times it was restarted before (0: its first start)
    down_seconds: float | None = None  # after a restart: from its death until it got work again


class EngineReplicaDied(RunEvent, tag="engine_replica_died"):
    """An engine replica's process died (killed, crashed, its node lost): the attempts it
    ran failed as infra failures and are retried on the others (docs/design.md §10)."""

    replica: int
    reason: str
    attempts_failed: int  # its attempts in flight, failed as infra
    gone: bool = False  # its restarts (cluster.max_restarts) are spent: it does not come back


class ServerFenced(RunEvent, tag="server_fenced"):
    """Server mode (docs/server-mode.md): a server proved it is live and holds the weights
    the run needs before it got work: at every start of the controller, and when it comes
    back. `found` is the weight version label it reported, `set` the one it holds now
    (equal when nothing was reloaded), `aborted` the requests it was still running."""

    server: str  # its URL, as in engine.servers
    found: str
    set: str
    aborted: int
    seconds: float  # from the first probe until it was ready for work


class ServerLost(RunEvent, tag="server_lost"):
    """A server stopped answering (refused, reset, timed out, or a refit failed): its
    attempts failed as infra failures, retried on the others; it is probed until it is
    back and fenced again before it gets work."""

    server: str
    reason: str
    attempts_failed: int = 0


class ServerBack(RunEvent, tag="server_back"):
    """A lost server answered again, was fenced, and gets work."""

    server: str
    down_seconds: float | None = None


class EffectAnswered(RunEvent, tag="effect_answered"):
    """A call to the outside answered from its record (docs/design.md §13): not made again.
    `resent`: an intent whose outcome died with a process, sent again with its key
    (`on_unknown: retry`); the call was made."""

    group_id: str
    generation: int
    attempt: int
    kind: str
    key: str
    resent: bool = False


class LeaseReleased(RunEvent, tag="lease_released"):
    """The lease of an episode whose environment recovers by lease ended (docs/design.md
    §13): `live` by the environment that ran it (the episode sealed or failed as data), else
    on a fresh one resumed from the sibling's last handle (its turns will not be continued);
    `error`, if the release failed (never retried: the server's lease may time out)."""

    group_id: str
    generation: int
    live: bool
    error: str | None = None


class RunFinished(RunEvent, tag="run_finished"):
    step: int
    weights_sha256: str
    reason: str  # finished | data exhausted | signal | no engine replica | user code
    signal: str | None = None  # reason "signal": the signal's name (SIGINT, SIGTERM)
    # journal.enabled: the group commits that wrote, and their p50 / p99 duration in seconds
    journal_flushes: int = 0
    journal_flush_p50_s: float | None = None
    journal_flush_p99_s: float | None = None


class TrainerStarted(RunEvent, tag="trainer_started"):
    """Who trains: one process (`backend` "in-process", the controller's pid) or
    `world_size` ranks (`backend` gloo | nccl, their pids in rank order), each a child
    process of the controller or a Ray actor (`placement` "process" | "ray")."""

    world_size: int
    pids: list[int]
    backend: str
    placement: str = "in-process"


class RunFailed(RunEvent, tag="run_failed"):
    step: int | None
    error: str


RUN_EVENTS: tuple[type[RunEvent], ...] = (
    RunStarted, Restored, CheckpointPublished, CheckpointSkipped, Eval, EngineReplicaStarted, EngineReplicaDied,
    RunFinished, RunFailed, ServerFenced, ServerLost, ServerBack, EffectAnswered,
    LeaseReleased, TrainerStarted,
)


def name(event_type: type[Any]) -> str:
    """The `event` value of a trace event type (run or ledger)."""
    return event_type.__struct_config__.tag  # type: ignore[attr-defined]


(RUN_STARTED, RESTORED, CHECKPOINT_PUBLISHED, CHECKPOINT_SKIPPED, EVAL, ENGINE_REPLICA_STARTED,
 ENGINE_REPLICA_DIED, RUN_FINISHED, RUN_FAILED, SERVER_FENCED, SERVER_LOST, SERVER_BACK,
 EFFECT_ANSWERED, LEASE_RELEASED, TRAINER_STARTED) = (name(t) for t in RUN_EVENTS)
(STEP_COMMITTED, DROPPED, SEALED, DISPATCHED, TAKEN, ADMITTED, FAILED, EVICTED, ABANDONED, PROGRESSED,
 TURN_SEALED, EFFECT_INTENT, EFFECT_DONE) = (
    name(t) for t in (StepCommitted, Dropped, Sealed, Dispatched, Taken, Admitted, Failed, Evicted, Abandoned,
                      Progressed, TurnSealed, EffectIntent, EffectDone)
)

#: The ledger's events (the ones the journal records too), and every event name a trace may hold.
LEDGER_EVENTS: frozenset[str] = frozenset(map(event_name, ALL_EVENTS))
NAMES: frozenset[str] = frozenset(name(t) for t in RUN_EVENTS) | LEDGER_EVENTS

#: Events a resume, an audit or the lineage depend on: written through at once.
FLUSH_NOW: frozenset[str] = frozenset(
    {RUN_STARTED, RESTORED, STEP_COMMITTED, CHECKPOINT_PUBLISHED, DROPPED, RUN_FINISHED}
)

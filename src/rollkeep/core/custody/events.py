"""Ledger events: the only way custody state changes.

Each event is a small frozen record. `Ledger.apply(event)` validates it against the current
state, mutates, and hands it to subscribers (the trace, later the journal). Encoded as JSON
each event is one trace line: `{"event": "sealed", "group_id": "e0.17", ...}`.

Events name groups by `group_id` (`e{epoch}.{ordinal}`), which is the same in every run.
"""

from __future__ import annotations

import enum

import msgspec

# Attempt failure kinds (docs/design.md §6): each has its own per-sibling budget.
INFRA = "infra"
DATA = "data"
FAILURE_KINDS = (INFRA, DATA)


class Reason(enum.StrEnum):
    """Why something ended: a run (`Stop`), or a group's work (`Abandoned`, `Evicted`,
    `Dropped`). The values are the strings the trace has always carried."""

    FINISHED = "finished"  # train.total_steps reached
    DATA_EXHAUSTED = "data exhausted"  # no batch can ever come
    SIGNAL = "signal"  # SIGINT / SIGTERM (a graceful stop)
    NO_ENGINE = "no engine replica"  # every engine replica gone for cluster.replica_timeout_s (a graceful stop)
    USER_CODE = "user code"  # user code raised SystemExit/KeyboardInterrupt or hung too often (a graceful stop)
    RESTART = "restart"  # attempts in flight at the cut, abandoned on restore
    SHUTDOWN = "shutdown"  # attempts in flight when a run stops, abandoned
    STALE = "stale"  # a READY group outside the sampler's window
    LOST = "lost in flight at the cut (recovery.mode=cursor_only)"


# Where a taken prompt came from.
FROM_SOURCE = "source"
FROM_SPARE = "spare"

# Recovery granularity, persisted per group (docs/design.md §1).
SIBLING = "sibling"
PROMPT_GROUP = "prompt_group"
GRANULARITIES = (SIBLING, PROMPT_GROUP)


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="event", gc=False):
    """Base of all ledger events."""


class Configured(Event, tag="configured"):
    """The limits a run holds the ledger to, applied when a run starts (fresh or resumed).

    The ledger keeps the widest `num_prompts_per_step` and `window` ever configured: they
    bound what a checkpoint may claim (invariants I5 and I6), and groups admitted under a
    wider setting stay legal after a resume narrows it. `epochs` may only grow (or become
    unbounded): a resume that extends `data.epochs` hands out more prompts and revisits
    nothing already handed out.
    """

    num_prompts_per_step: int
    window: int  # versions the sampler admits beyond the current one (lookahead or staleness)
    epochs: int | None


class Taken(Event, tag="taken"):
    """SOURCE or SPARE → LEDGER: a prompt is handed out as a RESERVED group."""

    epoch: int
    ordinal: int
    idx: int
    task: str
    row_fingerprint: int
    group_size: int
    granularity: str = SIBLING
    origin: str = FROM_SOURCE


class Spared(Event, tag="spared"):
    """SOURCE → SPARE: the prompt at the cursor is set aside to refill dropped prompts."""

    epoch: int
    ordinal: int


class Admitted(Event, tag="admitted"):
    """RESERVED → ADMITTED: the sampler's admission stamps a target step (or none)."""

    group_id: str
    target_step: int | None
    version: int


class Dispatched(Event, tag="dispatched"):
    """Current attempts RESERVED → DISPATCHED: handed to an engine."""

    group_id: str
    generations: tuple[int, ...]
    version: int


class Progressed(Event, tag="progressed"):
    """The current, DISPATCHED attempt has generated `tokens` completion tokens so far (its
    prefix included); the new ones since its last `progressed` are a chunk in the prefix
    store (docs/design.md §5.3). No custody changes: it makes a partial generation durable."""

    group_id: str
    generation: int
    attempt: int
    tokens: int
    resumed_from: int = 0  # the prefix's tokens the attempt started from in this run


class TurnSealed(Event, tag="turn_sealed"):
    """The current, DISPATCHED attempt finished turn `turn` (0 = the first) of a multi-turn
    episode: its trajectory is now `tokens` tokens long, the environment's response to the
    turn included. The tokens since the sibling's chain ended are a chunk in the prefix store
    that ends a turn (docs/design.md §5.4); `snapshot` is the environment's state after the
    turn, for an environment that recovers by snapshot. No custody changes: it makes a
    finished turn durable, so a restore continues the episode after it."""

    group_id: str
    generation: int
    attempt: int
    turn: int
    tokens: int
    resumed_from: int = 0  # the trajectory's tokens the attempt started from in this run
    snapshot: bytes | None = None


class EffectIntent(Event, tag="effect_intent"):
    """The current, DISPATCHED attempt is about to make call `index` of turn `turn` (the
    reward stage is turn -1) to the outside (docs/design.md §13): of kind `kind`, with the
    idempotency key `key`, for a request whose canonical JSON hashes (xxh3-64) to
    `digest`; `policy` says what a restore does if no outcome follows (`retry` sends `key`
    again, `fail` fails the attempt: `effect_unknown`). It is durable before the call is
    made. No custody changes."""

    group_id: str
    generation: int
    attempt: int
    turn: int
    index: int
    kind: str
    key: str
    digest: int
    policy: str


class EffectDone(Event, tag="effect_done"):
    """The outcome of the call `EffectIntent` announced under `key`: `ok` with `result`
    (its JSON) or not ok with `result` the error's text. Authoritative: a later attempt
    that continues this one's work is answered from it and never calls again."""

    group_id: str
    generation: int
    attempt: int
    key: str
    ok: bool
    result: bytes


class Sealed(Event, tag="sealed"):
    """Current attempt DISPATCHED → SEALED: its row is in the row store."""

    group_id: str
    generation: int
    attempt: int
    version: int
    tokens: int
    resumed_from: int = 0  # tokens of its completion continued from an earlier attempt's prefix
    replica: int = 0  # the engine replica that ran it (docs/design.md §10; 0 on the local backend)


class Failed(Event, tag="failed"):
    """Current attempt DISPATCHED → FAILED(kind); the sibling gets a fresh attempt.

    For a PROMPT_GROUP group, the other siblings' dispatched and sealed attempts are
    abandoned too (the group is all-or-nothing).
    """

    group_id: str
    generation: int
    attempt: int
    kind: str
    error: str = ""
    replica: int = 0  # the engine replica that ran it


# The reason of an `abandoned` that throws away work generated under a lost version: a weight
# version newer than the restored checkpoint, whose weights died with the process that made
# them (`recovery.lost_versions: regenerate`, docs/design.md §5.1).
LOST_VERSION = "lost version"


class Abandoned(Event, tag="abandoned"):
    """Current attempts → ABANDONED(reason); each sibling gets a fresh attempt.

    DISPATCHED attempts of any group; SEALED attempts only of PROMPT_GROUP groups, or of any
    group with reason LOST_VERSION, which also takes a complete group (READY_TO_FINALIZE,
    READY: at a restart, before any claim) back to GENERATING.
    """

    group_id: str
    generations: tuple[int, ...]
    reason: str


class Finalizing(Event, tag="finalizing"):
    """READY_TO_FINALIZE → FINALIZING: reward/advantage computation started."""

    group_id: str


class Ready(Event, tag="ready"):
    """FINALIZING → READY, LEDGER → REPLAY: advantages computed, waiting to train."""

    group_id: str
    advantages: tuple[float, ...]


class Claimed(Event, tag="claimed"):
    """READY → CLAIMED(step): the train pump took these groups for the next step."""

    step: int
    group_ids: tuple[str, ...]


class StepCommitted(Event, tag="step_committed"):
    """CLAIMED(step) → TRAINED: the optimizer update of `step` is applied.

    `prompts` are the `[epoch, idx]` of the trained groups, in `group_ids` order, so the
    trace alone proves exactly-once training. Build it with `Ledger.commit_event(step)`.
    """

    step: int
    weight_version: int  # = step: the version this commit creates
    group_ids: tuple[str, ...]
    prompts: tuple[tuple[int, int], ...]
    tokens: int = 0  # completion tokens trained in the step (a measure: custody ignores it)


class Released(Event, tag="released"):
    """Undo work that has no effect outside the ledger.

    CLAIMED → READY (a train step that did not commit) and FINALIZING → READY_TO_FINALIZE
    (a finalization that did not finish).
    """

    group_id: str


class Evicted(Event, tag="evicted"):
    """REPLAY → LEDGER: a READY group fell out of the staleness window and regenerates.

    It goes back to phase RESERVED with fresh attempts for every sibling.
    """

    group_id: str
    reason: str


class Dropped(Event, tag="dropped"):
    """LEDGER or REPLAY → DROPPED, with the refill of its step in the same transition.

    For a group stamped with a target step, exactly one of `shrink` (the step trains on
    one group fewer) or `replacement` (a prompt from the spare pool or the source is taken
    and admitted to the same step). Unstamped groups have neither: the pump keeps taking.
    `prompt` ([epoch, idx]) and `step` (the target step, or the next step if unstamped)
    are what DROPPED records; build the event with `take.drop_event`.
    """

    group_id: str
    reason: str
    prompt: tuple[int, int]
    step: int
    shrink: bool = False
    replacement: Taken | None = None


ALL_EVENTS: tuple[type[Event], ...] = (
    Configured,
    Taken,
    Spared,
    Admitted,
    Dispatched,
    Progressed,
    TurnSealed,
    EffectIntent,
    EffectDone,
    Sealed,
    Failed,
    Abandoned,
    Finalizing,
    Ready,
    Claimed,
    StepCommitted,
    Released,
    Evicted,
    Dropped,
)


def event_name(event_type: type[Event]) -> str:
    return event_type.__struct_config__.tag  # type: ignore[attr-defined]

"""What the ledger holds: the lifecycle enums, one record per group in LEDGER or REPLAY,
one record per run of committed steps, and the captured state a checkpoint encodes.

These are persisted as they are (msgspec arrays, `rollkeep.core.custody.codec`): changing a field
is a schema change. The ledger (`rollkeep.core.custody.ledger`) is the only thing that mutates
them, through its events.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import msgspec
from pyroaring import BitMap

from .keys import Key, group_id


class GroupState(enum.IntEnum):
    """Lifecycle of a group record. docs/design.md §1's phase and stage, folded into one field.

    phase RESERVED  = RESERVED;  phase ADMITTED = every other state.
    stage GENERATING = RESERVED or GENERATING; the other names are the stage itself.
    """

    RESERVED = 0  # taken, no step assigned, nothing dispatched   (owner LEDGER)
    GENERATING = 1  # admitted, some sibling not sealed            (owner LEDGER)
    READY_TO_FINALIZE = 2  # every sibling sealed                  (owner LEDGER)
    FINALIZING = 3  # reward/advantage computation running         (owner LEDGER)
    READY = 4  # finalized, waiting for a train step               (owner REPLAY)
    CLAIMED = 5  # taken by the open train step                    (owner REPLAY)


class AttemptStatus(enum.IntEnum):
    """Status of one attempt of one sibling. Only a sibling's last attempt is current,
    and a current attempt is RESERVED, DISPATCHED or SEALED: FAILED and ABANDONED are
    terminal and are immediately followed by a fresh RESERVED attempt."""

    RESERVED = 0
    DISPATCHED = 1
    SEALED = 2
    FAILED = 3
    ABANDONED = 4


class Owner(enum.Enum):
    SOURCE = "source"
    SPARE = "spare"
    LEDGER = "ledger"
    REPLAY = "replay"
    TRAINED = "trained"
    DROPPED = "dropped"


#: Largest advantage magnitude a checkpoint may hold (I6). Group-normalised advantages are
#: at most sqrt(G - 1); unnormalised ones are reward differences. Far above either for any
#: real reward scale, and far below where a float32 loss overflows.
MAX_ADVANTAGE = 1e30
#: Longest drop reason (I6); the controller writes a few hundred characters at most.
MAX_REASON = 1000


#: The keys of `Ledger.counts()` (metrics `custody/<key>`, the report's custody plot).
COUNT_KEYS = ("spare", "reserved", "generating", "finalizing", "ready", "claimed", "trained", "dropped")


class GroupRecord(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """One group in LEDGER or REPLAY. Persisted as is (a msgpack array), so a field change
    is a schema change (see `rollkeep.core.custody.codec`).

    Per-sibling state is four compact arrays indexed by generation index rather than an
    object per attempt: statuses of current attempts, current attempt numbers, and infra
    and data failure counts. A sealed sibling's row is `RowId(group_id, gen, attempts[gen])`.

    Treat records returned by the ledger as read-only: the ledger copies on write.
    """

    epoch: int
    ordinal: int
    idx: int
    task: str
    row_fingerprint: int
    granularity: int  # index into events.GRANULARITIES
    state: int  # GroupState
    target_step: int | None  # stamped by admission (in_order); None = unstamped
    start_version: int | None  # weight version at admission
    claim_step: int | None  # set while CLAIMED
    status: bytearray  # AttemptStatus of each sibling's current attempt
    attempts: list[int]  # current attempt number of each sibling (counts from 0)
    infra_failures: bytearray
    data_failures: bytearray
    advantages: list[float] | None  # set by `ready`

    @property
    def key(self) -> Key:
        return Key(self.epoch, self.ordinal)

    @property
    def group_id(self) -> str:
        return group_id((self.epoch, self.ordinal))

    @property
    def group_size(self) -> int:
        return len(self.status)

    @property
    def owner(self) -> Owner:
        return Owner.REPLAY if self.state >= GroupState.READY else Owner.LEDGER

    def sealed_generations(self) -> list[int]:
        return [g for g, s in enumerate(self.status) if s == AttemptStatus.SEALED]

    def generations_with(self, status: AttemptStatus) -> list[int]:
        return [g for g, s in enumerate(self.status) if s == status]


class StepRun(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True, gc=False):
    """Committed steps `first..last`, each of which trained `groups` groups and was short
    `shortfall` groups dropped with `shrink` (I5). Consecutive steps with equal counts
    share one run, so a run of a million full steps is one record. `groups` and
    `shortfall` are None only for steps committed before the ledger kept these records
    (schema 1, read through a migration): their total is whatever TRAINED holds beyond
    the known runs."""

    first: int
    last: int
    groups: int | None
    shortfall: int | None

    @property
    def n_steps(self) -> int:
        return self.last - self.first + 1


def _copy_record(r: GroupRecord) -> GroupRecord:
    return GroupRecord(
        r.epoch,
        r.ordinal,
        r.idx,
        r.task,
        r.row_fingerprint,
        r.granularity,
        r.state,
        r.target_step,
        r.start_version,
        r.claim_step,
        bytearray(r.status),
        list(r.attempts),
        bytearray(r.infra_failures),
        bytearray(r.data_failures),
        None if r.advantages is None else list(r.advantages),
    )


class LedgerState(msgspec.Struct, frozen=True):
    """A consistent view of the whole ledger, as returned by `Ledger.capture()`.

    Containers are shared with the live ledger until it next writes to them (it then
    copies), so nothing here changes after capture. Do not mutate.
    """

    n_rows: int
    seed: int
    epochs: int | None
    cursor: Key
    version: int
    spare: tuple[Key, ...]
    groups: Mapping[str, GroupRecord]
    trained: Mapping[int, BitMap]
    dropped: Mapping[Key, tuple[str, int]]
    shortfall: Mapping[int, int]
    steps: Sequence[StepRun] = ()  # committed steps 1..version (I5)
    max_prompts_per_step: int | None = None  # widest ever configured; None = not yet
    max_window: int | None = None
    # The newest weight version this ledger has reached. A restore that replays the journal
    # past its checkpoint and then takes back the steps whose trainer state is gone (`replay`)
    # lowers `version` but not this: the bounds of I6 on what those steps left (start
    # versions, stamps, drops) are honest against the version they were recorded at.
    max_version: int = 0



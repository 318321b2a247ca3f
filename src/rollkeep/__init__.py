"""rollkeep: exactly-once prompt custody and kill-anywhere resume for asynchronous RL.

The public API of the custody core and its scheduler, usable from any RL loop
(`rollkeep.Scheduler` makes every decision; `rollkeep.commands` are what it asks for). Importing it never
imports torch or the controller (`rollkeep.controller`, `rollkeep.engines`,
`rollkeep.trainers` are the torch layer).
"""

from .core.checkpoint.cut import Cut, cut, write_checkpoint
from .core.checkpoint.store import CheckpointStore
from .core.custody.audit import AuditReport, audit
from .core.custody.codec import decode as decode_ledger
from .core.custody.codec import encode as encode_ledger
from .core.custody.events import (
    Abandoned,
    Admitted,
    Claimed,
    Configured,
    Dispatched,
    Dropped,
    Event,
    Evicted,
    Failed,
    Finalizing,
    Ready,
    Released,
    Sealed,
    Spared,
    StepCommitted,
    Taken,
)
from .core.custody.keys import Key, group_id
from .core.custody.ledger import AttemptStatus, GroupState, Ledger, LedgerState, Owner
from .core.errors import (
    CheckpointError,
    ConfigError,
    CustodyError,
    DatasetError,
    ExternalError,
    IllegalTransition,
    RollkeepError,
    UserInputError,
)
from .core.restore.chain import Restored, restore_chain
from .core.rollout.batch import Batch, TrainGroup
from .core.rollout.datasets import SequenceDataset, load_dataset
from .core.rollout.generation import Completion, DataError, GenRequest, InfraError
from .core.rollout.rows import Row, RowId
from .core.rollout.rowstore import RowStore
from .core.rollout.samplers import Limits, check_limits, make_sampler
from .core.rollout.source import PromptSource
from .core.rollout.take import drop_event, spare_event, take_event
from .core.schedule import Failure, Generated, Reason, RetryPolicy, Scheduler, Settings, commands

__all__ = [
    "Abandoned",
    "Admitted",
    "AttemptStatus",
    "AuditReport",
    "Batch",
    "CheckpointError",
    "CheckpointStore",
    "Claimed",
    "Completion",
    "ConfigError",
    "Configured",
    "CustodyError",
    "Cut",
    "DataError",
    "DatasetError",
    "Dispatched",
    "Dropped",
    "Event",
    "Evicted",
    "ExternalError",
    "Failed",
    "Failure",
    "Finalizing",
    "GenRequest",
    "Generated",
    "GroupState",
    "IllegalTransition",
    "InfraError",
    "Key",
    "Ledger",
    "LedgerState",
    "Limits",
    "Owner",
    "PromptSource",
    "Ready",
    "Reason",
    "Released",
    "Restored",
    "RetryPolicy",
    "RollkeepError",
    "Row",
    "RowId",
    "RowStore",
    "Scheduler",
    "Sealed",
    "SequenceDataset",
    "Settings",
    "Spared",
    "StepCommitted",
    "Taken",
    "TrainGroup",
    "UserInputError",
    "audit",
    "check_limits",
    "commands",
    "cut",
    "decode_ledger",
    "drop_event",
    "encode_ledger",
    "group_id",
    "load_dataset",
    "make_sampler",
    "restore_chain",
    "spare_event",
    "take_event",
    "write_checkpoint",
]

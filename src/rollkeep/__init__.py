"""rollkeep: exactly-once prompt custody and kill-anywhere resume for asynchronous RL.

The public API of the custody core, usable from any async RL loop. Importing it never
imports torch or the controller (`rollkeep.controller`, `rollkeep.engines`,
`rollkeep.trainers` are the torch layer).
"""

from .core.audit import AuditReport, audit
from .core.checkpoint import Cut, cut, write_checkpoint
from .core.codec import decode as decode_ledger
from .core.codec import encode as encode_ledger
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
from .core.events import (
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
from .core.handout import drop_event, spare_event, take_event
from .core.keys import Key, group_id
from .core.ledger import AttemptStatus, GroupState, Ledger, LedgerState, Owner
from .core.restore import Restored, restore_chain
from .core.rows import Row, RowId, RowStore
from .core.samplers import Limits, check_limits, make_sampler
from .core.source import PromptSource, SequenceDataset, load_dataset
from .core.store import CheckpointStore

__all__ = [
    "Abandoned",
    "Admitted",
    "AttemptStatus",
    "AuditReport",
    "CheckpointError",
    "CheckpointStore",
    "Claimed",
    "Configured",
    "ConfigError",
    "CustodyError",
    "Cut",
    "DatasetError",
    "Dispatched",
    "Dropped",
    "Event",
    "Evicted",
    "ExternalError",
    "Failed",
    "Finalizing",
    "GroupState",
    "IllegalTransition",
    "Key",
    "Ledger",
    "LedgerState",
    "Limits",
    "Owner",
    "PromptSource",
    "Ready",
    "Released",
    "Restored",
    "RollkeepError",
    "Row",
    "RowId",
    "RowStore",
    "Sealed",
    "SequenceDataset",
    "Spared",
    "StepCommitted",
    "Taken",
    "UserInputError",
    "audit",
    "check_limits",
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

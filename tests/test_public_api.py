"""The public API is small and pinned (trio's habit): adding or removing a name is a
deliberate change to this list. The core never imports torch or the controller."""

import subprocess
import sys

import rollkeep

PUBLIC = {
    "Abandoned", "Admitted", "AttemptStatus", "AuditReport", "CheckpointError", "CheckpointStore",
    "Claimed", "ConfigError", "Configured", "CustodyError", "Cut", "DatasetError", "Dispatched", "Dropped",
    "Event", "Evicted", "ExternalError", "Failed", "Finalizing", "GroupState",
    "IllegalTransition", "Key", "Ledger", "LedgerState", "Limits", "Owner", "PromptSource",
    "Ready", "Released", "Restored", "RollkeepError", "Row", "RowId", "RowStore", "Sealed",
    "SequenceDataset", "Spared", "StepCommitted", "Taken", "UserInputError", "audit",
    "check_limits", "cut", "decode_ledger", "drop_event", "encode_ledger", "group_id",
    "load_dataset", "make_sampler", "restore_chain", "spare_event", "take_event",
    "write_checkpoint", "Batch", "TrainGroup", "Failure", "Generated", "Reason", "RetryPolicy",
    "Scheduler", "Settings", "commands", "Completion", "DataError", "GenRequest", "InfraError",
}


def test_public_api_is_pinned() -> None:
    assert set(rollkeep.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(rollkeep, name) is not None


def test_core_imports_no_torch_and_no_controller() -> None:
    code = (
        "import sys, rollkeep, rollkeep.core.restore.chain, rollkeep.core.rollout.take;"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith("
        "('rollkeep.controller', 'rollkeep.engines', 'rollkeep.trainers'))];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr

"""The atomic cut and what a checkpoint holds (DESIGN §3, §4).

`cut()` runs synchronously on the loop thread between two transitions: it captures the
ledger (O(1), copy-on-write) and pins the row store (O(1)), and measures how long it held
the loop. Everything slow — auditing, encoding, writing, fsyncing — happens afterwards in
`write_checkpoint`, which may run on a background thread while the pumps keep going.

Files of a checkpoint directory:

    ledger.msgpack      custody state (codec.py)
    rows.safetensors    rows of REPLAY groups and of sealed siblings of LEDGER groups
    trainer/...         opaque to the core: the trainer's own files
    MANIFEST.json       written last by the store, with the meta below
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import codec
from .audit import audit
from .errors import AuditFailure
from .ledger import AttemptStatus, Ledger, LedgerState
from .rows import RowId, RowPin, RowStore, encode_rows
from .store import CheckpointStore, Published

LEDGER_FILE = "ledger.msgpack"
ROWS_FILE = "rows.safetensors"
TRAINER_DIR = "trainer"
SUPPORTED_SCHEMAS = {"ledger": set(codec.SUPPORTED_LEDGER_SCHEMAS), "rows": {1}}


@dataclass(frozen=True)
class Cut:
    """One consistent capture of custody state, with the rows it references pinned."""

    ledger: LedgerState
    rows: RowPin
    time: float  # unix time of the cut (the trace measures thrown-away work against it)
    hold_seconds: float  # how long the loop was held


def cut(ledger: Ledger, rows: RowStore) -> Cut:
    """The atomic cut. Synchronous; call on the loop thread with no await in between."""
    t0 = time.perf_counter()
    state = ledger.capture()
    pin = rows.pin()
    hold = time.perf_counter() - t0
    return Cut(ledger=state, rows=pin, time=time.time(), hold_seconds=hold)


def referenced_rows(state: LedgerState) -> list[RowId]:
    """Rows a restore needs: every sealed current attempt, in key order."""
    out = []
    for gid, rec in sorted(state.groups.items(), key=lambda kv: kv[1].key):
        for g, s in enumerate(rec.status):
            if s == AttemptStatus.SEALED:
                out.append(RowId(gid, g, rec.attempts[g]))
    return out


def checkpoint_files(c: Cut, trainer_files: Mapping[str, bytes]) -> dict[str, bytes]:
    """Encode a cut. Refuses (AuditFailure) to write a ledger that fails its audit."""
    report = audit(c.ledger)
    report.raise_if_failed(AuditFailure, remedy="this is a bug; the checkpoint was not written")
    ids = referenced_rows(c.ledger)
    files = {
        LEDGER_FILE: codec.encode(c.ledger),
        ROWS_FILE: encode_rows((rid, c.rows.get(rid)) for rid in ids),
    }
    for name, blob in trainer_files.items():
        files[f"{TRAINER_DIR}/{name}"] = blob
    return files


def write_checkpoint(
    store: CheckpointStore,
    c: Cut,
    *,
    trainer_files: Mapping[str, bytes],
    meta: Mapping[str, Any],
    keep_last: int | None,
) -> Published:
    """Encode and publish a cut; always releases the cut's row pin."""
    try:
        files = checkpoint_files(c, trainer_files)
    finally:
        c.rows.release()
    full_meta = {
        "weight_version": c.ledger.version,
        "cut_time": c.time,
        "cut_hold_seconds": c.hold_seconds,
        "schemas": {"ledger": codec.LEDGER_SCHEMA, "rows": 1},
        **meta,
    }
    return store.publish(c.ledger.version, files, full_meta, keep_last=keep_last)

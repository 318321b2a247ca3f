"""Ledger encoding: one msgpack document, versioned, decoded strictly.

The encoding is canonical (groups sorted by key, maps sorted), so two equal ledgers
encode to equal bytes; tests compare states that way.

Decoding is restore step 4 (docs/design.md §5): it rejects unknown fields, wrong types,
per-sibling arrays of different lengths, duplicate keys and impossible state
combinations, each as a `LedgerDecodeError` naming the field. A schema version this
code does not know is a `SchemaUnsupported`. Older versions are read through the explicit
migrations in `MIGRATIONS`.

Changing `LedgerWire` or `GroupRecord` changes the schema: bump `LEDGER_SCHEMA`, add a
migration, and update the lock in `tests/test_codec.py` (which fails otherwise).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

import msgspec
from pyroaring import BitMap

from ..errors import LedgerDecodeError, SchemaUnsupported
from .audit import check_records
from .keys import Key, group_id
from .ledger import GroupRecord, LedgerState, StepRun

LEDGER_SCHEMA = 3
SUPPORTED_LEDGER_SCHEMAS = frozenset({1, 2, 3})


def _from_schema_1(doc: dict) -> dict:
    """Schema 1 → 2: schema 2 records what each committed step trained (invariant I5) and
    the widest limits configured (I6). A schema-1 ledger knew neither: its steps become
    one run with unknown counts (their total is whatever TRAINED holds), and the limits
    are recorded by the `configured` event of the run that resumes it."""
    version = doc.get("version")
    steps = [[1, version, None, None]] if isinstance(version, int) and version >= 1 else []
    return {**doc, "schema": 2, "steps": steps, "max_prompts_per_step": None, "max_window": None}


def _from_schema_2(doc: dict) -> dict:
    """Schema 2 → 3: schema 3 records the newest version the ledger reached
    (`max_version`); a schema-2 ledger never went back, so it is its version."""
    return {**doc, "schema": 3, "max_version": doc.get("version")}


#: schema version → function upgrading a decoded msgpack document by one version.
MIGRATIONS: dict[int, Callable[[dict], dict]] = {1: _from_schema_1, 2: _from_schema_2}


class DroppedEntry(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    epoch: int
    ordinal: int
    reason: str
    step: int


class LedgerWire(msgspec.Struct, forbid_unknown_fields=True):
    schema: int
    n_rows: int
    seed: int
    epochs: int | None
    cursor: tuple[int, int]
    version: int
    spare: list[tuple[int, int]]
    groups: list[GroupRecord]
    trained: dict[int, bytes]  # epoch → portable roaring bitmap of trained ordinals
    dropped: list[DroppedEntry]
    shortfall: dict[int, int]
    steps: list[StepRun]  # committed steps 1..version, as runs of equal counts
    max_prompts_per_step: int | None
    max_window: int | None
    max_version: int  # the newest version reached (LedgerState.max_version)


class _Header(msgspec.Struct):
    schema: int


_encoder = msgspec.msgpack.Encoder()


def _canonical(bm: BitMap) -> bytes:
    """The bitmap's serialization as a function of its members alone: a roaring bitmap's
    bytes also depend on how it was built (a copy may hold run containers where the
    original holds arrays), and the same ledger must encode to the same bytes (found by the
    replay property test). Rebuilt from its sorted members, then run-optimised."""
    c = BitMap(bm.to_array())
    c.run_optimize()
    return c.serialize()


def encode(state: LedgerState, *, ordered: list[GroupRecord] | None = None) -> bytes:
    """Canonical msgpack bytes of a captured ledger state. Safe off the loop thread.
    `ordered`: the state's records sorted by key, when the caller has them
    (`GroupColumns.records`)."""
    groups = sorted(state.groups.values(), key=lambda r: (r.epoch, r.ordinal)) if ordered is None else ordered
    wire = LedgerWire(
        schema=LEDGER_SCHEMA,
        n_rows=state.n_rows,
        seed=state.seed,
        epochs=state.epochs,
        cursor=tuple(state.cursor),
        version=state.version,
        spare=[tuple(k) for k in state.spare],
        groups=groups,
        trained={e: _canonical(state.trained[e]) for e in sorted(state.trained)},
        dropped=[DroppedEntry(k[0], k[1], r, s) for k, (r, s) in sorted(state.dropped.items())],
        shortfall={s: state.shortfall[s] for s in sorted(state.shortfall)},
        steps=list(state.steps),
        max_prompts_per_step=state.max_prompts_per_step,
        max_window=state.max_window,
        max_version=max(state.max_version, state.version),
    )
    return _encoder.encode(wire)


def schema_fingerprint() -> str:
    """sha256 of the persisted types' JSON schema without their docstrings (a doc edit is
    not a schema change); pinned by a test per schema version."""

    def shape(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: shape(v) for k, v in x.items() if k != "description"}
        return [shape(v) for v in x] if isinstance(x, list) else x

    schema = shape(msgspec.json.schema(LedgerWire))
    return hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).hexdigest()


_PATH_RE = re.compile(r"at `(\$[^`]*)`")


def decode(data: bytes, *, path: str = "ledger.msgpack") -> LedgerState:
    """Strictly decode a ledger file into a `LedgerState` (restore steps 3 and 4)."""
    try:
        return _decode(data, path)
    except RecursionError:  # msgspec recurses per nesting level; a hostile file nests deep
        raise LedgerDecodeError(
            "the ledger file is nested too deeply to be a rollkeep ledger",
            path=path,
            expected=f"ledger schema {LEDGER_SCHEMA} (a few levels of nesting)",
            found="nesting deeper than the decoder's recursion limit",
            remedy="restore from another checkpoint; this one is damaged or was edited",
        ) from None


def _decode(data: bytes, path: str) -> LedgerState:
    try:
        header = msgspec.msgpack.decode(data, type=_Header)
    except msgspec.DecodeError as e:
        raise LedgerDecodeError(
            "the ledger file is not a msgpack map with a 'schema' field",
            path=path,
            field="schema",
            expected="a rollkeep ledger",
            found=str(e),
            remedy="restore from another checkpoint; this file is not a rollkeep ledger or is damaged",
        ) from None
    if header.schema not in SUPPORTED_LEDGER_SCHEMAS:
        newer = header.schema > LEDGER_SCHEMA
        raise SchemaUnsupported(
            f"ledger schema {header.schema} is not supported",
            path=path,
            field="schema",
            expected=f"one of {sorted(SUPPORTED_LEDGER_SCHEMAS)}",
            found=str(header.schema),
            remedy="upgrade rollkeep to read it" if newer else "no migration exists for this schema",
        )
    try:
        if header.schema != LEDGER_SCHEMA:
            raw = msgspec.msgpack.decode(data)
            if not isinstance(raw, dict):
                raise msgspec.ValidationError("Expected `object`, got another type - at `$`")
            for v in range(header.schema, LEDGER_SCHEMA):
                raw = MIGRATIONS[v](raw)
            data = _encoder.encode(raw)
        wire = msgspec.msgpack.decode(data, type=LedgerWire)
    except msgspec.ValidationError as e:
        m = _PATH_RE.search(str(e))
        raise LedgerDecodeError(
            "the ledger file does not match the ledger schema",
            path=path,
            field=m.group(1) if m else None,
            expected=f"ledger schema {LEDGER_SCHEMA}",
            found=str(e),
            remedy="restore from another checkpoint; this one is damaged or was edited",
        ) from None
    except msgspec.DecodeError as e:
        raise LedgerDecodeError(
            "the ledger file is not valid msgpack",
            path=path,
            found=str(e),
            remedy="restore from another checkpoint; this one is damaged",
        ) from None
    return _to_state(wire, path)


def _fail(path: str, field: str, what: str, found: str) -> LedgerDecodeError:
    return LedgerDecodeError(
        what,
        path=path,
        field=field,
        found=found,
        remedy="restore from another checkpoint; this one is damaged or was edited",
    )


def _to_state(w: LedgerWire, path: str) -> LedgerState:
    groups: dict[str, GroupRecord] = {}
    for i, r in enumerate(w.groups):
        gid = group_id((r.epoch, r.ordinal))
        if gid in groups:
            raise _fail(path, f"$.groups[{i}]", f"group {gid} appears twice", "a duplicate key")
        groups[gid] = r
    trained: dict[int, BitMap] = {}
    for e, blob in w.trained.items():
        try:
            trained[e] = BitMap.deserialize(blob)
        except Exception as ex:  # pyroaring raises ValueError or OverflowError
            raise _fail(path, f"$.trained[{e}]", "a trained set is not a roaring bitmap", str(ex)) from None
    dropped: dict[Key, tuple[str, int]] = {}
    for i, d in enumerate(w.dropped):
        key = Key(d.epoch, d.ordinal)
        if key in dropped:
            raise _fail(path, f"$.dropped[{i}]", f"dropped key {tuple(key)} appears twice", "a duplicate key")
        dropped[key] = (d.reason, d.step)
    if len(set(w.spare)) != len(w.spare):
        raise _fail(path, "$.spare", "the spare pool lists a key twice", str(w.spare))
    state = LedgerState(
        n_rows=w.n_rows,
        seed=w.seed,
        epochs=w.epochs,
        cursor=Key(*w.cursor),
        version=w.version,
        spare=tuple(Key(*k) for k in w.spare),
        groups=groups,
        trained=trained,
        dropped=dropped,
        shortfall=dict(w.shortfall),
        steps=tuple(w.steps),
        max_prompts_per_step=w.max_prompts_per_step,
        max_window=w.max_window,
        max_version=w.max_version,
    )
    if w.n_rows < 1:
        raise _fail(path, "$.n_rows", "the dataset size must be at least 1", str(w.n_rows))
    bad = check_records(state)
    if bad:
        raise LedgerDecodeError(
            f"the ledger holds {len(bad)} impossible record(s): " + "; ".join(bad[:5]),
            path=path,
            field="$.groups",
            expected="records whose state agrees with their siblings and the version",
            found=f"{len(bad)} inconsistent record(s)",
            remedy="restore from another checkpoint; this one is damaged or was edited",
        )
    return state

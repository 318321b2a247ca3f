"""The atomic cut and what a checkpoint holds (docs/design.md §3, §4).

`cut()` runs synchronously on the loop thread between two transitions: it captures the
ledger (O(1), copy-on-write) and pins the row store (O(1)), and measures how long it held
the loop. Everything slow — auditing, encoding, writing, fsyncing — happens afterwards in
`write_checkpoint`, which may run on a background thread while the pumps keep going.

Files of a checkpoint directory:

    ledger.msgpack      custody state (codec.py)
    rows.index          the rows it references that are in the row log, by location (rowindex.py)
    rows.safetensors    the rows it references that are not (a copy)
    effects.msgpack     the records of calls to the outside (`rollout.effects`), when there are any
    trainer/...         the trainer's own files, written by its snapshot's `save(dir)` into
                        the directory the store gives it (any depth); the core hashes them
                        and reads only their step binding
    MANIFEST.json       written last by the store, with the meta below

The parts are bound to one step (restore step 5): the manifest's `weight_version` and
`trainer_step` equal the ledger's version, and so does the `rollkeep_step` every trainer
file declares (a top-level key of a JSON file, an entry of a safetensors file's
`__metadata__`). A trainer file copied in from another checkpoint is refused even when the
manifest's hashes were recomputed to match it. Files in other formats (a
torch.distributed.checkpoint shard) are opaque to the core: a trainer writing them also
writes a JSON file declaring the step, and checks in its `load` that the rest belong to it.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, is_not, not_
from pathlib import Path
from typing import Any

import numpy as np

from ..custody import codec
from ..custody.audit import audit
from ..custody.columns import GroupColumns
from ..custody.ledger import AttemptStatus, Ledger, LedgerState
from ..errors import AuditFailure, CheckpointError
from ..io.fs import DEFAULT_FS, FS
from ..io.untrusted import (
    SAFETENSORS_MAX_HEADER,
    loads_json,
    read_prefix,
    read_regular,
    safetensors_header,
)
from ..rollout.effects import EFFECTS_FILE, EffectRecord, EffectStore, encode_effects
from ..rollout.located import Gathered
from ..rollout.prefixes import Link, PrefixStore, finished_turns
from ..rollout.rows import RowId, row_id_of
from ..rollout.rowstore import RowPin, RowStore
from .manifest import OpenedCheckpoint
from .meta import RunMeta, to_manifest
from .rowcodec import encode_rows
from .rowindex import ROWS_INDEX, RowColumns, encode_index
from .store import CheckpointStore, Published

LEDGER_FILE = "ledger.msgpack"
ROWS_FILE = "rows.safetensors"
TRAINER_DIR = "trainer"
#: 1: every row copied into rows.safetensors; 2: rows with a place in the row log named in
#: rows.index instead (`rowindex`), the others copied.
ROWS_SCHEMA = 2
SUPPORTED_SCHEMAS = {"ledger": set(codec.SUPPORTED_LEDGER_SCHEMAS), "rows": {1, 2}}
#: The key by which a trainer file declares the step (= weight version) its state is of.
STEP_KEY = "rollkeep_step"


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a restore or a checkpoint builds O(groups + rows)
    small objects: the collector would walk the growing containers again and again (a third
    of a restore's time at 10 k groups). Nothing they build is cyclic garbage. The switch is
    process-wide; overlapping pauses (the writer's thread and the loop's) leave it as found."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def step_metadata(step: int) -> dict[str, str]:
    """The safetensors `__metadata__` entry binding a trainer file to `step`."""
    return {STEP_KEY: str(step)}


def _parse_step(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(f"{STEP_KEY} is {value!r}, not a step number")


def declared_step(name: str, data: bytes | memoryview) -> int | None:
    """The step a trainer file (its bytes) declares, or None if it declares none: JSON
    files carry `rollkeep_step` at the top level, safetensors files in `__metadata__`;
    other files are opaque. ValueError if the file is malformed or the value is not a
    step number."""
    if name.endswith(".safetensors"):
        meta = safetensors_header(data).get("__metadata__") or {}
        return _parse_step(meta.get(STEP_KEY) if isinstance(meta, dict) else None)
    if name.endswith(".json"):
        doc = loads_json(data)
        return _parse_step(doc.get(STEP_KEY) if isinstance(doc, dict) else None)
    return None


def declared_step_of(path: Path) -> int | None:
    """`declared_step` of a trainer file on disk, reading only a safetensors file's header
    (for a trainer's `load`, which may face gigabytes of weights)."""
    return _declared_step(path.name, lambda n: read_prefix(path, n), lambda: path.stat().st_size,
                          lambda: read_regular(path))


def _declared_step(name: str, prefix: Callable[[int], bytes], size: Callable[[], int],
                   whole: Callable[[], bytes]) -> int | None:
    """`declared_step`, reading a safetensors file's header only (`prefix(n)`: its first n
    bytes) and a JSON file whole."""
    if name.endswith(".safetensors"):
        head = prefix(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        head = prefix(8 + min(max(n, 0), SAFETENSORS_MAX_HEADER))
        meta = safetensors_header(head, size()).get("__metadata__") or {}
        return _parse_step(meta.get(STEP_KEY) if isinstance(meta, dict) else None)
    if name.endswith(".json"):
        return declared_step(name, whole())
    return None


def save_files(files: Mapping[str, bytes], fs: FS = DEFAULT_FS) -> Callable[[Path], None]:
    """A `trainer_save` that writes `files` (relative path -> bytes) into the directory it
    is given, through `fs`: for state that is a few bytes (the toy trainer's), and for the
    simulated disk, which only its `fs` can write."""

    def save(dir: Path) -> None:
        for rel, data in files.items():
            for d in list(reversed(Path(rel).parents))[1:]:
                fs.makedirs(dir / d)
            fs.write(dir / rel, data)

    return save


def declared_step_in(ck: OpenedCheckpoint, rel: str) -> int | None:
    """`declared_step` of a listed file of an opened checkpoint, reading only a
    safetensors file's header (the weights were hashed by `open` already)."""
    return _declared_step(rel, lambda n: ck.read_prefix(rel, n), lambda: ck.size(rel), lambda: ck.read(rel))


@dataclass(frozen=True)
class Cut:
    """One consistent capture of custody state, with the rows it references pinned."""

    ledger: LedgerState
    rows: RowPin
    time: float  # unix time of the cut (the trace measures thrown-away work against it)
    hold_seconds: float  # how long the loop was held
    prefixes: Mapping[tuple[str, int], tuple[Link, ...]] = field(default_factory=dict)  # partial generations
    effects: Mapping[tuple[str, int], tuple[EffectRecord, ...]] = field(default_factory=dict)  # calls outside


def cut(ledger: Ledger, rows: RowStore, *, now: float | None = None, prefixes: PrefixStore | None = None,
        effects: EffectStore | None = None) -> Cut:
    """The atomic cut. Synchronous; call on the loop thread with no await in between.
    `now` is the unix time to record (a simulated clock passes its own)."""
    t0 = time.perf_counter()
    state = ledger.capture()
    pin = rows.pin()
    chains = {} if prefixes is None else prefixes.capture()
    records = {} if effects is None else effects.capture()
    hold = time.perf_counter() - t0
    return Cut(ledger=state, rows=pin, time=time.time() if now is None else now, hold_seconds=hold,
               prefixes=chains, effects=records)


@dataclass(frozen=True)
class SealedColumns:
    """The sealed current attempts of some groups as columns, built with a few C-level
    passes over the records (no object per sibling): at 100 k groups a restore compares,
    and a checkpoint lists, 800 k rows in tens of ms. Row i is
    `RowId(group_ids[group[i]], generation[i], attempt[i])`; `flat_status` and
    `flat_attempts` hold every sibling of group j at `starts[j]:starts[j] + sizes[j]`."""

    group_ids: list[str]
    starts: np.ndarray  # int64, per group
    sizes: np.ndarray  # int64, per group
    flat_status: np.ndarray  # uint8, per sibling
    flat_attempts: np.ndarray  # int64, per sibling
    group: np.ndarray  # int64, per sealed row: its group's position
    generation: np.ndarray  # int64, per sealed row
    attempt: np.ndarray  # int64, per sealed row

    def runs(self, group: np.ndarray | None = None) -> tuple[list[str], np.ndarray]:
        """The groups that have rows among `group` (rows' group positions: all rows when
        None), in order, and how many rows each has: `rows.index`'s runs."""
        counts = np.bincount(self.group if group is None else group, minlength=len(self.group_ids))
        named = np.flatnonzero(counts)
        return list(map(self.group_ids.__getitem__, named.tolist())), counts[named]

    def row_keys(self) -> list[tuple[str, int, int]]:
        """The rows' ids as plain tuples, which look rows up as the RowIds they equal (built
        by `zip` in C)."""
        gids = list(map(self.group_ids.__getitem__, self.group.tolist()))
        return list(zip(gids, self.generation.tolist(), self.attempt.tolist(), strict=True))

    def row_ids(self) -> list[RowId]:
        # `row_id_of`: in C, where a NamedTuple's own __new__ is Python.
        return list(map(row_id_of, self.row_keys()))


def sealed_columns(groups: GroupColumns) -> SealedColumns:
    """`SealedColumns` of `groups`, rows in the groups' (key) order and then by generation."""
    sizes, starts, flat_status = groups.sizes, groups.starts, groups.status
    pos = np.flatnonzero(flat_status == AttemptStatus.SEALED)
    group = np.repeat(np.arange(len(groups), dtype=np.int64), sizes)[pos]
    flat_attempts = groups.attempts
    return SealedColumns(groups.ids, starts, sizes, flat_status, flat_attempts, group, pos - starts[group],
                         flat_attempts[pos])


def referenced_columns(state: LedgerState) -> SealedColumns:
    """Rows a restore needs: every sealed current attempt, groups in key order."""
    return sealed_columns(GroupColumns(state.groups))


def referenced_rows(state: LedgerState) -> list[RowId]:
    """Rows a restore needs: every sealed current attempt, in key order."""
    return referenced_columns(state).row_ids()


def referenced_set(state: LedgerState) -> set[RowId]:
    """`referenced_rows` as a set."""
    return set(referenced_columns(state).row_ids())


def _placed(pin: RowPin, sealed: SealedColumns, got: Gathered) -> tuple[RowColumns, list[RowId]]:
    """The sealed rows that have a place in the row log, with it, and the rows that have
    none (to copy: the journal off, or restored copies). `got`: the places the row store's
    columns hold (`RowPin.gather`); the others (a store below `COLUMNS_FROM`, rows a
    journal's tail sealed before a restart, a displaced attempt) are looked up one by one."""
    places = {"segment": got.segment, "offset": got.offset, "length": got.length, "checksum": got.checksum}
    keep, copied = got.found, []
    miss = np.flatnonzero(~keep)
    if len(miss):
        keys = list(zip(map(sealed.group_ids.__getitem__, sealed.group[miss].tolist()),
                        sealed.generation[miss].tolist(), sealed.attempt[miss].tolist(), strict=True))
        # In C passes over the rows (a store below `COLUMNS_FROM` looks every row up here).
        locs = list(map(pin.locations, keys))
        placed = list(map(is_not, locs, repeat(None)))
        held = list(compress(locs, placed))
        if len(held) < len(locs):
            copied = list(map(row_id_of, compress(keys, map(not_, placed))))
        at = miss[np.array(placed, bool)]
        for name, col in places.items():
            col[at] = np.fromiter(map(attrgetter(name), held), col.dtype, len(held))
        keep[at] = True
    group, gens, atts = sealed.group, sealed.generation, sealed.attempt
    if copied:
        group, gens, atts = group[keep], gens[keep], atts[keep]
        places = {name: col[keep] for name, col in places.items()}
    return RowColumns(*sealed.runs(group), gens, atts, np.zeros(len(gens), np.int32), **places), copied


def stopwatch(into: dict[str, float] | None) -> Callable[[str], None]:
    """`lap(name)` adds the seconds since the previous lap (or since this call) to
    `into[name]`; with `into` None it does nothing (the bench's phase breakdown)."""
    if into is None:
        return lambda name: None
    last = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        into[name] = into.get(name, 0.0) + now - last
        last = now

    return lap


def checkpoint_files(c: Cut, *, phases: dict[str, float] | None = None) -> tuple[dict[str, bytes], dict[str, Any]]:
    """Encode a cut: its files (the trainer's are written by its `save`), and the
    manifest's `rows` entry. A row with a place in the
    row log is named by it in `rows.index` (no row byte is rewritten); one without is copied
    into `rows.safetensors`. Refuses (AuditFailure) to write a ledger that fails its audit.
    `phases`: seconds per phase are added to it (`stopwatch`)."""
    lap = stopwatch(phases)
    report = audit(c.ledger)
    report.raise_if_failed(AuditFailure, remedy="this is a bug; the checkpoint was not written")
    lap("audit")
    groups = GroupColumns(c.ledger.groups)  # sorted once: the row listing and the codec read it
    sealed = sealed_columns(groups)
    lap("key_order")
    got = c.rows.gather(sealed.group_ids, sealed.group, sealed.generation, sealed.attempt)
    lap("locations")
    by_ref, copied = _placed(c.rows, sealed, got)
    lap("index_columns")
    # Partial generations whose every chunk is in the row log (with the journal: all).
    chains = {sib: chain for sib, chain in c.prefixes.items() if all(ch.at is not None for ch in chain)}
    files = {LEDGER_FILE: codec.encode(c.ledger, ordered=groups.records)}
    lap("encode_ledger")
    files[ROWS_FILE] = encode_rows((rid, c.rows.get(rid)) for rid in copied)
    files[ROWS_INDEX] = encode_index(by_ref, chains)
    if c.effects:
        files[EFFECTS_FILE] = encode_effects(c.effects)
    segs = by_ref.extents([ch.at for chain in chains.values() for ch in chain])
    rows = {"by_reference": len(by_ref), "copied": len(copied), "segments": segs,
            "partial": len(chains), "partial_tokens": sum(chain[-1].end for chain in chains.values()),
            "turns": finished_turns(chains)}
    lap("encode_rows")
    return files, rows


def write_checkpoint(
    store: CheckpointStore,
    c: Cut,
    *,
    trainer_save: Callable[[Path], None],
    meta: RunMeta | Mapping[str, Any],
    keep_last: int | None,
    trainer_step: int | None = None,
    phases: dict[str, float] | None = None,
) -> Published:
    """Encode and publish a cut; always releases the cut's row pin. `trainer_save(dir)`
    (a snapshot's `save`) writes the trainer's files into `dir`, the checkpoint's
    `trainer/` while it is still a temporary directory, on this (the writer's) thread; the
    store hashes and lists what it finds (`CheckpointStore.publish`, P3). `trainer_step`
    is the step the trainer's snapshot says it is of; it must be the cut's version (a
    snapshot from another step would be a bug) and is recorded in the manifest for
    restore step 5. `phases`: seconds per phase of the encoding (`checkpoint_files`) and
    of `publish` (writing, fsyncing and hashing the files) are added to it."""
    try:
        if trainer_step is not None and trainer_step != c.ledger.version:
            raise AuditFailure(
                f"the trainer snapshot is of step {trainer_step}, the cut of step {c.ledger.version}",
                expected="a snapshot taken at the cut's step boundary",
                found=f"trainer step {trainer_step}",
                remedy="this is a bug; the checkpoint was not written",
            )
        with gc_paused():  # O(rows) small objects (see `gc_paused`)
            files, rows = checkpoint_files(c, phases=phases)
    finally:
        c.rows.release()
    full_meta = {
        **({} if trainer_step is None else {"trainer_step": trainer_step}),
        "weight_version": c.ledger.version,
        "cut_time": c.time,
        "cut_hold_seconds": c.hold_seconds,
        "schemas": {"ledger": codec.LEDGER_SCHEMA, "rows": ROWS_SCHEMA},
        "rows": rows,
        **to_manifest(meta),
    }
    version = c.ledger.version

    def check_step(rel: str, size: int, prefix: Callable[[int], bytes], whole: Callable[[], bytes]) -> None:
        """What restore step 5 checks, before the commit point: a file the trainer wrote
        that declares another step would make the checkpoint unrestorable."""
        try:
            step = _declared_step(rel, prefix, lambda: size, whole)
        except ValueError as e:
            step, problem = None, f"does not declare its step readably: {e}"
        else:
            problem = None if step is None or step == version else f"declares step {step}"
        if problem is not None:
            raise CheckpointError(
                f"the trainer's save wrote {rel}, which {problem}; nothing was published",
                path=rel, field=STEP_KEY, expected=f"step {version}, the cut's (or no declared step)",
                found=f"step {step}" if step is not None else problem,
                remedy="make the trainer's save(dir) record the step it is given (the snapshot's step) "
                f"in `{STEP_KEY}`; the previous checkpoint stands")

    lap = stopwatch(phases)
    published = store.publish(version, files, full_meta, keep_last=keep_last, saved={TRAINER_DIR: trainer_save},
                              check_saved=check_step)
    lap("publish")
    return published

"""The restore chain (docs/design.md §5): eight checks, each a hard error naming the file, the
field and the remedy. Nothing here writes to disk; `rollkeep inspect` runs the same chain.

    1  LATEST names a directory with a MANIFEST.json          CheckpointNotFound
    2  every listed file has its size and sha256; no others    ManifestMismatch
    3  schema versions are supported                           SchemaUnsupported
    4  the ledger decodes strictly                             LedgerDecodeError
    5  the custody audit passes                                CheckpointCustodyError
       and the parts are of one step: manifest weight_version
       and trainer_step, and every trainer file's declared
       step, equal the ledger's version                        BindingMismatch
    6  rows referenced by sealed attempts are present (copied,
       or named in a row segment that exists and reaches
       that far), and no row is unreferenced                   RowsMismatch
       and the effect records name live siblings, and every
       finalized sibling's calls of policy `fail` have
       outcomes (FINALIZATION_UNKNOWN)                         CheckpointCustodyError
    7  the dataset still matches (size, seed, each group's
       idx / task / row fingerprint, dataset fingerprint)      DatasetMismatch
    8  the semantic config is unchanged (or the change named)  ConfigMismatch

Steps 1–3 are the store's (`CheckpointStore.open`), 4 the codec's; this module chains them
and adds 5–8. The result says what a restart will reuse, regenerate and read anew.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint.cut import (
    LEDGER_FILE,
    ROWS_FILE,
    STEP_KEY,
    SUPPORTED_SCHEMAS,
    TRAINER_DIR,
    SealedColumns,
    declared_step_in,
    gc_paused,
    referenced_columns,
    referenced_set,
)
from ..checkpoint.meta import CheckpointMeta
from ..checkpoint.rowcodec import decode_rows
from ..checkpoint.rowindex import (
    ROWS_INDEX,
    RowColumns,
    decode_index,
    rows_dir_for,
    segments_listed,
)
from ..checkpoint.store import CheckpointStore, OpenedCheckpoint, open_path
from ..custody import codec
from ..custody.audit import audit
from ..custody.ledger import PROMPT_GROUP_CODE, AttemptStatus, GroupState, LedgerState
from ..errors import BindingMismatch, CheckpointCustodyError, DatasetMismatch, RowsMismatch
from ..rollout.effects import EFFECTS_FILE, FAIL, EffectRecord, decode_effects
from ..rollout.prefixes import Link
from ..rollout.rows import Row, RowId
from ..rollout.source import PromptSource
from ..rowlog.segments import RowLocation, RowLogReader
from .configdiff import check_compatible

_REMEDY_OLDER = (
    "restore from an earlier checkpoint (list them with `ls RUN_DIR/checkpoints`; point "
    "LATEST at one) or start a new run_dir"
)


@dataclass(frozen=True)
class RestorePlan:
    """What a restart from this checkpoint does with each piece of work."""

    groups_reused: int  # READY/CLAIMED groups: trained without regenerating
    groups_finalize_again: int  # all siblings sealed, finalization recomputed
    siblings_reused: int  # sealed siblings of unfinished groups (SIBLING granularity)
    siblings_discarded: int  # sealed siblings of unfinished PROMPT_GROUP groups
    siblings_regenerated: int  # dispatched at the cut: abandoned and dispatched again
    siblings_resent: int  # waiting at the cut after an earlier attempt was abandoned
    #                       (a graceful stop), failed or evicted: dispatched again
    siblings_pending: int  # never dispatched: dispatched for the first time
    groups_readmitted: int  # RESERVED: admitted again
    spare_prompts: int
    source_cursor: tuple[int, int]
    trained: int
    dropped: int

    def lines(self) -> list[str]:
        return [
            f"reuse       {self.groups_reused} finished group(s) from REPLAY, "
            f"{self.siblings_reused} sealed sibling(s) of unfinished groups",
            f"finalize    {self.groups_finalize_again} group(s) with every sibling sealed",
            f"regenerate  {self.siblings_regenerated} sibling(s) in flight at the cut, "
            f"{self.siblings_discarded} sealed sibling(s) of all-or-nothing groups",
            f"resend      {self.siblings_resent} sibling(s) waiting at the cut after an earlier "
            f"attempt was abandoned, failed or evicted",
            f"dispatch    {self.siblings_pending} sibling(s) never dispatched, "
            f"{self.groups_readmitted} group(s) re-admitted",
            f"source      {self.spare_prompts} spare prompt(s), then the source from "
            f"e{self.source_cursor[0]}.{self.source_cursor[1]}",
            f"done        {self.trained} trained, {self.dropped} dropped",
        ]


def plan(state: LedgerState) -> RestorePlan:
    reused = finalize = sib_reused = sib_discarded = sib_regen = sib_resent = sib_pending = readmit = 0
    # Plain ints: comparing with an IntEnum member costs a Python call per group.
    ready, to_finalize, reserved = int(GroupState.READY), int(GroupState.READY_TO_FINALIZE), int(GroupState.RESERVED)
    a_reserved, a_dispatched, a_sealed = (int(a) for a in (AttemptStatus.RESERVED, AttemptStatus.DISPATCHED,
                                                           AttemptStatus.SEALED))
    for rec in state.groups.values():
        s, status = rec.state, rec.status
        if s >= ready:
            reused += 1
            continue
        if s >= to_finalize:
            finalize += 1
            continue
        if s == reserved:
            readmit += 1
        elif rec.granularity == PROMPT_GROUP_CODE:  # all-or-nothing: sealed work is redone
            sib_discarded += status.count(a_sealed)
        else:
            sib_reused += status.count(a_sealed)
        sib_regen += status.count(a_dispatched)
        waiting = status.count(a_reserved)
        # A waiting sibling whose attempt number is past 0 was sent out before.
        resent = sum(1 for st, a in zip(status, rec.attempts, strict=True)
                     if st == a_reserved and a > 0) if waiting and any(rec.attempts) else 0
        sib_resent += resent
        sib_pending += waiting - resent
    return RestorePlan(
        groups_reused=reused,
        groups_finalize_again=finalize,
        siblings_reused=sib_reused,
        siblings_discarded=sib_discarded,
        siblings_regenerated=sib_regen,
        siblings_resent=sib_resent,
        siblings_pending=sib_pending,
        groups_readmitted=readmit,
        spare_prompts=len(state.spare),
        source_cursor=tuple(state.cursor),
        trained=sum(len(b) for b in state.trained.values()),
        dropped=len(state.dropped),
    )


@dataclass(frozen=True)
class Restored:
    """A checkpoint that passed the chain."""

    checkpoint: OpenedCheckpoint
    ledger: LedgerState
    # Copied rows, and rows named by their place in the row log (keyed by the plain tuples
    # their RowIds equal: `Index.located`).
    rows: dict[RowId, Row | RowLocation]
    plan: RestorePlan
    config_changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    prefixes: dict[tuple[str, int], tuple[Link, ...]] = field(default_factory=dict)  # partial generations
    effects: dict[tuple[str, int], tuple[EffectRecord, ...]] = field(default_factory=dict)  # calls to the outside
    located: RowColumns | None = None  # the rows named by reference, as `rows.index`'s columns (None: no index)

    @property
    def name(self) -> str:
        return self.checkpoint.name

    @property
    def manifest(self) -> dict[str, Any]:
        return self.checkpoint.manifest

    @property
    def meta(self) -> CheckpointMeta:
        return self.checkpoint.meta

    @property
    def trainer_dir(self) -> Path:
        """The checkpoint's `trainer/` directory, every file of it verified (steps 1-3) and
        of the ledger's step where it says so (step 5): what `Trainer.load` reads. It is
        read in place after the check, so like every checkpoint file it must not change
        meanwhile (one writer per store, A4 of `rollkeep.core.checkpoint.store`)."""
        return self.checkpoint.path / TRAINER_DIR

    def trainer_file(self, name: str) -> bytes:
        return self.checkpoint.read(f"{TRAINER_DIR}/{name}")


def open_checkpoint(target: CheckpointStore | Path, name: str | None = None) -> OpenedCheckpoint:
    """Steps 1–3. `target` is a store (LATEST or `name`) or a checkpoint directory."""
    if isinstance(target, CheckpointStore):
        return target.open(name, supported=SUPPORTED_SCHEMAS)
    return open_path(Path(target), supported=SUPPORTED_SCHEMAS)


def check_custody(ck: OpenedCheckpoint) -> LedgerState:
    """Steps 4–5."""
    path = str(ck.path / LEDGER_FILE)
    state = codec.decode(ck.read(LEDGER_FILE), path=path)  # checks the records (I3, I4)
    audit(state, records=False).raise_if_failed(
        CheckpointCustodyError,
        path=path,
        remedy=_REMEDY_OLDER + "; a checkpoint that fails the audit was damaged or edited",
    )
    return state


def check_binding(ck: OpenedCheckpoint, state: LedgerState) -> None:
    """Step 5, second half: the manifest, the trainer files and the ledger are of one step.

    Reads only what declares a step (a JSON file; a safetensors file's header), not the
    weights: `open` has already verified every file's sha256."""
    version = state.version

    def refuse(what: str, path: str, field: str, found: Any) -> BindingMismatch:
        return BindingMismatch(
            f"checkpoint {ck.name}: {what}",
            path=path,
            field=field,
            expected=f"step {version}, the ledger's version",
            found=str(found),
            remedy=_REMEDY_OLDER + "; its parts come from different checkpoints (copied or edited)",
        )

    manifest = str(ck.path / "MANIFEST.json")
    for key in ("weight_version", "trainer_step"):
        value = ck.manifest.get(key, version if key == "trainer_step" else None)
        if value != version:
            raise refuse(f"the manifest's {key} is not the ledger's version", manifest, key, value)
    prefix = TRAINER_DIR + "/"
    for rel in ck.files():
        if not rel.startswith(prefix):
            continue
        path = ck.path / rel
        try:
            step = declared_step_in(ck, rel)
        except (OSError, ValueError) as e:
            raise refuse(f"{rel} does not declare its step readably", str(path), STEP_KEY, e) from None
        if step is not None and step != version:
            raise refuse(f"{rel} holds trainer state of another step", str(path), STEP_KEY, f"step {step}")


def check_rows(ck: OpenedCheckpoint, state: LedgerState) -> tuple[dict[RowId, Row | RowLocation],
                                                                  dict[tuple[str, int], tuple[Link, ...]],
                                                                  RowColumns | None]:
    """Step 6: the rows are exactly the ones sealed attempts reference, each either copied
    (a `Row`) or named by its place in the row log (a `RowLocation`, not read here: its
    segment is checked to exist, to have a valid header and to reach past the frame; the
    frame itself is verified when the row is first read, docs/design.md §5.2); and the
    partial generations' chains (`check_chains`), by reference too; and the rows named by
    reference as the index's columns (None without an index)."""
    path = str(ck.path / ROWS_FILE)
    copied: dict[RowId, Row] = decode_rows(ck.read(ROWS_FILE), path=path)
    refs: dict[RowId, RowLocation] = {}
    named: list[list[int]] = []
    chains: dict[tuple[str, int], tuple[Link, ...]] = {}
    columns = None
    if ck.meta.schemas.get("rows", 1) >= 2:
        index = decode_index(ck.read(ROWS_INDEX), path=str(ck.path / ROWS_INDEX))
        refs, named, chains, columns = index.located, index.extents, index.chains, index.columns
        check_chains(ck, state, chains)
    # A checkpoint lists the rows it names in the ledger's order (`referenced_columns`): with
    # none copied, equal columns are the same rows, compared without a tuple per row.
    in_order = not copied and columns is not None and _in_ledger_order(columns, referenced_columns(state))
    rows: dict[RowId, Row | RowLocation] = {**copied, **refs} if copied else refs
    if not in_order:
        both = [rid for rid in copied if rid in refs]
        wanted = referenced_set(state)
        missing = extra = []
        if rows.keys() != wanted:  # one C-level pass; the lists only to say what differs
            missing, extra = sorted(wanted - rows.keys()), sorted(map(RowId._make, rows.keys() - wanted))
        if missing or extra or both:
            raise RowsMismatch(
                "the rows of the checkpoint do not match the ledger's sealed attempts",
                path=path,
                field="rows",
                expected=f"exactly the {len(wanted)} row(s) the ledger references, each copied or named once",
                found=f"{len(missing)} missing (e.g. {missing[:3]}), {len(extra)} unreferenced (e.g. {extra[:3]}), "
                f"{len(both)} both copied and named (e.g. {sorted(both)[:3]})",
                remedy=_REMEDY_OLDER + "; rows and ledger come from different checkpoints or were damaged",
            )
    if refs or chains:
        listed = segments_listed(ck.manifest)
        if listed != named:
            raise RowsMismatch(
                "the manifest's row segments are not the ones the rows index names",
                path=str(ck.path / "MANIFEST.json"),
                field="rows.segments",
                expected=f"[segment, end] of each segment {ROWS_INDEX} names: {named[:4]}",
                found=repr(listed)[:200],
                remedy=_REMEDY_OLDER + "; the manifest was edited",
            )
        reader = RowLogReader(rows_dir_for(ck.path), fs=ck.fs)
        for seg, end in named:
            reader.check_extent(seg, end)
    return rows, chains, columns


def _in_ledger_order(columns: RowColumns, sealed: SealedColumns) -> bool:
    """The index's rows are the ledger's sealed attempts, in the same order."""
    names, counts = sealed.runs()
    return (len(columns) == len(sealed.generation) and np.array_equal(columns.counts, counts)
            and np.array_equal(columns.generation, sealed.generation)
            and np.array_equal(columns.attempt, sealed.attempt) and columns.group_ids == names)


def check_chains(ck: OpenedCheckpoint, state: LedgerState, chains: Mapping[tuple[str, int], tuple[Link, ...]]) -> None:
    """Step 6 for partial generations: each chain belongs to a sibling still generating (not
    sealed) of a sibling-granularity group, and was generated by its current attempt or an
    earlier one."""
    for (gid, gen), chain in chains.items():
        rec = state.groups.get(gid)
        problem = None
        if rec is None or rec.state != GroupState.GENERATING:
            problem = "no generating group" if rec is None else f"group state {GroupState(rec.state).name}"
        elif rec.granularity == PROMPT_GROUP_CODE or not 0 <= gen < rec.group_size:
            problem = "an all-or-nothing group" if gen < rec.group_size else f"no sibling {gen}"
        elif rec.status[gen] == AttemptStatus.SEALED or chain[-1].attempt > rec.attempts[gen]:
            problem = f"sibling status {AttemptStatus(rec.status[gen]).name}, attempt {rec.attempts[gen]}"
        if problem is not None:
            raise RowsMismatch(
                f"the rows index holds a partial generation of {gid}/{gen} that the ledger has no place for",
                path=str(ck.path / ROWS_INDEX), field="chunks",
                expected="a sibling still generating, at this or a later attempt", found=problem,
                remedy=_REMEDY_OLDER + "; rows and ledger come from different checkpoints or were damaged")


def check_effects(ck: OpenedCheckpoint, state: LedgerState) -> dict[tuple[str, int], tuple[EffectRecord, ...]]:
    """Step 6 for effect records (`effects.msgpack`, absent: none): each names a sibling of
    a group the ledger holds, made by its current attempt or an earlier one; a sibling that
    is sealed has an outcome for every call of policy `fail` (FINALIZATION_UNKNOWN: a
    group whose result depends on a call that may or may not have happened is never
    trained)."""
    if EFFECTS_FILE not in ck.files():
        return {}
    path = str(ck.path / EFFECTS_FILE)

    def refuse(what: str, found: str) -> CheckpointCustodyError:
        return CheckpointCustodyError(
            f"{EFFECTS_FILE}: {what}", path=path, field="siblings",
            expected="records of siblings the ledger holds, each made by its current or an earlier attempt, "
            "every sealed sibling's calls of policy `fail` with their outcomes", found=found,
            remedy=_REMEDY_OLDER + "; the effect records and the ledger come from different checkpoints, or "
            "were damaged or forged")

    try:
        records = decode_effects(ck.read(EFFECTS_FILE))
    except ValueError as e:
        raise refuse("not a valid effects file", str(e)[:300]) from None
    check_effect_owners(records, state, refuse)
    return records


def check_effect_owners(records: Mapping[tuple[str, int], tuple[EffectRecord, ...]], state: LedgerState,
                        refuse: Any) -> None:
    """What `check_effects` checks against the ledger (a restore from the journal too):
    `refuse(what, found)` makes the error."""
    for (gid, gen), recs in records.items():
        rec = state.groups.get(gid)
        if rec is None or not 0 <= gen < rec.group_size:
            raise refuse(f"records of {gid}/{gen}, which the ledger has no place for",
                         "no such group" if rec is None else f"no sibling {gen}")
        newest = max(r.attempt for r in recs)
        if newest > rec.attempts[gen]:
            raise refuse(f"a record of {gid}/{gen} by attempt {newest}, which the ledger never started",
                         f"the current attempt is {rec.attempts[gen]}")
        if rec.status[gen] == AttemptStatus.SEALED:
            unknown = [r.key for r in recs if r.ok is None and r.policy == FAIL]
            if unknown:
                raise refuse(f"FINALIZATION_UNKNOWN: sealed sibling {gid}/{gen} depends on call(s) without an "
                             "outcome", f"policy fail, no outcome: {', '.join(unknown[:3])}")


def check_dataset(
    ck: OpenedCheckpoint,
    state: LedgerState,
    source: PromptSource,
    *,
    allow_dataset_change: bool = False,
    extend_epochs: bool = False,
    rows: bool = True,
) -> None:
    """Step 7: the dataset the checkpoint was written against is the one we have.
    `extend_epochs`: the source may have more epochs (or be unbounded); never fewer.
    `rows=False` checks its size, seed and epochs only: the caller checks the rows
    (`check_dataset_rows`) on the state it continues from (the checkpoint with the
    journal's tail replayed, whose groups the checkpoint does not all hold)."""
    path = str(ck.path / LEDGER_FILE)
    check_dataset_identity(state, source, path=path, extend_epochs=extend_epochs)
    if rows:
        check_dataset_rows(state, source, path=path, fingerprint=ck.meta.dataset_fingerprint,
                           allow_dataset_change=allow_dataset_change)


def _dataset_mismatch(what: str, path: str, fld: str, expected: Any, found: Any, remedy: str = "") -> DatasetMismatch:
    return DatasetMismatch(
        what, path=path, field=fld, expected=str(expected), found=str(found),
        remedy="point data.path at the dataset the run started with (or regenerate it with "
        "the same settings), or start a new run_dir" + remedy,
    )


def check_dataset_identity(state: LedgerState, source: PromptSource, *, path: str, extend_epochs: bool = False) -> None:
    """Step 7, first half: the dataset's size, the permutation seed and the epochs of the
    ledger `state` are the source's (epochs may grow with `extend_epochs`)."""
    if state.n_rows != source.n_rows:
        raise _dataset_mismatch("the dataset has a different number of rows", path, "n_rows", state.n_rows,
                                source.n_rows)
    if state.seed != source.seed:
        raise _dataset_mismatch("the permutation seed differs", path, "seed", state.seed, source.seed)
    if state.epochs != source.epochs:
        grows = source.epochs is None or (state.epochs is not None and source.epochs > state.epochs)
        if not (extend_epochs and grows):
            raise _dataset_mismatch(
                "the number of epochs differs" + ("; it can only grow on resume" if extend_epochs else ""),
                path, "epochs", state.epochs, source.epochs)


def check_dataset_rows(state: LedgerState, source: PromptSource, *, path: str, fingerprint: str | None,
                       allow_dataset_change: bool = False) -> None:
    """Step 7, second half: every group of `state` (in flight or buffered, from the
    checkpoint or the journal's tail alike) still names the row it was taken from (idx,
    task, row fingerprint), and, unless `allow_dataset_change`, the dataset's content is
    the one recorded (`fingerprint`; None: not recorded)."""
    bad = []
    for gid, rec in sorted(state.groups.items(), key=lambda kv: kv[1].key):
        problem = source.check_ref(rec.key, rec.idx, rec.task, rec.row_fingerprint)
        if problem is not None:
            bad.append(f"{gid}: {problem}")
    if bad:
        raise _dataset_mismatch(
            f"{len(bad)} in-flight or buffered prompt(s) no longer match the dataset: " + "; ".join(bad[:3]),
            path, "groups[].row_fingerprint", "each group's row as recorded", f"{len(bad)} changed row(s)")
    if fingerprint is not None and not allow_dataset_change and fingerprint != source.fingerprint():
        raise _dataset_mismatch(
            "the dataset's content changed since it was recorded (rows no prompt in flight or buffered "
            "reads were edited, added, removed or reordered)",
            path, "dataset.fingerprint", fingerprint, source.fingerprint(),
            "; or pass --allow-dataset-change to resume on the edited rows (in-flight and buffered "
            "rows are still checked one by one)",
        )


def restore_chain(
    target: CheckpointStore | Path,
    *,
    name: str | None = None,
    source: PromptSource | None,
    config: Mapping[str, Any] | None,
    allow_config_change: Iterable[str] = (),
    allow_dataset_change: bool = False,
    extend_epochs: bool = False,
    config_added: Mapping[str, Any] | None = None,
    dataset_rows: bool = True,
) -> Restored:
    """Run steps 1–8. `source=None` / `config=None` skip steps 7 / 8 (`rollkeep audit`);
    `dataset_rows=False` leaves step 7's rows to the caller (`check_dataset`).
    `config_added`: keys newer than some checkpoints, with the value that means "as before
    the key existed" (see `configdiff.check_compatible`).

    Step 8 is evaluated before step 7: a changed seed or number of epochs is a config
    change (reported as a dotted diff, with what may be allowed), not a changed dataset;
    step 7 still compares the ledger's own seed and epochs with the source's."""
    with gc_paused():
        return _restore_chain(target, name, source, config, allow_config_change, allow_dataset_change,
                              extend_epochs, config_added, dataset_rows)


def _restore_chain(target, name, source, config, allow_config_change, allow_dataset_change, extend_epochs,
                   config_added, dataset_rows) -> Restored:
    ck = open_checkpoint(target, name)
    state = check_custody(ck)
    check_binding(ck, state)
    rows, chains, located = check_rows(ck, state)
    effects = check_effects(ck, state)
    changes: list = []
    if config is not None:
        changes = check_compatible(
            ck.meta.config,
            config,
            allow=allow_config_change,
            path=str(ck.path / "MANIFEST.json"),
            added=config_added,
        )
    if source is not None:
        check_dataset(ck, state, source, allow_dataset_change=allow_dataset_change, extend_epochs=extend_epochs,
                      rows=dataset_rows)
    return Restored(checkpoint=ck, ledger=state, rows=rows, plan=plan(state), config_changes=changes,
                    prefixes=chains, effects=effects, located=located)

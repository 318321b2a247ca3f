"""What a checkpoint's MANIFEST.json says besides its files, typed (docs/design.md §4).

    RunMeta          what the run records in every checkpoint (`schedule.cutting.checkpoint_meta`):
                     the dataset and the semantic config a restore checks (steps 7 and 8), the
                     writer, and with the journal its position at the cut
    CheckpointMeta   all of it as read back: RunMeta, the cut's fields (`cut.write_checkpoint`)
                     and the store's name and step

Readers (restore, start-up, inspect, warmup, export) read `OpenedCheckpoint.meta` and never
`.get()` the manifest. A manifest's sha256 is checked before it is read here, so a value of
the wrong type is an edited manifest whose hash was recomputed: refused as ManifestMismatch
(exit 3) naming the field. Keys it does not name are kept in the manifest (a custom writer's
meta) and ignored here; defaults are what a checkpoint without the key means (written with
the journal off, by a writer that records no dataset or config)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from ..errors import ManifestMismatch

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class DatasetMeta(msgspec.Struct, frozen=True, kw_only=True):
    n_rows: NonNegative
    seed: int
    epochs: int | None = None  # None: unbounded
    fingerprint: str | None = None  # `PromptSource.fingerprint()`; absent from some writers


class JournalPosition(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The journal's place at the cut: the tail a restore replays starts after `seq`, and
    the row log from `rows_segment` on holds the rows it may name."""

    seq: NonNegative
    rows_segment: NonNegative


class RunMeta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    dataset: DatasetMeta | None = None
    config: dict[str, Any] = {}  # the semantic config (`config.semantic`)
    config_fingerprint: str | None = None
    rollkeep_version: str | None = None
    run_id: str | None = None
    journal: JournalPosition | None = None  # None: written with the journal off


class CheckpointMeta(RunMeta, frozen=True, kw_only=True, omit_defaults=True):
    name: str
    step: NonNegative
    weight_version: int | None = None  # restore step 5 refuses a checkpoint where it is not the ledger's
    trainer_step: int | None = None
    cut_time: float = 0.0
    cut_hold_seconds: float = 0.0
    schemas: dict[str, int] = {}
    rows: dict[str, Any] = {}  # `cut.checkpoint_files`' summary; `rowindex` checks what it reads of it

    @property
    def dataset_fingerprint(self) -> str | None:
        return None if self.dataset is None else self.dataset.fingerprint

    @property
    def journal_seq(self) -> int | None:
        """The journal seq the checkpoint covers, or None if written with the journal off."""
        return None if self.journal is None else self.journal.seq


def read_meta(manifest: Mapping[str, Any], *, path: str) -> CheckpointMeta:
    """The typed meta of a parsed manifest (`path`: the manifest, for the message)."""
    try:
        return msgspec.convert(manifest, CheckpointMeta, strict=True)
    except msgspec.ValidationError as e:
        where = str(e).rpartition(" - at `$.")[2].rstrip("`") or "(top level)"
        top = where.split(".", 1)[0].split("[", 1)[0]
        found = repr(manifest.get(top, "<missing>"))[:200]
        if top == "journal":
            raise ManifestMismatch(
                "the checkpoint's journal position is not one a run records", path=path, field="journal",
                expected='{"seq": int >= 0, "rows_segment": int >= 0} (or no journal entry: written with the '
                         "journal off)",
                found=found,
                remedy="the manifest was edited or damaged; restore from an earlier checkpoint or start a new "
                       "run_dir") from None
        raise ManifestMismatch(
            f"the checkpoint's manifest field {where} is not one a run records ({e})", path=path, field=where,
            expected=f"{top} as rollkeep writes it", found=found,
            remedy="the manifest was edited or damaged; restore from an earlier checkpoint or start a new "
                   "run_dir") from None


def to_manifest(meta: RunMeta | Mapping[str, Any]) -> dict[str, Any]:
    """`meta` as the plain values the store writes into MANIFEST.json."""
    return msgspec.to_builtins(meta) if isinstance(meta, msgspec.Struct) else dict(meta)

"""`rollkeep audit PATH`: does a checkpoint pass restore steps 1-6?

The same chain `rollkeep train` runs on resume (`rollkeep.core.restore.chain`), minus steps 7-8
which need the run's dataset and config: every listed file has its size and sha256, the
schemas are supported, the ledger decodes, the custody audit passes, the rows match, and
beyond what a restore reads, every row the checkpoint names in the row log is read and
verified; and for LATEST of a run dir, the journal's tail after it (records, their sequence,
the rows its seals name, each read and verified) and its replay onto the checkpoint. A run
dir with no LATEST whose journal recorded work (killed before its first checkpoint) is
audited from its journal alone, as `rollkeep train` would resume it: every record, the rows
its seals name, and its replay onto the empty ledger of its dataset. One line per
checkpoint (and one for the journal); exit 0 iff every audited one passes. Modifies
nothing on disk.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rollkeep.cli import exit_code, print_error
from rollkeep.cli.inspect import (
    STEPS_RUN,
    Target,
    custody,
    from_journal,
    journal_alone,
    journal_tail,
    resolve,
)
from rollkeep.core.checkpoint.rowindex import rows_dir_for
from rollkeep.core.errors import CheckpointNotFound, RollkeepError
from rollkeep.core.restore.chain import Restored, restore_chain
from rollkeep.core.rowlog.segments import RowLocation, RowLogReader

_EXAMPLES = """\
PATH is a run dir, its checkpoints/ dir, or one checkpoint dir (as for `rollkeep inspect`).
Without --all, the checkpoint LATEST names (or the one given) is audited, with the journal's
tail after it; with --all, every step_* directory of the store, and LATEST itself. A run
that never published a checkpoint is audited from its journal, if it recorded work.

examples:
  rollkeep audit runs/a
      step_000040: ok (trained 320, ledger 12, replay 8, spare 0, dropped 1, cursor e0.341, version 40)
  rollkeep audit --all runs/a/checkpoints
  rollkeep audit runs/killed-before-its-first-checkpoint
      journal (no checkpoint): ok (299 event(s), 126 row(s) read and verified, ...)
        `rollkeep train` resumes this run from its journal at step 0, not from scratch: ...
  rollkeep audit runs/a/checkpoints/step_000030

Exit 0 iff every audited checkpoint (and journal) passes; otherwise the code of the first
failure (3 for a damaged or mismatched checkpoint or journal; see `rollkeep --help`), with
one paragraph on stderr per failure naming the file and what to do.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "audit",
        help="verify checkpoints: files, schemas, ledger, custody audit, rows (read-only)",
        description="Check a checkpoint the way a restore does (restore steps 1-6: manifest, "
        "file hashes, schema versions, ledger decoding, custody audit, rows).",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", metavar="PATH", type=Path, help="run dir, checkpoints dir, or checkpoint dir")
    p.add_argument("--all", action="store_true", help="audit every checkpoint in the store")
    return p


def ok_line(r: Restored, read: int = 0) -> str:
    c = custody(r.ledger)
    return (
        f"{r.name}: ok (trained {c['trained']}, ledger {c['ledger']['total']}, "
        f"replay {c['replay']['total']}, spare {c['spare']}, dropped {c['dropped']}, "
        f"cursor {c['cursor_key']}, version {c['version']}; {read} row(s) read from the row log)"
    )


def read_named(r: Restored) -> int:
    """Read and verify every row the checkpoint names by reference (a restore reads none
    of them; docs/design.md §5.2): the frame's length and checksum, its decoding, its id.
    Raises RowSegmentCorrupt (exit 3) for the first that fails. Returns how many."""
    reader = RowLogReader(rows_dir_for(r.checkpoint.path))
    named = [(rid, loc) for rid, loc in r.rows.items() if isinstance(loc, RowLocation)]
    for rid, loc in named:
        reader.read(rid, loc)
    return len(named)


def failed_line(name: str, err: RollkeepError) -> str:
    step = getattr(err, "step", 0)
    where = f"restore step {step}, {STEPS_RUN[step]}" if step in STEPS_RUN else type(err).__name__
    return f"{name}: FAILED at {where} (see the error on stderr)"


def _audit_one(target: Target) -> int:
    alone = from_journal(target, verify_rows=True)
    if alone is not None:
        print(alone_line(alone))
        return 0
    r = restore_chain(target.chain_target, source=None, config=None)
    print(ok_line(r, read_named(r)))
    j = journal_tail(target, r, verify_rows=True)
    if j is not None:
        print(journal_line(r.name, j))
    return 0


def journal_line(name: str, j: dict[str, Any]) -> str:
    torn = f", torn tail {j['torn_tail_bytes']} B" if j["torn_tail_bytes"] else ""
    return (f"journal after {name}: ok ({j['events']} event(s), {j['seals']} row(s) read and verified, "
            f"replays onto the checkpoint{torn})")


def alone_line(rep: dict[str, Any]) -> str:
    """The line for a run that never published a checkpoint, audited from its journal."""
    c, j = rep["custody"], rep["journal"]
    torn = f", torn tail {j['torn_tail_bytes']} B" if j["torn_tail_bytes"] else ""
    return (f"journal (no checkpoint): ok ({j['events']} event(s), {j['seals']} row(s) read and verified, "
            f"replays onto the empty ledger{torn}; trained {c['trained']}, ledger {c['ledger']['total']}, "
            f"replay {c['replay']['total']}, spare {c['spare']}, dropped {c['dropped']}, "
            f"cursor {c['cursor_key']}, version {c['version']})\n" + resume_line(rep))


def resume_line(rep: dict[str, Any]) -> str:
    """What `rollkeep train` does with a run that has a journal and no checkpoint: it
    resumes from the journal (`start.journal_tail`); it does not start from scratch."""
    j, p = rep["journal"], rep["journal"]["plan"]
    again = p["siblings_regenerated"] + p["siblings_discarded"] + p["siblings_resent"]
    back = j["steps_taken_back"]
    redo = (f"; steps {back[0]}-{back[1]} are trained again from their recorded rows (their weights "
            "died with the process)" if back else "")
    return (f"  `rollkeep train` resumes this run from its journal at step {rep['step']}, not from scratch: "
            f"it reuses {p['groups_reused']} finished group(s) and {p['siblings_reused']} sealed sibling(s), "
            f"and sends out again only the {again} sibling(s) it cannot reuse (in flight when the "
            f"process stopped, or of an unfinished all-or-nothing group){redo}")


def _audit_all(target: Target) -> int:
    store = target.store
    names = store.list()
    codes: list[int] = []

    def failed(name: str, err: RollkeepError) -> None:
        print(failed_line(name, err))
        print_error(err)
        codes.append(exit_code(err))

    latest = alone = None
    journal_failed = False
    try:
        latest = store.latest()
    except RollkeepError as err:
        failed("LATEST", err)
    else:
        if latest is None:
            if not store.root.is_dir():  # no checkpoints/ at all: the journal alone, or nothing to audit
                alone = from_journal(target, verify_rows=True)
                print(alone_line(alone))
                return 0
            print("LATEST: missing (no checkpoint is published)")
            try:  # what `train` resumes from then
                alone = journal_alone(Target(target.kind, store, None), verify_rows=True)
            except CheckpointNotFound as err:  # `train` refuses to start here: said above, unless no dir is
                if not names:
                    failed("journal", err)
                    journal_failed = True
            except RollkeepError as err:
                failed("journal", err)
                journal_failed = True
            else:
                if alone is not None:
                    print(alone_line(alone))
        elif latest not in names:
            try:  # raises CheckpointNotFound with the store's own wording and remedy
                restore_chain(store, source=None, config=None)
            except RollkeepError as err:
                failed("LATEST", err)
        else:
            print(f"LATEST: {latest}")
    if not names and alone is None and not journal_failed:
        raise CheckpointNotFound(
            f"{store.root} holds no checkpoint directory",
            path=str(store.root),
            expected="one or more step_NNNNNN directories",
            found="none",
            remedy="nothing to audit yet; check the path, or let the run publish a checkpoint",
        )
    for name in names:
        try:
            r = restore_chain(store, name=name, source=None, config=None)
            read = read_named(r)
        except RollkeepError as err:
            failed(name, err)
        else:
            print(ok_line(r, read))
            if name == latest:
                try:
                    j = journal_tail(Target(target.kind, store, None), r, verify_rows=True)
                except RollkeepError as err:
                    failed(f"journal after {name}", err)
                else:
                    if j is not None:
                        print(journal_line(name, j))
    return codes[0] if codes else 0


def run(args: argparse.Namespace) -> int:
    target = resolve(args.path)
    return _audit_all(target) if args.all else _audit_one(target)

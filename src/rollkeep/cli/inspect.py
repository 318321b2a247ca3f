"""`rollkeep inspect PATH`: what a checkpoint holds and what a restore from it would do.

It runs restore steps 1-6 of docs/design.md §5, the same code `rollkeep train` runs when it
resumes (`rollkeep.core.restore.chain`), and modifies nothing on disk. Steps 7 (dataset) and 8
(config) need the run's dataset and config, which inspect does not load; the output says
so. PATH is resolved by `resolve()`, shared with `rollkeep audit`. With the journal, the
plan is the one after LATEST's journal tail is replayed; a run dir with no LATEST whose
journal recorded work (a run killed before its first checkpoint) is reported from the
journal alone, as `rollkeep train` would resume it (`journal_alone`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rollkeep.core.checkpoint.manifest import RESERVED_KEYS
from rollkeep.core.checkpoint.store import LATEST, MANIFEST, CheckpointStore
from rollkeep.core.custody.keys import group_id
from rollkeep.core.custody.ledger import GroupState, LedgerState
from rollkeep.core.errors import (
    CheckpointError,
    CheckpointNotFound,
    RollkeepError,
    UserInputError,
)
from rollkeep.core.restore.chain import Restored, restore_chain
from rollkeep.core.rollout.prefixes import finished_turns
from rollkeep.core.rollout.rows import Row

CHECKPOINTS = "checkpoints"  # RUN_DIR/checkpoints (docs/design.md §4)
JOURNAL = "journal"  # RUN_DIR/journal (docs/design.md §5.1)
_CHECKPOINT_NAME = re.compile(r"step_\d{6,}")

#: Restore steps this command runs, and the two it cannot.
STEPS_RUN = {
    1: "the checkpoint (the one LATEST names, or the one given) has a manifest",
    2: "every file has its listed size and sha256, nothing unlisted",
    3: "schema versions supported",
    4: "ledger decodes strictly",
    5: "custody audit",
    6: "rows match the ledger's sealed attempts",
}
STEPS_NOT_RUN = {
    7: "dataset unchanged",
    8: "semantic config unchanged",
}
NOT_RUN_REASON = (
    "inspect does not load the run's dataset or config; `rollkeep train` checks them "
    "when it resumes"
)

#: What a report from the journal alone (a run that never published a checkpoint) checked:
#: what `rollkeep train` checks before it resumes such a run, but for steps 7 and 8.
JOURNAL_CHECKS = {
    "j1": "every journal record's checksum, and a sequence without gaps (a torn tail ends it)",
    "j2": "every record decodes as a ledger event or a restart marker",
    "j3": "every row segment a seal names exists, has its header and reaches that far",
    "j4": "the events replay onto the empty ledger of the dataset the first process recorded",
}
ROWS_READ = {"j5": "every row and chunk a seal names read and verified (length, checksum, id)"}

_LEDGER_STATES = [s for s in GroupState if s < GroupState.READY]
_REPLAY_STATES = [s for s in GroupState if s >= GroupState.READY]

_EXAMPLES = """\
PATH is one of:
  RUN_DIR                      the checkpoint LATEST names in RUN_DIR/checkpoints (no LATEST:
                               the journal alone, if it recorded work, as `train` resumes it)
  RUN_DIR/checkpoints          the same
  RUN_DIR/checkpoints/step_N   that checkpoint, whatever LATEST says

examples:
  rollkeep inspect runs/a
  rollkeep inspect runs/a/checkpoints/step_000040
  rollkeep inspect --json runs/a | jq .custody

Nothing on disk is modified. Exit codes as in `rollkeep --help` (3: the checkpoint fails
a check; the message names the file and what to do).
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "inspect",
        help="show what a checkpoint holds and what a restore from it would do (read-only)",
        description="Verify a checkpoint the way a restore does (restore steps 1-6) and "
        "show its custody state, what a restart would reuse, regenerate and read from the "
        "source, and the other checkpoints of its run.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", metavar="PATH", type=Path, help="run dir, checkpoints dir, or checkpoint dir")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return p


# -- PATH --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """What PATH points at: a store whose LATEST to open, or one checkpoint directory."""

    kind: str  # "run dir" | "checkpoints dir" | "checkpoint dir"
    store: CheckpointStore  # the store to list (a checkpoint dir's parent)
    checkpoint: Path | None  # the checkpoint directory, or None: the one LATEST names

    @property
    def chain_target(self) -> CheckpointStore | Path:
        return self.checkpoint if self.checkpoint is not None else self.store


_PATH_FORMS = "a run dir (holding checkpoints/), a checkpoints/ dir, or a checkpoint dir (step_NNNNNN)"


def resolve(path: Path) -> Target:
    """Decide which of the three PATH forms `path` is. Reads directory entries only."""
    if not path.exists():
        raise UserInputError(
            f"{path} does not exist",
            path=str(path),
            expected=_PATH_FORMS,
            found="no such file or directory",
            remedy="check the path (a run's checkpoints live in RUN_DIR/checkpoints)",
        )
    if not path.is_dir():
        raise UserInputError(
            f"{path} is not a directory",
            path=str(path),
            expected=_PATH_FORMS,
            found="a file",
            remedy="pass the directory that holds it",
        )
    if _CHECKPOINT_NAME.fullmatch(path.name) or (path / MANIFEST).exists():
        return Target("checkpoint dir", CheckpointStore(path.parent), path)
    if (path / CHECKPOINTS).is_dir():
        return Target("run dir", CheckpointStore(path / CHECKPOINTS), None)
    entries = [e.name for e in os.scandir(path)]
    if (
        path.name == CHECKPOINTS
        or LATEST in entries
        or any(_CHECKPOINT_NAME.fullmatch(n) for n in entries)
    ):
        return Target("checkpoints dir", CheckpointStore(path), None)
    if any(n in entries for n in ("config.yaml", "trace.jsonl", "metrics.jsonl", JOURNAL)):
        # A run that never published a checkpoint: its journal may hold its work (`build`).
        return Target("run dir", CheckpointStore(path / CHECKPOINTS), None)
    raise UserInputError(
        f"{path} is not a run dir, a checkpoints dir or a checkpoint dir",
        path=str(path),
        expected=_PATH_FORMS,
        found=f"a directory holding {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
        + (f" ({', '.join(sorted(entries)[:5])}{', ...' if len(entries) > 5 else ''})" if entries else ""),
        remedy="point at RUN_DIR, RUN_DIR/checkpoints or RUN_DIR/checkpoints/step_NNNNNN",
    )


def store_listing(store: CheckpointStore) -> dict[str, Any]:
    """The checkpoint directories of a store (unverified) and what LATEST says."""
    try:
        latest, latest_problem = store.latest(), None
    except CheckpointError as err:
        latest, latest_problem = None, err.what
    return {
        "root": str(store.root),
        "latest": latest,
        "latest_problem": latest_problem,
        "checkpoints": store.list(),
    }


# -- the report --------------------------------------------------------------------------


def custody(state: LedgerState) -> dict[str, Any]:
    """Who owns what: the numbers of the owner table (docs/design.md §1)."""
    by_state = Counter(GroupState(r.state) for r in state.groups.values())
    dropped_by_reason = Counter(reason for reason, _ in state.dropped.values())
    cursor = tuple(state.cursor)
    left = None
    if state.epochs is not None:
        left = max(0, (state.epochs - cursor[0]) * state.n_rows - cursor[1])
    return {
        "spare": len(state.spare),
        "ledger": {
            "total": sum(by_state[s] for s in _LEDGER_STATES),
            **{s.name: by_state[s] for s in _LEDGER_STATES},
        },
        "replay": {
            "total": sum(by_state[s] for s in _REPLAY_STATES),
            **{s.name: by_state[s] for s in _REPLAY_STATES},
        },
        "trained": sum(len(b) for b in state.trained.values()),
        "trained_by_epoch": {str(e): len(b) for e, b in sorted(state.trained.items())},
        "dropped": len(state.dropped),
        "dropped_by_reason": dict(sorted(dropped_by_reason.items())),
        "cursor": list(cursor),
        "cursor_key": group_id(cursor),
        "source_left": left,
        "version": state.version,
        "shortfall": {str(s): n for s, n in sorted(state.shortfall.items())},
        "dataset": {"n_rows": state.n_rows, "seed": state.seed, "epochs": state.epochs},
    }


def report(target: Target, r: Restored) -> dict[str, Any]:
    m = r.manifest
    files = {rel: int(info["size"]) for rel, info in sorted(m["files"].items())}
    files[MANIFEST] = (r.checkpoint.path / MANIFEST).stat().st_size
    created = float(m["created"])
    return {
        "ok": True,
        "checkpoint": r.name,
        "path": str(r.checkpoint.path),
        "via": "path" if target.checkpoint is not None else "LATEST",
        "step": r.meta.step,
        "weight_version": r.meta.weight_version,
        "created": created,
        "created_utc": datetime.fromtimestamp(created, UTC).isoformat(timespec="seconds"),
        "bytes": sum(files.values()),
        "files": files,
        "meta": {k: v for k, v in m.items() if k not in RESERVED_KEYS and k != "config"},
        "checks": {
            "passed": {str(k): v for k, v in STEPS_RUN.items()},
            "not_run": {str(k): v for k, v in STEPS_NOT_RUN.items()},
            "not_run_reason": NOT_RUN_REASON,
        },
        "custody": custody(r.ledger),
        "rows": len(r.rows),
        "rows_by_reference": sum(not isinstance(x, Row) for x in r.rows.values()),
        "partial_generations": len(r.prefixes),
        "partial_tokens": sum(chain[-1].end for chain in r.prefixes.values()),
        "turns": finished_turns(r.prefixes),
        "plan": {**asdict(r.plan), "source_cursor": list(r.plan.source_cursor), "lines": r.plan.lines()},
        "store": store_listing(target.store),
    }


def journal_tail(target: Target, r: Restored, *, verify_rows: bool = False) -> dict[str, Any] | None:
    """What `rollkeep train` would replay after `r` (docs/design.md §5.1): read and check
    the journal's tail and the segments its seals' rows are in (`verify_rows`: read and
    verify each row too, as `audit` does), replay it (in memory), and say what it adds; None
    when no tail would be replayed (a checkpoint given by path, written with the journal
    off, or not the newest). Raises what the restore would (exit 3)."""
    from rollkeep.core.errors import IllegalTransition
    from rollkeep.core.journal.durable import read_tail
    from rollkeep.core.journal.replay import Restart, replay
    from rollkeep.core.journal.segments import JournalError
    from rollkeep.core.restore.chain import plan
    from rollkeep.core.rollout.rows import RowId
    from rollkeep.core.rowlog.segments import ROWS_DIR, RowLogReader

    seq = r.meta.journal_seq
    if target.checkpoint is not None or seq is None:
        return None
    run_dir = target.store.root.parent
    tail = read_tail(run_dir, after=seq)
    if verify_rows:  # what a restore leaves to the first read of each row
        reader = RowLogReader(run_dir / ROWS_DIR)
        for ev, loc in tail.events:
            if loc is not None:
                reader.read(RowId(ev.group_id, ev.generation, ev.attempt), loc)
    events = [ev for ev, _ in tail.events if not isinstance(ev, Restart)]
    try:
        replayed = replay(r.ledger, r.rows, tail.events, r.prefixes)
    except IllegalTransition as e:  # as `train`: a journal that is not this checkpoint's is refused
        raise JournalError(e.what, path=str(run_dir / "journal"), expected=e.expected, found=e.found,
                           remedy=e.remedy) from None
    after = plan(replayed.state)
    s = tail.summary
    return {
        "alone": False, "after_seq": seq, "last_seq": tail.last_seq, "events": len(events),
        "processes": sum(isinstance(ev, Restart) for ev, _ in tail.events),
        "seals": sum(row is not None for _, row in tail.events),
        "torn_tail_bytes": sum(t.dropped for t in s.torn) if s is not None else 0,
        "steps_taken_back": replayed.steps_taken_back, "groups_returned": replayed.groups_returned,
        "dropped": tail.dropped,
        "plan": {**asdict(after), "source_cursor": list(after.source_cursor), "lines": after.lines()},
    }


def journal_alone(target: Target, *, verify_rows: bool = False) -> dict[str, Any] | None:
    """The report for a run dir with no LATEST whose journal recorded work (a run killed
    before its first checkpoint): what `rollkeep train` restores then (`start.journal_tail`
    with no checkpoint, docs/design.md §5.1): the journal read and checked from its first
    record, its seals' row segments checked (`verify_rows`: each row read and verified too,
    as `audit` does), and its events replayed onto the empty ledger of the dataset its first
    process recorded, the steps they committed taken back. Steps 7 and 8 (the dataset, the
    config) are not run. None when `train` would start from scratch: a PATH that names a
    checkpoint, no journal, or one with restart markers only. Raises what `train` would:
    checkpoint directories without LATEST, a journal or row log that is not a directory, a
    damaged record, a replay that does not continue the ledger (exit 3). Reads only."""
    from rollkeep.core.custody.ledger import Ledger
    from rollkeep.core.errors import IllegalTransition
    from rollkeep.core.io.fs import DEFAULT_FS, DIR
    from rollkeep.core.journal.durable import read_tail
    from rollkeep.core.journal.replay import Restart, replay
    from rollkeep.core.journal.segments import JournalError
    from rollkeep.core.restore.chain import plan
    from rollkeep.core.restore.start import start_point
    from rollkeep.core.rollout.rows import RowId
    from rollkeep.core.rowlog.segments import ROWS_DIR, RowLogReader
    from rollkeep.trace import published_in_trace

    store, fs = target.store, DEFAULT_FS
    run_dir = store.root.parent
    journal = run_dir / JOURNAL
    if target.checkpoint is not None or fs.kind_of(journal) is None:
        return None
    # Where `train` would start (controller.rundir): step_* directories without LATEST are refused.
    if start_point(store, None, published=lambda: published_in_trace(run_dir / "trace.jsonl")) is not None:
        return None  # LATEST was published meanwhile: the caller's checkpoint path reports it
    for name in (JOURNAL, ROWS_DIR):  # as `start.journal_tail`: a file, a FIFO or a symlink is refused
        if fs.kind_of(run_dir / name) not in (None, DIR):
            raise JournalError(
                f"RUN_DIR/{name} is not a directory", path=str(run_dir / name),
                expected="a directory (not a symlink) that the run's journal writes",
                found=fs.describe(run_dir / name), remedy="move it aside (`rollkeep train` refuses it too)")
    tail = read_tail(run_dir, after=0)
    events = [ev for ev, _ in tail.events if not isinstance(ev, Restart)]
    if not events:
        return None
    if not tail.datasets:  # `train` takes the dataset it is given; inspect has none
        raise JournalError(
            "the journal's first process recorded no dataset (a journal of an older rollkeep)",
            path=str(journal), expected="a restart marker naming the dataset, to rebuild the empty ledger from",
            found=f"{len(events)} event(s) and no dataset", remedy="inspect cannot replay it without the "
            "dataset; `rollkeep train` does (and checks it) when it resumes the run")
    if verify_rows:  # what a restore leaves to the first read of each row
        reader = RowLogReader(run_dir / ROWS_DIR)
        for ev, loc in tail.events:
            if loc is not None:
                reader.read(RowId(ev.group_id, ev.generation, ev.attempt), loc)
    first, newest = tail.datasets[0], tail.datasets[-1]
    base = Ledger(n_rows=first.n_rows, seed=first.seed, epochs=first.epochs).capture()
    try:
        r = replay(base, {}, tail.events)
    except IllegalTransition as e:  # as `train`: a journal that does not continue its own ledger
        raise JournalError(e.what, path=str(journal), expected=e.expected, found=e.found,
                           remedy=e.remedy) from None
    after = plan(r.state)
    files = _segment_files(run_dir, (JOURNAL, ROWS_DIR))
    passed = {**JOURNAL_CHECKS, **(ROWS_READ if verify_rows else {})}
    s = tail.summary
    plan_json = {**asdict(after), "source_cursor": list(after.source_cursor), "lines": after.lines()}
    return {
        "ok": True,
        "checkpoint": None,
        "path": str(journal),
        "via": "journal",
        "step": r.state.version,
        "weight_version": None,
        "created": None,
        "created_utc": None,
        "bytes": sum(files.values()),
        "files": files,
        "meta": {"dataset": {"n_rows": newest.n_rows, "seed": newest.seed, "epochs": newest.epochs,
                             "fingerprint": newest.fingerprint}},
        "checks": {
            "passed": passed,
            "not_run": {str(k): v for k, v in STEPS_NOT_RUN.items()},
            "not_run_reason": NOT_RUN_REASON,
        },
        "custody": custody(r.state),
        "rows": len(r.rows),
        "rows_by_reference": sum(not isinstance(x, Row) for x in r.rows.values()),
        "partial_generations": len(r.prefixes),
        "partial_tokens": sum(chain[-1].end for chain in r.prefixes.values()),
        "turns": finished_turns(r.prefixes),
        "plan": plan_json,
        "journal": {
            "alone": True, "after_seq": 0, "last_seq": tail.last_seq, "events": len(events),
            "processes": sum(isinstance(ev, Restart) for ev, _ in tail.events),
            "seals": sum(row is not None for _, row in tail.events),
            "torn_tail_bytes": sum(t.dropped for t in s.torn) if s is not None else 0,
            "steps_taken_back": r.steps_taken_back, "groups_returned": r.groups_returned,
            "dropped": tail.dropped, "plan": plan_json,
        },
        "store": store_listing(store),
    }


def _segment_files(run_dir: Path, dirs: tuple[str, ...]) -> dict[str, int]:
    """`dir/name`: size of each regular file in the run's journal and row log (already read)."""
    out = {}
    for d in dirs:
        try:
            entries = sorted(os.scandir(run_dir / d), key=lambda e: e.name)
        except FileNotFoundError:
            continue
        except OSError as e:
            from rollkeep.core.errors import FilesystemError

            raise FilesystemError.of(e, "listing the journal", run_dir / d) from None
        out.update((f"{d}/{e.name}", e.stat(follow_symlinks=False).st_size)
                   for e in entries if e.is_file(follow_symlinks=False))
    return out


def from_journal(target: Target, *, verify_rows: bool = False) -> dict[str, Any] | None:
    """`journal_alone`'s report when PATH has no LATEST and `train` would resume from the
    journal; None when PATH is to be restored from a checkpoint (a LATEST, or a checkpoint
    dir given). Raises CheckpointNotFound for a run dir with neither checkpoints/ nor a
    journal that recorded work."""
    if target.checkpoint is not None or target.store.latest() is not None:
        return None
    alone = journal_alone(target, verify_rows=verify_rows)
    if alone is None and not target.store.root.is_dir():
        raise CheckpointNotFound(
            f"run dir {target.store.root.parent} has no {CHECKPOINTS}/ directory: it never published a checkpoint",
            path=str(target.store.root),
            expected=f"{CHECKPOINTS}/ with a LATEST file",
            found="no such directory, and no journal that recorded work",
            remedy="nothing to inspect yet; `rollkeep train` starts this run from scratch",
        )
    return alone


def build(target: Target, *, verify_rows: bool = False) -> dict[str, Any]:
    """The report for PATH: from the journal alone where `train` would resume from it
    (`from_journal`), else the checkpoint restored (steps 1-6) with LATEST's journal tail
    replayed onto it. Raises what the restore would (no LATEST: the store's refusal)."""
    alone = from_journal(target, verify_rows=verify_rows)
    if alone is not None:
        return alone
    restored = restore_chain(target.chain_target, source=None, config=None)
    rep = report(target, restored)
    rep["journal"] = journal_tail(target, restored, verify_rows=verify_rows)
    return rep


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def render(rep: dict[str, Any]) -> str:
    """The report as text, in the order a person reads it."""
    c = rep["custody"]
    out: list[str] = []

    def row(label: str, text: str) -> None:
        out.append(f"{label:<12}{text}")

    store = rep["store"]
    j = rep.get("journal")
    alone = j is not None and j["alone"]
    if alone:
        row("checkpoint", "none: the run never published one; this is what its journal alone restores")
        row("journal", rep["path"])
        back = j["steps_taken_back"]
        row("step", f"{rep['step']}" + (f"  (steps {back[0]}-{back[1]} the stopped process trained are taken "
                                          "back: their weights died with it)" if back else ""))
    else:
        via = f"LATEST of {store['root']}" if rep["via"] == "LATEST" else "given by path"
        row("checkpoint", f"{rep['checkpoint']}  ({via})")
        row("path", rep["path"])
        wv = rep["weight_version"]
        row("step", f"{rep['step']}" + (f"  (weight version {wv})" if wv is not None else ""))
        row("created", rep["created_utc"])
    row("size", f"{_size(rep['bytes'])} in {len(rep['files'])} files")
    for rel, n in rep["files"].items():
        row("", f"{_size(n):>10}  {rel}")
    ds = rep["meta"].get("dataset")
    if isinstance(ds, dict):
        row("dataset", ", ".join(f"{k} {v}" for k, v in ds.items() if k != "fingerprint")
            + (f", fingerprint {ds['fingerprint']}" if "fingerprint" in ds else ""))
    checks = rep["checks"]
    for i, (n, what) in enumerate(checks["passed"].items()):
        row("checks" if i == 0 else "", f"{'passed' if i == 0 else '':<9}{n}  {what}")
    for i, (n, what) in enumerate(checks["not_run"].items()):
        row("", f"{'not run' if i == 0 else '':<9}{n}  {what}")
    row("", f"{'':<9}   ({checks['not_run_reason']})")

    out.append("")
    out.append("custody     owner      count")

    def owner(name: str, count: int, detail: str = "") -> None:
        row("", f"{name:<9}{count:>7}" + (f"   {detail}" if detail else ""))

    owner("spare", c["spare"])
    for name in ("ledger", "replay"):
        states = {k: v for k, v in c[name].items() if k != "total"}
        owner(name, c[name]["total"], ", ".join(f"{k} {v}" for k, v in states.items()))
    owner("trained", c["trained"], ", ".join(f"epoch {e}: {n}" for e, n in c["trained_by_epoch"].items()))
    owner("dropped", c["dropped"], ", ".join(f"{k} {v}" for k, v in c["dropped_by_reason"].items()))
    d = c["dataset"]
    epochs = "unbounded epochs" if d["epochs"] is None else f"{d['epochs']} epoch(s)"
    left = "unbounded" if c["source_left"] is None else f"{c['source_left']} left"
    row("", f"{'source':<9}{'':>7}   from {c['cursor_key']}: {left} ({d['n_rows']} rows x {epochs}, seed {d['seed']})")
    row("", f"{'cursor':<9}{c['cursor_key']:>7}")
    row("", f"{'version':<9}{c['version']:>7}")
    if c["shortfall"]:
        row("", f"{'shortfall':<9}{'':>7}   " + ", ".join(f"step {s}: {n}" for s, n in c["shortfall"].items()))
    by_ref = rep["rows_by_reference"]
    row("", f"{'rows':<9}{rep['rows']:>7}   rows of sealed attempts: {by_ref} named in the row log (read when "
            "first needed)" + ("" if alone else f", {rep['rows'] - by_ref} copied into the checkpoint"))
    if rep["partial_generations"]:
        row("", f"{'partial':<9}{rep['partial_generations']:>7}   sibling(s) cut off mid-generation, continued from "
                f"their {rep['partial_tokens']} token(s) (recovery.partial: resume)")
    if rep["turns"]:
        row("", f"{'turns':<9}{rep['turns']:>7}   finished turn(s) of multi-turn episodes in flight, continued "
                "after (the turn in flight is generated again)")

    out.append("")
    if j is None:
        out.append("restore plan (what a restart from this checkpoint does)")
    else:
        back = j["steps_taken_back"]
        whence = "replayed from the journal alone, no checkpoint" if alone else "after this checkpoint"
        out.append(f"journal     {j['events']} event(s) {whence} (seq {j['after_seq'] + 1}-"
                   f"{j['last_seq']}, {j['processes']} process(es)), {j['seals']} sealed row(s) in the row log"
                   + (f", a torn tail of {j['torn_tail_bytes']} byte(s) (never durable)" if j["torn_tail_bytes"] else ""))
        if back:
            out.append(f"{'':<12}steps {back[0]}-{back[1]} taken back: their {j['groups_returned']} group(s) are "
                       "trained again from their rows")
        out.append("restore plan (what a restart does: " + (
            "the journal replayed onto the empty ledger of its dataset)" if alone else
            "this checkpoint with the journal's tail replayed)"))
    for line in (rep["plan"] if j is None else j["plan"])["lines"]:
        row("", line)

    out.append("")
    out.append(f"checkpoints in {store['root']}" + (
        "" if alone else " (unverified but for the one inspected; `rollkeep audit --all` checks each)"))
    if store["latest_problem"] is not None:
        row("", f"LATEST is unusable: {store['latest_problem']}")
    for name in store["checkpoints"]:
        marks = [m for m, on in (("LATEST", name == store["latest"]),
                                 ("inspected", name == rep["checkpoint"])) if on]
        row("", name + (f"  <- {', '.join(marks)}" if marks else ""))
    if not store["checkpoints"]:
        row("", "(none)")
    return "\n".join(out)


def failure(err: RollkeepError, code: int) -> dict[str, Any]:
    """A failed check, for `--json`."""
    return {
        "ok": False,
        "exit_code": code,
        "error": {
            "type": type(err).__name__,
            "restore_step": getattr(err, "step", None),
            "message": str(err),
            "what": err.what,
            "path": err.path,
            "field": err.field,
            "expected": err.expected,
            "found": err.found,
            "remedy": err.remedy,
        },
    }


def run(args: argparse.Namespace) -> int:
    try:
        rep = build(resolve(args.path))
    except RollkeepError as err:
        if args.json:
            from rollkeep.cli import exit_code

            print(json.dumps(failure(err, exit_code(err)), indent=2))
        raise
    sys.stdout.write((json.dumps(rep, indent=2) if args.json else render(rep)) + "\n")
    return 0

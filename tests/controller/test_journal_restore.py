"""Resuming from the journal: a run stopped before its first checkpoint, or twice after the
same one, resumes from what its journal kept and ends exactly-once (and, in deterministic
mode, byte-identical to a run never stopped); a journal that does not belong to the
resumed lineage is set aside, never deleted; a damaged record stops `train` (exit 3)
before anything on disk changes, while a torn tail is only the end of the journal.

Journal contents are deterministic: every stop is graceful (SIGTERM at a crash point) with
`checkpoint.on_shutdown=false`, so the journal holds everything after the last checkpoint.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import struct
from pathlib import Path

import pytest
from hostile import main_child
from run_harness import (
    DEFAULTS,
    FAST,
    STOPPED,
    check,
    config,
    final_sha,
    killed,
    run_child,
    run_to_end,
    trace_lines,
)

from rollkeep.cli import main
from rollkeep.core.checkpoint.manifest import read_manifest
from rollkeep.core.checkpoint.rowindex import ROWS_INDEX, decode_index, referenced_segments
from rollkeep.core.checkpoint.store import CheckpointStore
from rollkeep.core.journal.segments import HEADER_SIZE
from rollkeep.core.rowlog.segments import segment_path as rowlog_segment_path
from rollkeep.core.rowlog.segments import segments as rowlog_segments

NO_FINAL = "checkpoint.on_shutdown=false"
DET = ["deterministic=true", "rollout.on_dropped_prompt=shrink", "sampler.name=in_order"]


def stop(cfg, at: str) -> None:
    assert run_child(cfg, at, crash_signal="TERM") == STOPPED


def restored_events(cfg) -> list[dict]:
    return [x for x in trace_lines(cfg) if x["event"] == "restored"]


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def segments(run: Path, name: str) -> list[Path]:
    return sorted((run / name).iterdir())


def reference(tmp_path, *over: str) -> str:
    ref = config(tmp_path / "reference", *over)
    run_to_end(ref)
    return final_sha(ref)


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_the_journal_alone(tmp_path) -> None:
    over = [*DET, "checkpoint.every_steps=100", NO_FINAL]
    sha = reference(tmp_path, *over)
    cfg = config(tmp_path / "run", *over)
    stop(cfg, "ledger.step_committed:5")
    assert not (Path(cfg.run_dir) / "checkpoints").exists() or not any((Path(cfg.run_dir) / "checkpoints").glob(
        "step_*")), "the stop must come before the first checkpoint"
    run_to_end(cfg)
    (restored,) = restored_events(cfg)
    assert restored["checkpoint"] is None and restored["journal_events_replayed"] > 0
    check(cfg, sha)


def test_two_stops_after_the_same_checkpoint_replay_both_processes_records(tmp_path) -> None:
    over = [*DET, "checkpoint.every_steps=4", NO_FINAL]
    sha = reference(tmp_path, *over)
    cfg = config(tmp_path / "run", *over)
    stop(cfg, "ledger.step_committed:5")  # after the step-4 checkpoint
    stop(cfg, "ledger.step_committed:1")  # the resumed process's first commit, before step 8's
    run_to_end(cfg)
    first, second = restored_events(cfg)
    assert first["checkpoint"] == second["checkpoint"] == "step_000004"
    assert second["journal_events_replayed"] > first["journal_events_replayed"] > 0
    check(cfg, sha)


def test_resume_from_an_older_checkpoint_sets_the_journal_aside(tmp_path, capsys) -> None:
    over = ["checkpoint.keep_last=10", NO_FINAL]
    cfg = config(tmp_path / "run", *over)
    run = Path(cfg.run_dir)
    stop(cfg, "ledger.step_committed:5")  # checkpoints 2 and 4, and a tail after 4
    journal, rows = [p.name for p in segments(run, "journal")], [p.name for p in segments(run, "rows")]
    assert journal and rows

    code = main(["train", DEFAULTS, *FAST, f"run_dir={run}", *over, "--resume-from", "step_000002"])
    assert code == 0, capsys.readouterr().err
    (j_aside,) = run.glob("journal-abandoned-*")
    assert [p.name for p in sorted(j_aside.iterdir())] == journal
    assert not list(run.glob("rows-abandoned-*")), "the row log stays: checkpoints name rows in it"
    assert_named_segments_exist(run)  # the set-aside checkpoints stay restorable
    restored = restored_events(cfg)[-1]
    assert restored["checkpoint"] == "step_000002" and restored.get("journal_events_replayed", 0) == 0
    assert trace_lines(cfg)[-1]["event"] == "run_finished"
    check(cfg)  # the verifier follows the lineage through the abandoned checkpoints


def test_a_checkpoint_killed_before_latest_moved_keeps_the_journal_tail(tmp_path) -> None:
    """The red chaos run: killed after step 4's directory was renamed in and before LATEST
    named it, the next start took that unpublished directory for a newer checkpoint, set
    the journal aside (its tail lost), and a kill before the new journal's first flush
    left an empty journal under step 2's position: every later start refused (exit 3)."""
    sha = reference(tmp_path, *DET)
    cfg = config(tmp_path / "run", *DET)
    run = Path(cfg.run_dir)
    assert killed(run_child(cfg, "publish.dir_renamed:2"))
    assert CheckpointStore(run / "checkpoints").latest() == "step_000002"
    assert killed(run_child(cfg, "ledger.taken:1"))
    run_to_end(cfg)
    assert not list(run.glob("journal-abandoned-*"))
    first, second = restored_events(cfg)
    # the start after the kill took LATEST (step 2), not the unpublished step-4 directory;
    # the process it started may then publish step 4 itself before its first `taken` (its
    # replayed groups can fill steps 3 and 4: whether they do first is timing; then the
    # journal may hold nothing past step 4's cut when the kill comes)
    assert first["checkpoint"] == "step_000002" and second["checkpoint"] in ("step_000002", "step_000004")
    assert first["journal_events_replayed"] > 0
    assert second["journal_events_replayed"] > 0 or second["checkpoint"] == "step_000004"
    check(cfg, sha)


def test_a_resume_from_killed_before_its_first_flush_resumes_from_the_named_checkpoint(tmp_path, capsys):
    """The same empty journal after a finished `--resume-from`: the new journal begins with
    a segment at the named checkpoint's position before LATEST moves to it."""
    over = ["checkpoint.keep_last=10", NO_FINAL]
    cfg = config(tmp_path / "run", *over)
    run = Path(cfg.run_dir)
    stop(cfg, "ledger.step_committed:5")  # checkpoints 2 and 4, and a tail after 4
    resume = ["train", DEFAULTS, *FAST, f"run_dir={run}", *over, "--resume-from", "step_000002"]
    assert killed(main_child(resume, "ledger.taken:1"))
    assert [p.name for p in segments(run, "journal")] and list(run.glob("journal-abandoned-*"))
    run_to_end(cfg)  # a plain start now
    restored = restored_events(cfg)
    assert [r["checkpoint"] for r in restored] == ["step_000002", "step_000002"]
    assert restored[-1].get("journal_events_replayed", 0) == 0  # the new journal held no record
    check(cfg)


def test_a_resume_with_the_journal_off_leaves_it_and_a_later_one_sets_it_aside(tmp_path) -> None:
    cfg = config(tmp_path / "run", NO_FINAL)
    run = Path(cfg.run_dir)
    stop(cfg, "ledger.step_committed:5")  # checkpoint 4 and a tail after it
    before = digest(run / "journal"), digest(run / "rows")

    off = config(tmp_path / "run", "journal.enabled=false")  # its graceful stop checkpoints (journal off)
    stop(off, "ledger.step_committed:1")
    assert restored_events(off)[-1].get("journal_events_replayed", 0) == 0
    assert (digest(run / "journal"), digest(run / "rows")) == before, "the journal was left as it is"

    run_to_end(config(tmp_path / "run"))  # journal on, from a checkpoint written with it off
    assert restored_events(cfg)[-1].get("journal_events_replayed", 0) == 0
    (j_aside,) = run.glob("journal-abandoned-*")
    assert digest(j_aside) == before[0]
    assert_named_segments_exist(run)
    check(cfg)


def assert_named_segments_exist(run: Path) -> None:
    """Every row segment a checkpoint (kept or set aside) names is still there, and no
    segment older than the newest checkpoint's cut is kept that none names."""
    store = CheckpointStore(run / "checkpoints")
    named = referenced_segments(store)
    present = {n for n, _ in rowlog_segments(run / "rows")}
    assert named is not None and named <= present, (named, present)
    newest = read_manifest(run / "checkpoints" / store.latest())
    older = {n for n in present if n < newest["journal"]["rows_segment"]}
    assert older <= named, f"segments {sorted(older - named)} are named by no checkpoint"


def test_a_journal_off_resume_finishes_exactly_once(tmp_path) -> None:
    cfg = config(tmp_path / "run", NO_FINAL)
    stop(cfg, "ledger.step_committed:5")
    before = digest(Path(cfg.run_dir) / "journal")
    off = config(tmp_path / "run", "journal.enabled=false")
    run_to_end(off)
    assert restored_events(off)[-1].get("journal_events_replayed", 0) == 0
    assert digest(Path(cfg.run_dir) / "journal") == before
    check(off)


def test_a_damaged_record_stops_train_with_exit_3_and_changes_nothing(tmp_path, capsys) -> None:
    cfg = config(tmp_path / "run", "checkpoint.every_steps=100", NO_FINAL)
    run = Path(cfg.run_dir)
    stop(cfg, "ledger.step_committed:5")
    seg = segments(run, "journal")[0]
    data = bytearray(seg.read_bytes())
    (len1,) = struct.unpack_from("<I", data, HEADER_SIZE + 12)
    second = HEADER_SIZE + 24 + len1
    assert len(data) > second + 24 + 2 * (24 + 8), "valid records must follow the damaged one"
    data[second + 24] ^= 0xFF  # the second record's first payload byte
    seg.write_bytes(bytes(data))
    before = digest(run)

    code = main(["train", DEFAULTS, *FAST, f"run_dir={run}", "checkpoint.every_steps=100", NO_FINAL])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "in the middle of a segment" in err and "record seq 2" in err and f"at byte {second}" in err, err
    assert seg.name in err and "Traceback" not in err
    assert digest(run) == before


def test_a_torn_tail_is_the_end_of_the_journal(tmp_path) -> None:
    cfg = config(tmp_path / "run", "checkpoint.every_steps=100", NO_FINAL)
    stop(cfg, "ledger.step_committed:5")
    seg = segments(Path(cfg.run_dir), "journal")[-1]
    seg.write_bytes(seg.read_bytes()[:-5])
    run_to_end(cfg)
    (restored,) = restored_events(cfg)
    assert restored["checkpoint"] is None and restored["journal_events_replayed"] > 0
    check(cfg)


def test_cursor_only_writes_no_journal(tmp_path) -> None:
    cfg = config(tmp_path / "run", "recovery.mode=cursor_only")
    run_to_end(cfg)
    assert not (Path(cfg.run_dir) / "journal").exists() and not (Path(cfg.run_dir) / "rows").exists()


@pytest.mark.parametrize("name", ["journal", "rows"])
@pytest.mark.parametrize("kind", ["fifo", "file", "symlink"])
def test_a_journal_or_row_log_that_is_not_a_directory_is_refused_before_anything_changes(
        tmp_path, capsys, name, kind) -> None:
    cfg = config(tmp_path / "run", "checkpoint.every_steps=2")
    run = Path(cfg.run_dir)
    run_to_end(cfg)
    shutil.rmtree(run / name)
    if kind == "fifo":
        os.mkfifo(run / name)
    elif kind == "file":
        (run / name).write_bytes(b"not a directory")
    else:
        (tmp_path / "elsewhere").mkdir()
        (run / name).symlink_to(tmp_path / "elsewhere")
    before = digest(run)
    code = main(["train", DEFAULTS, *FAST, f"run_dir={run}", "checkpoint.every_steps=2", "train.total_steps=14"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert f"RUN_DIR/{name} is not a directory" in err or "journal directory is not a directory" in err, err
    assert "Traceback" not in err and digest(run) == before


def test_a_disk_error_in_the_journal_stops_the_run_with_exit_5_and_it_resumes(tmp_path, monkeypatch, capsys) -> None:
    from rollkeep.core.journal import segments as journal

    real = journal.JournalWriter._write
    calls = [0]

    def failing(self, frames, first):
        calls[0] += 1
        if calls[0] == 3:  # a group commit in the middle of the run: the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, frames, first)

    monkeypatch.setattr(journal.JournalWriter, "_write", failing)
    cfg = config(tmp_path / "run", "checkpoint.every_steps=2", "engine.latency_ms=5")
    run = Path(cfg.run_dir)
    args = ["train", DEFAULTS, *FAST, f"run_dir={run}", "checkpoint.every_steps=2", "engine.latency_ms=5"]
    assert main(args) == 5
    err = capsys.readouterr().err
    assert "No space left on device" in err and "journal" in err and "Traceback" not in err, err
    monkeypatch.undo()
    assert main(args) == 0  # what was flushed before the error stands; the run ends exactly once
    check(cfg)


def test_a_journaled_run_copies_no_row_into_its_checkpoints_and_keeps_what_they_name(tmp_path, capsys) -> None:
    """Every checkpoint names its rows in the row log (rows.index), none is copied; after
    kills and resumes the retained checkpoints still pass `rollkeep audit` (which reads
    every row they name), and no older segment is kept that none of them names."""
    cfg = config(tmp_path / "run", "checkpoint.keep_last=2", "checkpoint.every_steps=2")
    run = Path(cfg.run_dir)
    assert killed(run_child(cfg, "ledger.step_committed:5"))
    assert killed(run_child(cfg, "ledger.step_committed:4"))  # the 4th commit of the resumed run
    run_to_end(cfg)
    store = CheckpointStore(run / "checkpoints")
    names = store.list()
    assert len(names) == 2
    named = 0
    for name in names:
        rows = store.open(name).manifest["rows"]
        assert rows["copied"] == 0, (name, rows)
        named += rows["by_reference"]
        assert main(["audit", str(run / "checkpoints" / name)]) == 0, capsys.readouterr().err
    assert named > 0, "the run's checkpoints named rows in flight"
    assert_named_segments_exist(run)
    check(cfg)


def test_a_named_row_damaged_on_disk_stops_the_resumed_run_when_it_is_read(tmp_path, capsys) -> None:
    """A restore does not read rows by reference; the first read of a damaged one refuses it
    (exit 3, naming the segment and offset) before it is trained on."""
    cfg = config(tmp_path / "run", NO_FINAL)
    run = Path(cfg.run_dir)
    stop(cfg, "ledger.step_committed:5")  # checkpoint 4 names the rows in flight
    index = decode_index(CheckpointStore(run / "checkpoints").open().read(ROWS_INDEX)).rows
    rid, loc = next(iter(index.items()))
    seg = rowlog_segment_path(run / "rows", loc.segment)
    data = bytearray(seg.read_bytes())
    data[loc.offset + loc.length - 1] ^= 0x01
    seg.write_bytes(bytes(data))
    assert main(["inspect", str(run)]) == 0, "inspect, like a restore, does not read the row"
    capsys.readouterr()
    assert main(["audit", str(run)]) == 3, "audit reads every row the checkpoint names"
    assert f"segment {loc.segment}, offset {loc.offset}" in capsys.readouterr().err
    code = main(["train", DEFAULTS, *FAST, f"run_dir={run}", NO_FINAL])
    err = capsys.readouterr().err
    assert code == 3, err
    assert f"segment {loc.segment}, offset {loc.offset}" in err and "Traceback" not in err
    lines = trace_lines(cfg)
    resumed = lines[max(i for i, x in enumerate(lines) if x["event"] == "run_started"):]
    prompt = [int(v) for v in rid.group_id[1:].split(".")]  # "e0.7" -> [0, 7]
    assert not [x for x in resumed if x["event"] == "step_committed" and prompt in x["prompts"]], \
        "the damaged row was never trained on"
    assert [x for x in resumed if x["event"] == "run_failed"]

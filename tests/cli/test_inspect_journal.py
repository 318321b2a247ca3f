"""`rollkeep inspect` and `rollkeep audit` on a run killed before its first checkpoint
(issue 30, D8): the run has only its journal, and `rollkeep train` resumes from it, so
inspect prints the plan of that resume (the journal replayed onto the empty ledger) and
audit checks the journal (every record, the rows its seals name, the replay); a damaged
journal is exit 3 from both, as from `train`; nothing on disk changes.

The run is a real `rollkeep train configs/toy.yaml` process SIGKILLed at a crash point,
once per module; every test works on its own copy.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hostile import tree

import rollkeep
from rollkeep.cli import main
from rollkeep.core.journal.durable import encode_restart
from rollkeep.core.journal.segments import HEADER_SIZE, JournalWriter
from rollkeep.core.rollout.source import DatasetId

ROOT = Path(__file__).resolve().parents[2]
SRC = str(Path(rollkeep.__file__).resolve().parents[1])  # the code this test imports
JOB = ["train.total_steps=14", "checkpoint.every_steps=100", "engine.latency_ms=25", "logger.progress=none"]


def rollkeep_cli(*argv: str, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "ROLLKEEP_CRASH_AT"}
    env["PYTHONPATH"] = SRC
    if crash_at is not None:
        env["ROLLKEEP_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, "-m", "rollkeep", *argv], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def train(run: Path, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    return rollkeep_cli("train", "configs/toy.yaml", f"run_dir={run}", *JOB, crash_at=crash_at)


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """The toy job SIGKILLed after its 4th step, its first checkpoint due at step 100."""
    run = tmp_path_factory.mktemp("d8") / "run"
    p = train(run, "train.after_commit:4")
    assert p.returncode == -9, p.stderr
    assert not (run / "checkpoints").exists() and any((run / "journal").iterdir())
    return run


@pytest.fixture
def run(killed, tmp_path) -> Path:
    return Path(shutil.copytree(killed, tmp_path / "run", symlinks=True))


def restored_event(run: Path) -> dict:
    lines = [json.loads(ln) for ln in (run / "trace.jsonl").read_text().splitlines() if ln.strip()]
    [ev] = [x for x in lines if x["event"] == "restored"]
    return ev


def flip_second_record(run: Path) -> Path:
    """A byte of the second record's payload flipped, valid records after it (as in
    tests/controller/test_journal_restore.py): damage, not a torn tail."""
    [seg] = sorted((run / "journal").iterdir())
    data = bytearray(seg.read_bytes())
    (len1,) = struct.unpack_from("<I", data, HEADER_SIZE + 12)
    second = HEADER_SIZE + 24 + len1
    assert len(data) > second + 24 + 2 * (24 + 8), "valid records must follow the damaged one"
    data[second + 24] ^= 0xFF
    seg.write_bytes(bytes(data))
    return seg


def test_inspect_prints_the_plan_train_then_resumes_with(run) -> None:
    before = tree(run)
    p = rollkeep_cli("inspect", "--json", str(run))
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    j, plan = rep["journal"], rep["plan"]
    assert rep["ok"] and rep["checkpoint"] is None and rep["via"] == "journal" and j["alone"]
    assert j["after_seq"] == 0 and j["events"] > 0 and j["seals"] > 0 and j["processes"] == 1
    assert j["steps_taken_back"][0] == 1 and rep["step"] == 0  # no trainer state survives the kill
    assert plan["groups_reused"] >= j["groups_returned"] > 0
    assert rep["custody"]["replay"]["total"] == plan["groups_reused"] and rep["custody"]["trained"] == 0
    assert set(rep["checks"]["not_run"]) == {"7", "8"}
    assert rep["store"]["checkpoints"] == [] and rep["meta"]["dataset"]["n_rows"] == 96
    assert any(f.startswith("journal/") for f in rep["files"]) and any(f.startswith("rows/") for f in rep["files"])

    text = rollkeep_cli("inspect", str(run))
    assert text.returncode == 0, text.stderr
    assert f"{j['events']} event(s) replayed from the journal alone, no checkpoint" in text.stdout
    assert "checkpoint  none: the run never published one" in text.stdout
    for line in plan["lines"]:
        assert line in text.stdout
    assert tree(run) == before  # inspect modified nothing

    # What `train` then does: the same events replayed, the same groups and siblings reused.
    assert train(run, "train.after_commit:1").returncode == -9
    ev = restored_event(run)
    assert ev["checkpoint"] is None and ev["journal_events_replayed"] == j["events"]
    for key in ("groups_reused", "siblings_reused", "siblings_resent", "siblings_pending", "groups_readmitted"):
        assert ev[key] == plan[key], key
    # the trace's count is every sibling sent out again (`schedule.restart.restored_fields`):
    # in flight at the cut, discarded from an all-or-nothing group, or waiting after a failed
    # or abandoned attempt (which of these a kill leaves is timing; their sum is the plan's)
    assert ev["siblings_regenerated"] == (plan["siblings_regenerated"] + plan["siblings_discarded"]
                                          + plan["siblings_resent"])


def test_audit_checks_the_journal_and_changes_nothing(run) -> None:
    before = tree(run)
    j = json.loads(rollkeep_cli("inspect", "--json", str(run)).stdout)["journal"]
    for argv in (["audit", str(run)], ["audit", "--all", str(run)]):
        p = rollkeep_cli(*argv)
        assert p.returncode == 0, p.stderr
        assert p.stdout.startswith(f"journal (no checkpoint): ok ({j['events']} event(s), {j['seals']} row(s) "
                                   "read and verified, replays onto the empty ledger"), p.stdout
        assert p.stderr == ""
    assert tree(run) == before


def test_audit_of_a_journal_only_run_says_train_resumes_from_the_journal_as_it_then_does(run) -> None:
    """Not "starts this run from scratch": audit names the resume `train` then performs."""
    p = rollkeep_cli("audit", str(run))
    assert p.returncode == 0, p.stderr
    said = p.stdout.splitlines()[1]
    assert said.startswith("  `rollkeep train` resumes this run from its journal at step 0, not from scratch: "), said
    assert "from scratch" not in said.replace("not from scratch", "")
    assert train(run, "train.after_commit:1").returncode == -9
    ev = restored_event(run)
    assert ev["checkpoint"] is None
    assert (f"it reuses {ev['groups_reused']} finished group(s) and {ev['siblings_reused']} sealed sibling(s), "
            f"and sends out again only the {ev['siblings_regenerated']} sibling(s) it cannot reuse") in said
    assert "steps 1-" in said and "trained again from their recorded rows" in said


def test_a_flipped_byte_in_a_middle_record_is_exit_3_from_inspect_audit_and_train(run) -> None:
    seg = flip_second_record(run)
    before = tree(run)
    for argv in (["audit", str(run)], ["audit", "--all", str(run)], ["inspect", str(run)]):
        p = rollkeep_cli(*argv)
        assert p.returncode == 3, (argv, p.stdout, p.stderr)
        assert "in the middle of a segment" in p.stderr and str(seg) in p.stderr, p.stderr
        assert "Traceback" not in p.stderr and p.stderr.startswith("error: ")
    js = rollkeep_cli("inspect", "--json", str(run))
    assert js.returncode == 3 and json.loads(js.stdout)["error"]["type"] == "JournalError"
    assert tree(run) == before
    t = train(run)  # train refuses it the same way
    assert t.returncode == 3 and "in the middle of a segment" in t.stderr, t.stderr
    assert tree(run) == before


def test_audit_reads_every_row_the_journal_names(run, capsys) -> None:
    """inspect, like a restore, leaves each row to its first read; audit reads them all."""
    [seg] = sorted((run / "rows").iterdir())
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside some row frame
    seg.write_bytes(bytes(data))
    before = tree(run)
    assert main(["inspect", str(run)]) == 0
    capsys.readouterr()
    assert main(["audit", str(run)]) == 3
    out, err = capsys.readouterr()
    assert out == "" and seg.name in err and "row" in err
    assert tree(run) == before


def test_a_torn_tail_is_the_end_of_the_journal(run, capsys) -> None:
    [seg] = sorted((run / "journal").iterdir())
    with open(seg, "r+b") as f:
        f.truncate(seg.stat().st_size - 5)  # the last record cut short, as a kill mid-write leaves it
    before = tree(run)
    assert main(["audit", str(run)]) == 0
    assert "torn tail" in capsys.readouterr().out
    assert main(["inspect", str(run)]) == 0
    assert "a torn tail of" in capsys.readouterr().out
    assert tree(run) == before


def test_an_empty_checkpoints_dir_or_an_unpublished_step_dir_is_still_the_journal(run, capsys) -> None:
    """`train` resumes from the journal when no checkpoint was ever published: with an
    empty checkpoints/, or a step_* directory a kill inside the first publication left."""
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    for path in (run, run / "checkpoints"):
        assert main(["inspect", "--json", str(path)]) == 0
        assert json.loads(capsys.readouterr().out)["journal"]["alone"]
    assert main(["audit", str(run)]) == 0
    assert capsys.readouterr().out.startswith("journal (no checkpoint): ok")


def test_a_step_dir_without_latest_after_a_publication_is_refused_as_train_refuses_it(run, capsys) -> None:
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    with open(run / "trace.jsonl", "a") as f:  # the trace says a checkpoint was published
        f.write('{"t":0,"run_id":"x","event":"checkpoint_published","step":2}\n')
    before = tree(run)
    assert main(["inspect", str(run)]) == 3
    assert "LATEST is missing while checkpoint directories exist" in capsys.readouterr().err
    assert main(["audit", str(run)]) == 3
    capsys.readouterr()
    assert tree(run) == before


def test_a_rows_dir_that_is_a_fifo_is_exit_3(run, capsys) -> None:
    shutil.rmtree(run / "rows")
    os.mkfifo(run / "rows")
    for cmd in ("inspect", "audit"):
        assert main([cmd, str(run)]) == 3
        assert "RUN_DIR/rows is not a directory" in capsys.readouterr().err


def _run_dir_with_config(tmp_path: Path) -> Path:
    run = tmp_path / "fresh"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    return run


@pytest.mark.parametrize("journal", ["none", "restart markers only"])
def test_a_run_dir_with_no_recorded_work_keeps_the_nothing_to_inspect_message(tmp_path, capsys, journal) -> None:
    run = _run_dir_with_config(tmp_path)
    if journal != "none":  # a process that started and was killed before its first event
        w = JournalWriter(run / "journal", 1)
        w.append(encode_restart(0, DatasetId(96, 0, 3, "96:x")))
        w.append(encode_restart(0, DatasetId(96, 0, 3, "96:x")))
        w.close()
    before = tree(run)
    for argv in (["inspect", str(run)], ["audit", str(run)], ["audit", "--all", str(run)]):
        assert main(argv) == 3
        err = capsys.readouterr().err
        assert "it never published a checkpoint" in err and "starts this run from scratch" in err
    assert tree(run) == before

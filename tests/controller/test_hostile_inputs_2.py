"""Regression tests for the second round of hostile inputs (`../shared/findings/
hostile-inputs-2.md` and `journal-dataset.md`, issue "refuse what cannot be proven, round
two"): the journal and its binding to a checkpoint, the dataset on journal restores,
`--resume-from` with a journal, a resume with the journal off, and numbers no group's
arithmetic can hold. Each test is named after the defect it pins (D3, D5, D6, D7, D9, D10,
D14, and the dataset cases). A refusal is the documented exit code, one paragraph, no
traceback and nothing on disk changed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hostile import edit_manifest, main_child, refuses, rehash, rollkeep, train_args, tree
from run_harness import STOPPED, check, config, final_sha, killed, run_child, trace_lines

from rollkeep.cli import main
from rollkeep.controller.startup import load_trainer
from rollkeep.core.checkpoint.cut import cut, write_checkpoint
from rollkeep.core.checkpoint.manifest import read_manifest
from rollkeep.core.checkpoint.rowindex import ROWS_INDEX
from rollkeep.core.checkpoint.store import CheckpointStore
from rollkeep.core.custody.ledger import Ledger
from rollkeep.core.errors import CheckpointError, UserInputError
from rollkeep.core.restore.chain import restore_chain
from rollkeep.core.restore.start import journal_tail
from rollkeep.core.rollout.datasets import JsonlDataset
from rollkeep.core.rollout.rowstore import RowStore
from rollkeep.core.rollout.source import PromptSource

pytestmark = pytest.mark.slow

N_ROWS = 60
TAIL = ["train.total_steps=14", "checkpoint.every_steps=3", "checkpoint.keep_last=10"]
# The fixtures stop gracefully with no final checkpoint, so the journal holds everything
# after the last checkpoint, whatever the timing (a SIGKILL may come before the first flush).
NO_FINAL = "checkpoint.on_shutdown=false"
DATA = "data.jsonl"  # relative to the fixture's directory, where its runs run


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def fixture_run(root: Path, *over: str, stop_at: str) -> None:
    """A run of `root`/run on `root`/data.jsonl, stopped gracefully at `stop_at`."""
    write_rows(root / DATA, [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(N_ROWS)])
    cwd = os.getcwd()
    os.chdir(root)  # the child inherits it
    try:
        cfg = config(root / "run", f"data.path={DATA}", *over, NO_FINAL)
        assert run_child(cfg, stop_at, crash_signal="TERM") == STOPPED
    finally:
        os.chdir(cwd)


def continued_groups(run: Path, data: Path, checkpoint: bool) -> tuple[set[int], set[int]]:
    """(idx of every group the resumed run continues, idx of those only the journal's tail
    holds): what `train` would replay, read with the functions it uses."""
    source = PromptSource(JsonlDataset(data), seed=0, epochs=1)
    restored = restore_chain(CheckpointStore(run / "checkpoints"), source=source, config=None) if checkpoint else None
    tail, _, _ = journal_tail(run, restored, newest=True, source=source)
    assert tail is not None, "the fixture must leave a journal tail"
    base = set() if restored is None else {r.idx for r in restored.ledger.groups.values()}
    every = {r.idx for r in tail.state.groups.values()}
    return every, every - base


@pytest.fixture(scope="module")
def journal_only(tmp_path_factory) -> Path:
    """A run killed before its first checkpoint, on a JSONL dataset: the journal is all it has."""
    root = tmp_path_factory.mktemp("jonly")
    fixture_run(root, "checkpoint.every_steps=100", stop_at="ledger.step_committed:3")
    assert not (root / "run" / "checkpoints" / "LATEST").exists()
    return root


@pytest.fixture(scope="module")
def with_tail(tmp_path_factory) -> Path:
    """Checkpoints 3, 6 and 9, then a journal tail: killed after step 11's commit."""
    root = tmp_path_factory.mktemp("tail")
    fixture_run(root, *TAIL, stop_at="train.after_commit:11")
    assert (root / "run" / "checkpoints" / "LATEST").read_text().strip() == "step_000009"
    return root


@pytest.fixture
def case(tmp_path, monkeypatch):
    """Copy a fixture (its run and its dataset) and work in the copy: `data.path` is
    relative (a semantic key: the copy's run must read the same path)."""

    def copy(fixture: Path) -> tuple[Path, Path]:
        shutil.copytree(fixture, tmp_path / "case", symlinks=True)
        monkeypatch.chdir(tmp_path / "case")
        return tmp_path / "case" / "run", tmp_path / "case" / DATA

    return copy


def args(run: Path, *over: str) -> list[str]:
    return train_args(run, f"data.path={DATA}", *over)


# -- the dataset on journal restores ----------------------------------------------------------


@pytest.mark.parametrize("change, message", [
    ("edit", "no longer match the dataset"),
    ("reorder", "no longer match the dataset"),
    ("shrink", "different number of rows"),
])
def test_a_journal_only_resume_checks_the_dataset_like_a_checkpoint(journal_only, case, capsys, change,
                                                                     message) -> None:
    """Found: an edited or reordered dataset was accepted (exit 0, trained on generations of
    the old text), a shrunk one was exit 4 (the custody-bug code) with a wrong remedy."""
    run, data = case(journal_only)
    groups, _ = continued_groups(run, data, checkpoint=False)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    if change == "edit":
        for i in groups:
            rows[i]["prompt"] += " "
    elif change == "reorder":
        rows.reverse()
    else:
        rows = rows[:-4]
    write_rows(data, rows)
    err = refuses(capsys, args(run, "checkpoint.every_steps=100"), 3, run)
    assert message in err
    if change != "shrink":
        assert "row_fingerprint" in err and "e0." in err  # the group and its row are named


def test_a_journal_only_resume_checks_the_dataset_fingerprint(journal_only, case, capsys) -> None:
    """A row no continued group reads was edited: the fingerprint the first process recorded
    in the journal says so (it had none to compare with); --allow-dataset-change accepts it."""
    run, data = case(journal_only)
    groups, _ = continued_groups(run, data, checkpoint=False)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    untouched = next(i for i in range(N_ROWS) if i not in groups)
    rows[untouched]["answer"] = "edited"
    write_rows(data, rows)
    err = refuses(capsys, args(run, "checkpoint.every_steps=100"), 3, run)
    assert "content changed" in err and "--allow-dataset-change" in err
    assert main([*args(run, "checkpoint.every_steps=100"), "--allow-dataset-change"]) == 0
    check(config(run, f"data.path={DATA}", "checkpoint.every_steps=100"))


@pytest.mark.parametrize("allow", [False, True])
def test_an_edited_row_of_a_group_only_the_tail_holds_is_refused_naming_it(with_tail, case, capsys,
                                                                           allow) -> None:
    """Found: restore step 7 checked the checkpoint's groups only, so the message blamed rows
    not in flight, and --allow-dataset-change accepted an edited row of a tail-only group
    that it refuses for a checkpoint group."""
    run, data = case(with_tail)
    _, tail_only = continued_groups(run, data, checkpoint=True)
    assert tail_only, "the fixture's tail must hold groups the checkpoint does not"
    idx = min(tail_only)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[idx]["prompt"] = "edited"
    write_rows(data, rows)
    err = refuses(capsys, args(run, *TAIL, *(["--allow-dataset-change"] if allow else [])), 3, run)
    assert "no longer match the dataset" in err and f"(idx {idx})" in err


# -- the journal and its binding to the checkpoint ---------------------------------------------


def test_d6_an_emptied_journal_under_a_checkpoint_that_counts_on_it_is_refused(with_tail, case, capsys):
    run, data = case(with_tail)
    for seg in (run / "journal").iterdir():
        seg.unlink()
    err = refuses(capsys, args(run, *TAIL), 3, run)
    assert "holds no segment" in err
    refuses(capsys, ["audit", str(run)], 3, run)


def _position(run: Path) -> dict:
    return read_manifest(run / "checkpoints" / "step_000009")["journal"]


@pytest.mark.parametrize("forged", [
    {"seq": -1}, {"seq": "x"}, {"seq": None}, {"seq": 1.5}, {"seq": []}, {"seq": True}, {}, "x", [], 7,
    {"rows_segment": -1}, {"extra": 1},
])
def test_d7_a_forged_journal_position_is_refused(with_tail, case, capsys, forged) -> None:
    """Found: tracebacks (exit 1) for -1, "x", null, [] and a missing seq; exit 4 for 1.5;
    audit 0 for a journal entry that is a string."""
    run, data = case(with_tail)
    ck = run / "checkpoints" / "step_000009"
    position = _position(run)
    value = {**position, **forged} if isinstance(forged, dict) and forged else forged
    if forged == {}:
        value = {"rows_segment": position["rows_segment"]}
    if "extra" in (forged if isinstance(forged, dict) else {}):
        value = {**position, "extra": 1}
    edit_manifest(ck, journal=value)
    err = refuses(capsys, args(run, *TAIL), 3, run)
    assert "journal position" in err
    refuses(capsys, ["audit", str(run)], 3, run)


def test_d7_a_journal_position_before_events_the_checkpoint_holds_is_refused_not_a_custody_bug(
        with_tail, case, capsys) -> None:
    """Found: exit 4 ("does not continue its ledger" is a refused restore, not our bug)."""
    run, data = case(with_tail)
    ck = run / "checkpoints" / "step_000009"
    position = _position(run)
    edit_manifest(ck, journal={**position, "seq": position["seq"] - 5})
    err = refuses(capsys, args(run, *TAIL), 3, run)
    assert "does not continue its ledger" in err


@pytest.mark.parametrize("offset", [2**63, 2**64 - 12])
def test_d7_a_rows_index_offset_that_overflows_is_refused(with_tail, case, capsys, offset) -> None:
    """Found: OverflowError tracebacks, at restore or at the first read of the row."""
    run, data = case(with_tail)
    ck = run / "checkpoints" / "step_000009"
    raw = msgspec.msgpack.decode((ck / ROWS_INDEX).read_bytes())
    offsets = np.frombuffer(raw[1][5], "<u8").copy()
    assert len(offsets), "the checkpoint must name rows in the row log"
    offsets[0] = offset
    raw[1][5] = offsets.tobytes()
    (ck / ROWS_INDEX).write_bytes(msgspec.msgpack.encode(raw))
    rehash(ck)
    err = refuses(capsys, args(run, *TAIL), 3, run)
    assert "offset is out of range" in err
    refuses(capsys, ["audit", str(run)], 3, run)


# -- --resume-from with a journal, and a resume with the journal off ----------------------------


def test_d3_a_kill_inside_resume_from_never_replays_the_abandoned_journal(with_tail, case, capsys) -> None:
    """Found: killed after LATEST was repointed and before the journal was set aside, the
    rerun replayed the abandoned lineage's tail onto the older checkpoint. Now the journal
    goes aside first: a plain start then refuses with the remedy, and the same
    --resume-from finishes and resumes exactly once from the named checkpoint."""
    run, data = case(with_tail)
    resume = [*args(run, *TAIL), "--resume-from", "step_000006"]
    assert killed(main_child(resume, "startup.journal_set_aside"))
    assert not (run / "journal").exists() and list(run.glob("journal-abandoned-*"))
    err = refuses(capsys, args(run, *TAIL), 3, run)
    assert "--resume-from" in err and "run it again" in err
    assert main(resume) == 0, capsys.readouterr().err
    restored = [x for x in trace_lines(config(run)) if x["event"] == "restored"][-1]
    assert restored["checkpoint"] == "step_000006" and restored.get("journal_events_replayed", 0) == 0
    check(config(run, f"data.path={DATA}", *TAIL))


@pytest.mark.parametrize("off", ["journal.enabled=false", "recovery.mode=cursor_only"])
def test_d9_a_journal_only_run_resumed_with_the_journal_off_is_refused(journal_only, case, capsys, off):
    """Found: a silent fresh start from step 0 over the journal's durable work."""
    run, data = case(journal_only)
    err = refuses(capsys, args(run, "checkpoint.every_steps=100", off), 3, run)
    assert "journal.enabled=true" in err


# -- a snapshot checkpoint that cannot be continued is refused before anything is written --------


def test_d10_snapshot_env_checkpoint_with_too_small_max_snapshot_bytes_is_refused_unchanged(tmp_path, capsys):
    """Found: exit 3, but only after `run_started`, `restored`, `run_failed` and a line of
    config-history.jsonl were appended."""
    env = ["env.factory=episode_envs:SnapCountEnv", "env.max_turns=3", "engine.latency_ms=2"]
    cfg = config(tmp_path / "run", *env, "train.total_steps=6", NO_FINAL)
    assert run_child(cfg, "ledger.turn_sealed:120", crash_signal="TERM") == STOPPED  # turns in the tail
    run = Path(cfg.run_dir)
    assert (run / "checkpoints" / "LATEST").exists()
    err = refuses(capsys, train_args(run, *env, "train.total_steps=6", "env.max_snapshot_bytes=1"), 3, run)
    assert "snapshot" in err


# -- numbers no group's arithmetic holds --------------------------------------------------------


@pytest.mark.parametrize("fn, extra", [("huge", []), ("big31", ["trainer.scale_rewards=none"])])
def test_d5_a_finite_but_huge_reward_is_a_data_failure_not_a_custody_bug(tmp_path, monkeypatch, fn, extra):
    """Found: ±1e308 (the group's mean overflows) and 1e31 unscaled ended the run with exit 4."""
    (tmp_path / "rt_rewards.py").write_text(
        "def huge(completion, row):\n    return 1e308 if len(completion) % 2 else -1e308\n"
        "def big31(completion, row):\n    return 1e31 * (1 + len(completion) % 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    code = main_child(train_args(run, f"reward.fn=rt_rewards:{fn}", "train.total_steps=2", *extra))
    assert code == 5, code  # the data ran out to failures: every prompt dropped, none a custody bug
    cfg = config(run)
    dropped = [x for x in trace_lines(cfg) if x["event"] == "dropped"]
    assert dropped and all("rewards must be finite and within" in x["reason"] for x in dropped)


# -- a trainer's files: what its own restore refuses is never published; load() reads only -------


def test_d14_a_save_that_declares_another_step_publishes_nothing(tmp_path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    ledger = Ledger(n_rows=4, seed=0, epochs=1)

    def save(d: Path) -> None:
        (d / "state.json").write_text(json.dumps({"rollkeep_step": 7}))

    with pytest.raises(CheckpointError, match="declares step 7; nothing was published"):
        write_checkpoint(store, cut(ledger, RowStore()), trainer_save=save, meta={}, keep_last=2)
    assert store.latest() is None and not any((tmp_path / "checkpoints").iterdir())


class _Writes:
    """A trainer whose load() changes the directory it was told only to read."""

    def __init__(self, how: str) -> None:
        self.how = how

    def load(self, dir: Path, *, step: int | None = None) -> None:
        if self.how == "write":
            (dir / "cache.bin").write_bytes(b"x")
        elif self.how == "delete":
            next(p for p in dir.iterdir() if p.is_file()).unlink()


@pytest.mark.parametrize("how", ["write", "delete"])
def test_d14_a_load_that_changes_trainer_dir_is_refused(tmp_path, how) -> None:
    cfg = config(tmp_path / "run", "train.total_steps=2", "checkpoint.every_steps=2")
    assert run_child(cfg) == 0
    restored = restore_chain(CheckpointStore(tmp_path / "run" / "checkpoints"), source=None, config=None)
    before = tree(tmp_path / "run")
    with pytest.raises(UserInputError, match="load\\(\\) changed checkpoint step_000002"):
        load_trainer(_Writes(how), restored)
    assert tree(tmp_path / "run") != before  # (what the trainer did; the message says what to do)
    load_trainer(_Writes("read"), restored)  # one that only reads passes


# -- rows of a lineage that no longer exists (recovery.lost_versions) ---------------------------

LOOKAHEAD = ["sampler.name=in_order", "sampler.max_lookahead_versions=1", "engine.latency_ms=5",
             "train.total_steps=14", "checkpoint.every_steps=100"]


def _resumed(cfg) -> dict:
    """Stop `cfg` at its 50th dispatch (after step 11's commit, with step 13's groups, admitted
    under version 11, in flight; no checkpoint: the journal holds everything), resume it to
    the end, and return the resumed run's `restored` event: steps 1-11 or 1-12 are redone."""
    assert run_child(cfg, "ledger.dispatched:50", crash_signal="TERM") == STOPPED
    assert run_child(cfg) == 0
    (restored,) = [x for x in trace_lines(cfg) if x["event"] == "restored"]
    assert restored["checkpoint"] is None and restored["steps_redone"][0] == 1 and restored["steps_redone"][1] >= 11
    return restored


def _ages(cfg) -> list[float]:
    run_id = [x for x in trace_lines(cfg) if x["event"] == "run_started"][-1]["run_id"]
    lines = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [m["batch_age"] for m in lines if m.get("run_id") == run_id and "batch_age" in m]


@pytest.mark.parametrize("mode", ["keep", "regenerate"])
def test_lost_versions_no_resumed_batch_is_older_than_the_window(tmp_path, mode) -> None:
    """Found: a resumed default job showed a batch age of 28 at lookahead 1: the groups the
    killed process had admitted for steps past the checkpoint generated their remaining
    siblings at once, under the checkpoint's weights, far behind their target step (here:
    step 13 at age 9). The bound is lookahead + 1: the engine may be a refit behind the
    trainer, in an uninterrupted run too."""
    cfg = config(tmp_path / "run", *LOOKAHEAD, NO_FINAL, f"recovery.lost_versions={mode}")
    restored = _resumed(cfg)
    assert restored["lost_versions"] == mode and restored["lost_version_rows"] > 0
    ages = _ages(cfg)
    assert len(ages) == 14 and all(0.0 <= a <= 1 + 1 for a in ages), ages
    abandoned = [x for x in trace_lines(cfg) if x["event"] == "abandoned" and x["reason"] == "lost version"]
    if mode == "regenerate":
        assert sum(len(x["generations"]) for x in abandoned) == restored["lost_version_rows"]
    else:
        assert not abandoned
    check(cfg)


def test_lost_versions_regenerated_in_deterministic_mode_end_byte_identical(tmp_path) -> None:
    det = ["deterministic=true", "rollout.on_dropped_prompt=shrink", *LOOKAHEAD, NO_FINAL]
    reference = config(tmp_path / "reference", *det)
    assert run_child(reference) == 0
    cfg = config(tmp_path / "run", *det, "recovery.lost_versions=regenerate")
    assert _resumed(cfg)["lost_version_rows"] > 0
    check(cfg, final_sha(reference))


def test_d12_prompts_run_out_to_failures_under_replace_says_so(tmp_path) -> None:
    """Found: "use on_dropped_prompt: replace" as the remedy of a run that already replaces."""
    (tmp_path / "rt_rewards.py").write_text("def nan(completion, row):\n    return float('nan')\n")
    # (fail_fast off: by default a reward NaN on every row stops the run first, exit 2; test_fail_fast.py)
    out = rollkeep(*train_args(tmp_path / "run", "reward.fn=rt_rewards:nan", "rollout.on_dropped_prompt=replace",
                               "rollout.fail_fast_attempts=0"),
                   env_extra={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 5, out.stderr
    assert "no prompt is left to replace them" in out.stderr and "the last drop: data budget spent" in out.stderr
    assert "use on_dropped_prompt: replace" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("make", ["file", "symlink"])
def test_d10_a_rows_dir_that_is_not_a_directory_is_refused_by_train_and_audit(with_tail, case, capsys, make):
    """Found: rows/ a regular file was exit 5 ("the filesystem failed"); a symlink to an
    identical directory was refused by train (3) and passed by audit (0)."""
    run, _ = case(with_tail)
    shutil.move(run / "rows", run.parent / "rows-real")
    if make == "file":
        (run / "rows").write_bytes(b"not a directory")
    else:
        (run / "rows").symlink_to(run.parent / "rows-real", target_is_directory=True)
    err = refuses(capsys, args(run, *TAIL), 3, run)
    assert "not a directory" in err
    err = refuses(capsys, ["audit", str(run)], 3, run)
    assert "not a directory" in err

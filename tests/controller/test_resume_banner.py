"""The resume banner and the `restored` event say what the resumed run does: the siblings
it sends out for the restored groups (counted here from the checkpoint's ledger and from
the dispatches the resumed run traces) and the steps it trains again."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_harness import config, killed, run_child, run_to_end, trace_lines

from rollkeep.controller.startup import restore_banner
from rollkeep.core.checkpoint.store import CheckpointStore
from rollkeep.core.custody.ledger import AttemptStatus, GroupState
from rollkeep.core.journal.durable import read_tail
from rollkeep.core.journal.replay import replay
from rollkeep.core.restore.chain import restore_chain
from rollkeep.trace import last_committed_in_trace

pytestmark = pytest.mark.slow

# Generation slow enough that work is in flight at every cut; no injected failures, so
# every dispatch of the resumed run is one the restore planned.
SCRIPT = ["engine.latency_ms=20", "engine.latency_jitter_ms=0", "engine.infra_fail_rate=0",
          "engine.data_fail_rate=0", "data.generated.n_rows=60", "train.total_steps=12"]


def planned_at_latest_cut(cfg, *, journal: bool = False) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """(siblings sent out before, siblings never sent) of the unfinished groups the restore
    of LATEST will hold: its checkpoint's ledger, with the journal's tail replayed."""
    store = CheckpointStore(Path(cfg.run_dir) / "checkpoints")
    restored = restore_chain(store, source=None, config=None)
    state = restored.ledger
    if journal:
        tail = read_tail(Path(cfg.run_dir), after=restored.manifest["journal"]["seq"])
        state = replay(state, restored.rows, tail.events).state
    again, fresh = set(), set()
    for gid, rec in state.groups.items():
        if rec.state >= GroupState.READY_TO_FINALIZE:
            continue
        for g, (status, attempt) in enumerate(zip(rec.status, rec.attempts, strict=True)):
            if status == AttemptStatus.DISPATCHED or (status == AttemptStatus.RESERVED and attempt > 0):
                again.add((gid, g))
            elif status == AttemptStatus.RESERVED:
                fresh.add((gid, g))
    return again, fresh


def dispatched_by(lines: list[dict], run_id: str, groups: set[str]) -> set[tuple[str, int]]:
    return {(x["group_id"], g) for x in lines
            if x["event"] == "dispatched" and x["run_id"] == run_id and x["group_id"] in groups
            for g in x["generations"]}


def test_after_a_graceful_stop_the_counts_are_the_dispatches_and_no_step_is_redone(tmp_path) -> None:
    cfg = config(tmp_path / "run", *SCRIPT, "checkpoint.every_steps=100")
    assert run_child(cfg, "ledger.step_committed:5", crash_signal="TERM") == 143
    again, fresh = planned_at_latest_cut(cfg)
    assert again, "the stop must abandon siblings in flight (the banner once said 'regenerate 0')"
    run_to_end(cfg)

    lines = trace_lines(cfg)
    restored = next(x for x in lines if x["event"] == "restored")
    stopped = max(x["step"] for x in lines if x["event"] == "step_committed" and x["run_id"] == lines[0]["run_id"])
    assert stopped >= 5 and (restored["step"], restored["steps_redone"]) == (stopped, [])
    assert restored["siblings_regenerated"] == len(again) and restored["siblings_pending"] == len(fresh)
    assert restored["siblings_resent"] == len(again), "a graceful stop leaves nothing in flight at its cut"
    groups = {gid for gid, _ in again | fresh}
    assert dispatched_by(lines, restored["run_id"], groups) == again | fresh


def test_a_kill_after_the_checkpoint_names_the_steps_to_redo(tmp_path) -> None:
    cfg = config(tmp_path / "run", *SCRIPT, "checkpoint.every_steps=3", "journal.enabled=false")
    # Killed at the step-6 cut: a cut waits for the previous write, so step 3 is published
    # and steps 4-6 are committed in the trace.
    assert killed(run_child(cfg, "checkpoint.after_cut:2"))
    again, fresh = planned_at_latest_cut(cfg)
    run_to_end(cfg)

    lines = trace_lines(cfg)
    restored = next(x for x in lines if x["event"] == "restored")
    assert (restored["step"], restored["steps_redone"], restored["journal_events_replayed"]) == (3, [4, 6], 0)
    assert (restored["siblings_regenerated"], restored["siblings_pending"]) == (len(again), len(fresh))
    groups = {gid for gid, _ in again | fresh}
    assert dispatched_by(lines, restored["run_id"], groups) == again | fresh


def test_with_the_journal_the_counts_are_those_of_the_replayed_ledger(tmp_path) -> None:
    # A stop with no final checkpoint: the journal holds everything after step 4's.
    cfg = config(tmp_path / "run", *SCRIPT, "checkpoint.every_steps=4", "checkpoint.on_shutdown=false")
    assert run_child(cfg, "ledger.step_committed:6", crash_signal="TERM") == 143
    again, fresh = planned_at_latest_cut(cfg, journal=True)
    run_to_end(cfg)

    lines = trace_lines(cfg)
    restored = next(x for x in lines if x["event"] == "restored")
    stopped = max(x["step"] for x in lines if x["event"] == "step_committed" and x["run_id"] == lines[0]["run_id"])
    assert (restored["step"], restored["steps_redone"]) == (4, [5, stopped])
    assert restored["journal_events_replayed"] > 0
    assert (restored["siblings_regenerated"], restored["siblings_pending"]) == (len(again), len(fresh))
    groups = {gid for gid, _ in again | fresh}
    assert dispatched_by(lines, restored["run_id"], groups) == again | fresh


def test_a_resume_says_where_it_picks_up_in_plain_words_before_the_restore_line(tmp_path, capsys) -> None:
    from rollkeep.controller import train

    cfg = config(tmp_path / "run", *SCRIPT, "checkpoint.every_steps=100")
    assert run_child(cfg, "ledger.step_committed:5", crash_signal="TERM") == 143
    capsys.readouterr()
    train(config(tmp_path / "run", *SCRIPT, "checkpoint.every_steps=100", "logger.progress=lines"))
    out = capsys.readouterr().out.splitlines()
    restored = next(x for x in trace_lines(cfg) if x["event"] == "restored")
    plain = next(i for i, line in enumerate(out) if line.startswith("resuming at step "))
    detail = next(i for i, line in enumerate(out) if line.startswith("restored step_"))
    assert plain < detail
    assert out[plain].startswith(f"resuming at step {restored['step']} of 12 from checkpoint step_")
    assert "nothing lost" in out[plain]
    banner = next(i for i, line in enumerate(out) if line.startswith("rollkeep ") and " train " in line)
    assert banner < plain and "(resumes from checkpoint step_" in out[banner + 1]


def test_the_banner_names_the_steps_and_the_dispatches() -> None:
    counts = {"groups_reused": 2, "siblings_reused": 3, "siblings_regenerated": 8, "siblings_resent": 6,
              "siblings_pending": 4, "groups_readmitted": 1, "spare_prompts": 0, "groups_lost": 0}
    line = restore_banner("step_000010", counts, [11, 13])
    assert "redo steps 11-13" in line
    assert "dispatch 12 sibling(s): 8 again (2 in flight at the cut, 6 waiting after an abandoned or " \
           "failed attempt) and 4 for the first time" in line
    assert "no step to redo" in restore_banner("step_000010", counts, [])
    assert "redo step 11 " in restore_banner("step_000010", counts, [11, 11])
    assert "LOST" in restore_banner("step_000010", {**counts, "groups_lost": 3}, [])


def test_the_last_commit_is_found_past_a_torn_tail_and_in_no_trace(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    assert last_committed_in_trace(trace) is None
    trace.write_bytes(b'{"t":1,"run_id":"a","event":"step_committed","step":7,"prompts":[]}\n'
                      b'{"t":2,"run_id":"a","event":"sealed","group_id":"e0.1"}\n'
                      b'{"t":3,"run_id":"a","event":"step_committed","st')
    assert last_committed_in_trace(trace) == 7
    trace.write_bytes(b"")
    assert last_committed_in_trace(trace) is None

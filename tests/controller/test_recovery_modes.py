"""`recovery.mode`: what a restart reuses. The same scripted kill — at the step-8 cut,
once the step-4 checkpoint is surely published (a cut waits for the previous write), so the
resumed run restores step 4 with the groups of step 5 (lookahead 1) in flight — loses
nothing with the ledger (`sibling`,
`prompt_group`) and loses exactly the in-flight groups without it (`cursor_only`, the
behaviour of systems that checkpoint only the cursor and finished rows:
reference/001_*)."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_harness import config, killed, run_child, run_to_end, trace_lines

from rollkeep.chaos import ChaosReport, verify
from rollkeep.core.checkpoint.store import CheckpointStore
from rollkeep.core.custody import codec
from rollkeep.core.custody.ledger import GroupState

pytestmark = pytest.mark.slow

# Every generation takes 40 ms: steps 1-2 generate together, then steps 3-4, so when step 4
# commits (and is cut) the groups of step 5, dispatched at step 3's commit, are generating.
SCRIPT = ["engine.latency_ms=40", "engine.latency_jitter_ms=0", "checkpoint.every_steps=4",
          "data.generated.n_rows=40", "train.total_steps=9"]


def inflight_at_latest_cut(cfg) -> set[str]:
    ck = CheckpointStore(Path(cfg.run_dir) / "checkpoints").open()
    state = codec.decode(ck.read("ledger.msgpack"))
    return {gid for gid, r in state.groups.items() if r.state < GroupState.READY}


@pytest.mark.parametrize("mode", ["sibling", "prompt_group", "cursor_only"])
def test_in_flight_groups_survive_only_with_the_ledger(tmp_path, mode) -> None:
    cfg = config(tmp_path / mode, *SCRIPT, f"recovery.mode={mode}")
    assert killed(run_child(cfg, "checkpoint.after_cut:2"))
    inflight = inflight_at_latest_cut(cfg)
    assert inflight, "the scripted kill must leave groups in flight at the cut"
    run_to_end(cfg)

    lines = trace_lines(cfg)
    restored = next(x for x in lines if x["event"] == "restored")
    lost = {x["group_id"] for x in lines if x["event"] == "dropped" and x["reason"].startswith("lost")}
    trained = {g for x in lines if x["event"] == "step_committed" and x["run_id"] == restored["run_id"]
               for g in x["group_ids"]}
    report = ChaosReport()
    verify(cfg, Path(cfg.run_dir), report)
    if mode == "cursor_only":
        assert lost == inflight and restored["groups_lost"] == len(inflight)
        assert not (lost & trained), "a lost prompt was trained after all"
        assert len(report.lost) == len(inflight) and not report.passed
    else:
        assert not lost and restored["groups_lost"] == 0
        assert inflight <= trained, "every group in flight at the cut is trained after the restart"
        assert report.passed and not report.lost, "\n".join(report.lines())

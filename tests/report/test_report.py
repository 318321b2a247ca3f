"""`rollkeep trace` / `rollkeep.report`: every number of a restart, checked on a trace
written by hand with known times and token counts, then on a real killed-and-resumed run.

The hand-built run dir (two runs, A killed, B resumed from step_000001 cut at t=105):

  A  takes e0.0 e0.1 (sibling), seals them, commits step 1; takes e0.2 (sibling) and e0.3
     (all-or-nothing); seals e0.2/0 (11 tokens) and e0.3/0 (13) before the cut at 105;
     e0.2/1 and e0.3/1 are in flight at the cut. After the cut it seals e0.2/1 (17),
     e0.3/1 (19), takes e0.5 and seals e0.5/0 (23), commits step 2 at 107.5, and is killed
     in the middle of a line.
  B  abandons (restart) e0.2/1 (dispatched 104.3) and e0.3/0, e0.3/1 (dispatched 104.4),
     regenerates, commits step 2 at 113.0 and step 3 at 114.5, finishes.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from run_harness import config, killed, run_child, run_to_end

from rollkeep.cli import main
from rollkeep.core.errors import UserInputError
from rollkeep.report import PLOTS, RESTART_PLOTS, analyse, render_markdown, write_report
from rollkeep.trace import read_trace

CUT = 105.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _line(t: float, run_id: str, event: str, **fields) -> str:
    return json.dumps({"t": t, "run_id": run_id, "event": event, **fields})


def _taken(t, run, ordinal, idx, granularity="sibling"):
    return _line(t, run, "taken", epoch=0, ordinal=ordinal, idx=idx, task="toy",
                 row_fingerprint=0, group_size=2, granularity=granularity, origin="source")


def _sealed(t, run, gid, g, tokens, attempt=0):
    return _line(t, run, "sealed", group_id=gid, generation=g, attempt=attempt, version=0, tokens=tokens)


def _dispatched(t, run, gid, gens):
    return _line(t, run, "dispatched", group_id=gid, generations=gens, version=0)


def _ready(t, run, gid):
    return [_line(t - 0.05, run, "finalizing", group_id=gid),
            _line(t, run, "ready", group_id=gid, advantages=[0.0, 0.0])]


def _commit(t, run, step, gids, idxs):
    return [_line(t - 0.3, run, "claimed", step=step, group_ids=gids),
            _line(t, run, "step_committed", step=step, weight_version=step, group_ids=gids,
                  prompts=[[0, i] for i in idxs])]


def _run_a() -> list[str]:
    A = "runA"
    return [
        _line(100.0, A, "run_started", resumed_from_step=None, checkpoint=None, pid=1,
              config_fingerprint="x", cleaned_tmp=[]),
        _taken(100.1, A, 0, 5), _taken(100.2, A, 1, 7),
        _dispatched(100.3, A, "e0.0", [0, 1]), _dispatched(100.4, A, "e0.1", [0, 1]),
        _sealed(101.0, A, "e0.0", 0, 10), _sealed(101.5, A, "e0.0", 1, 20), *_ready(101.7, A, "e0.0"),
        _sealed(102.0, A, "e0.1", 0, 30), _sealed(102.2, A, "e0.1", 1, 40), *_ready(102.4, A, "e0.1"),
        *_commit(103.5, A, 1, ["e0.0", "e0.1"], [5, 7]),
        _taken(104.0, A, 2, 9), _taken(104.1, A, 3, 11, granularity="prompt_group"),
        _dispatched(104.3, A, "e0.2", [0, 1]), _dispatched(104.4, A, "e0.3", [0, 1]),
        _sealed(104.5, A, "e0.2", 0, 11), _sealed(104.6, A, "e0.3", 0, 13),
        # --- the cut of step_000001 at t=105.0 ---
        _line(105.2, A, "checkpoint_published", step=1, name="step_000001", bytes=100,
              cut_hold_seconds=0.0001, write_seconds=0.1, cut_time=CUT),
        _sealed(105.5, A, "e0.2", 1, 17), *_ready(105.7, A, "e0.2"),
        _sealed(106.0, A, "e0.3", 1, 19), *_ready(106.2, A, "e0.3"),
        _taken(106.5, A, 5, 15), _dispatched(106.6, A, "e0.5", [0, 1]),
        _sealed(107.0, A, "e0.5", 0, 23),
        *_commit(107.5, A, 2, ["e0.2", "e0.3"], [9, 11]),
    ]


def _run_b() -> list[str]:
    B = "runB"
    return [
        _line(110.0, B, "run_started", resumed_from_step=1, checkpoint="step_000001", pid=2,
              config_fingerprint="x", cleaned_tmp=[]),
        _line(110.1, B, "abandoned", group_id="e0.2", generations=[1], reason="restart"),
        _line(110.1, B, "abandoned", group_id="e0.3", generations=[0, 1], reason="restart"),
        _line(110.2, B, "restored", checkpoint="step_000001", step=1, cut_time=CUT,
              groups_reused=0, groups_finalize_again=0, siblings_reused=1,
              siblings_regenerated=3, siblings_pending=0, groups_readmitted=2,
              spare_prompts=0, config_changes=[]),
        _dispatched(110.3, B, "e0.2", [1]), _dispatched(110.4, B, "e0.3", [0, 1]),
        _sealed(111.0, B, "e0.2", 1, 17, attempt=1), *_ready(111.2, B, "e0.2"),
        _sealed(111.5, B, "e0.3", 0, 13, attempt=1), _sealed(111.8, B, "e0.3", 1, 19, attempt=1),
        *_ready(112.0, B, "e0.3"),
        *_commit(113.0, B, 2, ["e0.2", "e0.3"], [9, 11]),
        _taken(113.2, B, 5, 15), _dispatched(113.3, B, "e0.5", [0, 1]),
        _sealed(113.6, B, "e0.5", 0, 23), _sealed(113.8, B, "e0.5", 1, 29), *_ready(114.0, B, "e0.5"),
        *_commit(114.5, B, 3, ["e0.5"], [15]),
        _line(114.6, B, "checkpoint_published", step=3, name="step_000003", bytes=100,
              cut_hold_seconds=0.0001, write_seconds=0.1, cut_time=114.55),
        _line(114.7, B, "eval", step=3, **{"eval/accuracy": 0.5, "eval/reward_mean": 0.25}),
        _line(115.0, B, "run_finished", step=3, weights_sha256="ab", reason="finished"),
    ]


def _metrics(t, run, step, **extra) -> str:
    custody = {f"custody/{o}": 1 for o in ("spare", "reserved", "generating", "finalizing",
                                            "ready", "claimed", "dropped")}
    return json.dumps({"t": t, "run_id": run, "step": step, "weight_version": step, "groups": 2,
                       "tokens": 100 * step, "reward_mean": 0.1 * step, "batch_age": 0.5 * step,
                       "train_seconds": 0.1, "step_seconds": 1.0, "tokens_generated_per_s": 50.0,
                       **custody, "custody/trained": 2 * step, **extra})


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    torn = '{"t":107.9,"run_id":"runA","event":"sea'  # A was killed mid-write
    # B's Trace ends the torn line before appending (trace.Trace.__init__).
    (d / "trace.jsonl").write_text("\n".join(_run_a()) + "\n" + torn + "\n" + "\n".join(_run_b()) + "\n")
    (d / "metrics.jsonl").write_text("\n".join([
        _metrics(103.6, "runA", 1),
        _metrics(107.6, "runA", 2, batch_age=9.0),  # A's step 2 does not survive
        # A was killed while writing a line; B's first record lands right after it.
        '{"t": 107.9, "run_id": "runA", "st' + _metrics(113.1, "runB", 2),
        _metrics(114.6, "runB", 3),
        json.dumps({"t": 114.7, "run_id": "runB", "step": 3, "eval/accuracy": 0.5}),
    ]) + "\n")
    return d


def test_restart_row_every_number(run_dir: Path) -> None:
    rep = analyse(run_dir)
    assert rep.torn_lines == 1
    assert rep.torn_metrics_lines == 1
    assert [r.run_id for r in rep.runs] == ["runA", "runB"]
    a, b = rep.runs
    assert (a.finished, a.status, a.last_t, a.steps_committed) == (False, "killed", 107.5, [1, 2])
    assert (b.finished, b.status, b.resumed_from_step, b.checkpoint, b.steps_committed) == (
        True, "finished", 1, "step_000001", [2, 3])

    [r] = rep.restarts
    assert (r.run_id, r.previous_run_id, r.checkpoint, r.step, r.cut_time) == (
        "runB", "runA", "step_000001", 1, CUT)
    # From the `restored` line.
    assert (r.groups_reused, r.siblings_reused, r.siblings_regenerated, r.groups_readmitted) == (0, 1, 3, 2)
    # Sealed after the cut by A: e0.2/1 17 + e0.3/1 19 + e0.5/0 23.
    assert (r.seals_after_cut, r.tokens_sealed_after_cut) == (3, 59)
    # The checkpoint held e0.3/0 sealed (13 tokens), but e0.3 is all-or-nothing.
    assert (r.siblings_discarded, r.tokens_siblings_discarded) == (1, 13)
    assert r.tokens_thrown_away == 72
    assert r.tokens_reused == 11  # e0.2/0, kept
    # Cut 105.0 - last dispatch: e0.2/1 at 104.3, e0.3/0 and e0.3/1 at 104.4.
    assert r.attempts_abandoned == 3
    assert r.attempts_without_dispatch == 0
    assert r.thrown_away_generation_seconds == pytest.approx(0.7 + 0.6 + 0.6)
    # A died after committing step 2 (107.5); B committed step 2 again at 113.0.
    assert r.kill_t == 107.5
    assert r.lost_progress_seconds == pytest.approx(5.5)
    assert r.lost_progress_until == "step 2 committed again"


def test_lineage_steps_and_group_completion(run_dir: Path) -> None:
    rep = analyse(run_dir)
    assert [(s.step, s.run_id) for s in rep.steps] == [(1, "runA"), (2, "runB"), (3, "runB")]
    s1, s2, s3 = rep.steps
    # Step 1: e0.0 ready 101.7 - taken 100.1; e0.1 ready 102.4 - taken 100.2.
    assert s1.completion_n == 2
    assert s1.completion_mean == pytest.approx((1.6 + 2.2) / 2)
    assert s1.completion_p50 == pytest.approx(1.9)
    assert s1.completion_p90 == pytest.approx(1.6 + 0.9 * 0.6)
    # Step 2: taken by A before the cut, readied by B (A's readies came after the cut).
    assert s2.completion_mean == pytest.approx(((112.0 - 104.1) + (111.2 - 104.0)) / 2)
    # Step 3: e0.5 taken again by B (A's take came after the cut).
    assert s3.completion_mean == pytest.approx(114.0 - 113.2)
    # Metrics matched by run and step: B's step 2, not A's.
    assert (s1.batch_age, s2.batch_age, s3.batch_age) == (0.5, 1.0, 1.5)
    assert (s2.tokens, s2.reward_mean, s2.groups) == (200, pytest.approx(0.2), 2)
    assert [c["surviving"] for c in rep.custody] == [True, False, True, True]
    assert rep.evals == [{"step": 3, "accuracy": 0.5, "reward_mean": 0.25}]
    assert rep.duplicates == []


def test_warm_start_lines_are_not_taken_for_steps(run_dir: Path) -> None:
    """The warm start logs into metrics.jsonl before RL (`step` 0 with `warmup/step`); the
    report's steps and custody are those of the RL step lines only."""
    before = analyse(run_dir)
    metrics = run_dir / "metrics.jsonl"
    warm = [json.dumps({"t": 100.0 + k / 10, "run_id": "runA", "step": 0, "warmup/step": k,
                        "warmup/loss": 2.0 / k, "warmup/seconds": k / 10, "warmup/tokens": 30.0})
            for k in range(1, 4)]
    metrics.write_text("\n".join(warm) + "\n" + metrics.read_text())
    after = analyse(run_dir)
    assert after.steps == before.steps and after.custody == before.custody
    assert [s.step for s in after.steps] == [1, 2, 3] and after.torn_metrics_lines == 1


def test_a_trace_being_written(run_dir: Path, tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    text = (run_dir / "trace.jsonl").read_text()
    cut_at = text.index('"event": "step_committed", "step": 2', text.index("runB"))
    (live / "trace.jsonl").write_text(text[:cut_at])  # B is writing its step 2 commit
    rep = analyse(live)
    assert rep.torn_lines == 2
    assert [r.status for r in rep.runs] == ["killed", "killed, or still running"]
    assert [s.step for s in rep.steps] == [1]
    [r] = rep.restarts
    assert r.tokens_thrown_away == 72
    assert r.lost_progress_seconds is None  # B has not committed step 2 again yet
    assert rep.custody == []  # no metrics.jsonl yet


def test_lost_progress_when_the_killed_run_committed_nothing_after_the_checkpoint(
    run_dir: Path, tmp_path: Path
) -> None:
    d = tmp_path / "early"
    d.mkdir()
    lines = (run_dir / "trace.jsonl").read_text().splitlines()
    keep = [x for x in lines if not ('"runA"' in x and '"step": 2,' in x and "commit" in x)]
    keep = [x for x in keep if not ('"runA"' in x and '"claimed", "step": 2' in x)]
    assert len(keep) == len(lines) - 2
    (d / "trace.jsonl").write_text("\n".join(keep) + "\n")
    [r] = analyse(d).restarts
    # A's last complete line is now its seal at 107.0; B's first commit is at 113.0.
    assert (r.kill_t, r.lost_progress_until) == (107.0, "first commit")
    assert r.lost_progress_seconds == pytest.approx(6.0)


def _relabel(lines: list[str], run_id: str, dt: float) -> list[str]:
    out = []
    for text in lines:
        x = json.loads(text)
        x["run_id"], x["t"] = run_id, x["t"] + dt
        out.append(json.dumps(x))
    return out


def test_second_restart_from_the_same_checkpoint_counts_nothing_twice(tmp_path: Path) -> None:
    # B dies after resealing e0.2/1 (17 tokens, after the cut) without a new checkpoint;
    # C restores step_000001 again and does what B did, 20 s later (same cut_time).
    b = _run_b()[:7]
    assert json.loads(b[-1])["event"] == "sealed"
    c = _relabel(_run_b(), "runC", 20.0)
    d = tmp_path / "twice"
    d.mkdir()
    (d / "trace.jsonl").write_text("\n".join(_run_a() + b + c) + "\n")
    rep = analyse(d)
    first, second = rep.restarts
    assert (first.tokens_thrown_away, first.thrown_away_generation_seconds) == (72, pytest.approx(1.9))
    assert (second.checkpoint, second.cut_time) == ("step_000001", CUT)
    # A's seals and dispatches were lost at the first restart; only B's seal is new.
    assert (second.seals_after_cut, second.tokens_sealed_after_cut) == (1, 17)
    assert (second.siblings_discarded, second.tokens_thrown_away) == (0, 17)
    assert (second.attempts_abandoned, second.thrown_away_generation_seconds) == (3, 0.0)
    # B committed nothing: from its last line (111.0) to C's first commit (133.0).
    assert (second.lost_progress_until, second.lost_progress_seconds) == ("first commit", pytest.approx(22.0))
    assert [(s.step, s.run_id) for s in rep.steps] == [(1, "runA"), (2, "runC"), (3, "runC")]
    assert rep.steps[1].completion_mean == pytest.approx(((132.0 - 104.1) + (131.2 - 104.0)) / 2)


def test_groups_dropped_while_restoring_throw_away_their_sealed_siblings(tmp_path: Path) -> None:
    # recovery.mode=cursor_only: the restart drops every group in flight at the cut.
    b = _run_b()[:3] + [
        _line(110.15, "runB", "dropped", group_id="e0.2", reason="lost in flight at the cut",
              prompt=[0, 9], step=2, shrink=False, replacement=None),
        _run_b()[3].replace('"spare_prompts": 0', '"spare_prompts": 0, "groups_lost": 1'),
    ]
    d = tmp_path / "lost"
    d.mkdir()
    (d / "trace.jsonl").write_text("\n".join(_run_a() + b) + "\n")
    [r] = analyse(d).restarts
    assert r.groups_lost == 1
    assert (r.siblings_discarded, r.tokens_siblings_discarded) == (2, 13 + 11)
    assert (r.tokens_thrown_away, r.tokens_reused) == (59 + 24, 0)


def test_write_report(run_dir: Path) -> None:
    rep = analyse(run_dir)
    files = write_report(run_dir, rep)
    out = run_dir / "report"
    assert sorted(p.name for p in files) == sorted(["report.md", "report.json", *PLOTS, *RESTART_PLOTS])
    assert all(p.parent == out for p in files)
    for name in (*PLOTS, *RESTART_PLOTS):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert len(data) > 10_000, name
    md = (out / "report.md").read_text()
    assert "## Restarts" in md
    assert "| 1 | runB | step_000001 | 1 | 0 | 1 | 3 | 2 | - | 11 | - | 0 | 0 | 0 | 0 | 72 (59 + 13) | 1.900 | 3 | 5.500 (until step 2 committed again) |" in md
    for term in ("tokens thrown away", "thrown-away generation time", "lost progress",
                 "group completion time", "batch age"):
        assert f"**{term}**" in md
    data = json.loads((out / "report.json").read_text())
    assert data["restarts"][0]["tokens_thrown_away"] == 72
    assert data["summary"]["steps"] == 3
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl", "report", "trace.jsonl"]


def test_write_report_without_matplotlib(run_dir: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(UserInputError) as e:
        write_report(run_dir, analyse(run_dir))
    assert "rollkeep[report]" in e.value.remedy
    assert not (run_dir / "report").exists()
    files = write_report(run_dir, analyse(run_dir), plots=False)
    assert sorted(p.name for p in files) == ["report.json", "report.md"]


def test_cli(run_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["trace", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "## Restarts" in out and "72 (59 + 13)" in out
    assert str(run_dir / "report" / "restart_cost.png") in out

    assert main(["trace", str(run_dir), "--json", "--no-plots"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["restarts"][0]["lost_progress_seconds"] == pytest.approx(5.5)
    assert [Path(p).name for p in data["files"]] == ["report.md", "report.json"]

    assert main(["trace", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["trace", str(tmp_path / "empty")]) == 2
    assert "has no trace" in capsys.readouterr().err


def test_end_to_end_killed_and_resumed_with_the_journal_keeps_generation(tmp_path: Path) -> None:
    # A stop with no final checkpoint: the journal holds everything after the last one.
    cfg = config(tmp_path / "run", "checkpoint.on_shutdown=false")
    assert run_child(cfg, "ledger.step_committed:5", crash_signal="TERM") == 143
    run_to_end(cfg)
    rep = analyse(Path(cfg.run_dir))
    [r] = rep.restarts
    # the run_finished line names the signal: the report says "stopped (SIGTERM)"
    assert [x.status for x in rep.runs] == ["stopped (SIGTERM)", "finished"]
    assert r.previous_status == "stopped (SIGTERM)"
    lines = read_trace(Path(cfg.run_dir) / "trace.jsonl")[0]
    restored = next(x for x in lines if x["event"] == "restored")
    assert r.journal_events_replayed == restored["journal_events_replayed"] > 0
    assert r.seals_kept_by_journal > 0 and r.tokens_kept_by_journal > 0
    # Every seal the stopped run made after the cut is kept: none is thrown away.
    after = [x for x in lines if x["event"] == "sealed" and x["run_id"] != restored["run_id"]
             and x["t"] > restored["cut_time"]]
    assert (r.seals_kept_by_journal, r.seals_after_cut) == (len(after), 0)
    assert r.tokens_kept_by_journal == sum(x["tokens"] for x in after) > 0


def test_end_to_end_killed_and_resumed(tmp_path: Path) -> None:
    cfg = config(tmp_path / "run", "journal.enabled=false")
    assert killed(run_child(cfg, "ledger.step_committed:5"))
    run_to_end(cfg)
    run_dir = Path(cfg.run_dir)
    rep = analyse(run_dir)
    assert len(rep.runs) == 2 and rep.runs[1].finished
    [r] = rep.restarts
    assert r.step is not None and r.cut_time is not None
    # Killed at the 5th commit with the next steps in flight: work in flight was thrown
    # away and regenerated, and finished groups were reused (the exact numbers depend on
    # timing; the hand-built trace above pins each definition).
    assert r.groups_reused + r.siblings_reused > 0 and r.siblings_regenerated > 0
    assert r.tokens_thrown_away > 0 and r.lost_progress_seconds > 0
    assert r.lost_progress_until == "step 5 committed again"
    assert [s.step for s in rep.steps] == list(range(1, cfg.train.total_steps + 1))
    assert all(s.batch_age is not None and s.completion_n == s.groups for s in rep.steps)
    assert rep.duplicates == []
    files = write_report(run_dir, rep)
    assert all(p.stat().st_size > 0 for p in files)
    assert "## Restarts" in render_markdown(rep)
    shutil.rmtree(run_dir / "report")


# -- graceful stops, and the plots --------------------------------------------------------------


def _stopped_a(*, final_checkpoint: bool) -> list[str]:
    """A commits steps 1 and 2 and stops on SIGTERM; its final cut (step_000002) holds
    both steps, or (`final_checkpoint=False`, e.g. checkpoint.on_shutdown: false) only
    step_000001 is published."""
    A = "runA"
    lines = [x for x in _run_a() if json.loads(x)["event"] != "checkpoint_published"]
    lines.insert(-2, _line(105.2, A, "checkpoint_published", step=1, name="step_000001", bytes=100,
                           cut_hold_seconds=0.0001, write_seconds=0.1, cut_time=CUT))
    if final_checkpoint:
        lines.append(_line(107.7, A, "checkpoint_published", step=2, name="step_000002", bytes=100,
                           cut_hold_seconds=0.0001, write_seconds=0.1, cut_time=107.6))
    lines.append(_line(107.8, A, "run_finished", step=2, weights_sha256="ab", reason="signal"))
    return lines


def _resumed_b(step: int, t0: float) -> list[str]:
    B = "runB"
    ck = f"step_{step:06d}"
    return [
        _line(t0, B, "run_started", resumed_from_step=step, checkpoint=ck, pid=2,
              config_fingerprint="x", cleaned_tmp=[]),
        _line(t0 + 0.1, B, "restored", checkpoint=ck, step=step, cut_time=CUT if step == 1 else 107.6,
              groups_reused=0, groups_finalize_again=0, siblings_reused=0, siblings_regenerated=0,
              siblings_pending=0, groups_readmitted=0, spare_prompts=0, config_changes=[]),
        _taken(t0 + 0.2, B, 6, 17), _dispatched(t0 + 0.3, B, "e0.6", [0, 1]),
        _sealed(t0 + 1.0, B, "e0.6", 0, 5), _sealed(t0 + 1.5, B, "e0.6", 1, 5), *_ready(t0 + 2.0, B, "e0.6"),
        *_commit(t0 + 3.0, B, step + 1, ["e0.6"], [17]),
    ]


def test_lost_progress_after_a_graceful_stop_that_lost_nothing_is_zero(tmp_path: Path) -> None:
    """Regression: the idle time between a graceful stop and the resume (an hour here)
    was counted as lost progress although the final checkpoint held every step."""
    d = tmp_path / "graceful"
    d.mkdir()
    (d / "trace.jsonl").write_text("\n".join(_stopped_a(final_checkpoint=True) + _resumed_b(2, 3700.0)) + "\n")
    [r] = analyse(d).restarts
    assert r.previous_status == "stopped (SIGINT or SIGTERM)"  # a trace without run_finished.signal
    assert (r.lost_progress_seconds, r.lost_progress_until) == (0.0, "nothing lost (graceful stop)")
    assert "| 0.000 (until nothing lost (graceful stop)) |" in render_markdown(analyse(d))


def test_lost_progress_after_a_graceful_stop_without_its_final_checkpoint_skips_the_idle_time(
    tmp_path: Path,
) -> None:
    d = tmp_path / "graceful"
    d.mkdir()
    (d / "trace.jsonl").write_text("\n".join(_stopped_a(final_checkpoint=False) + _resumed_b(1, 3700.0)) + "\n")
    [r] = analyse(d).restarts
    # step 2 is redone: from the resumed run's start (3700.0) to its commit, not from 107.8
    assert r.lost_progress_until == "step 2 committed again"
    assert r.lost_progress_seconds == pytest.approx(3.0)


def _figures(report) -> dict:
    from rollkeep.report import _plot

    return dict(_plot(report))


def test_a_run_without_restarts_gets_no_custody_batch_age_or_cost_plots(tmp_path: Path) -> None:
    d = tmp_path / "once"
    d.mkdir()
    (d / "trace.jsonl").write_text("\n".join(_run_a()) + "\n")
    (d / "metrics.jsonl").write_text(_metrics(103.6, "runA", 1) + "\n" + _metrics(107.6, "runA", 2) + "\n")
    assert sorted(_figures(analyse(d))) == sorted(PLOTS)
    files = write_report(d, analyse(d))
    assert sorted(p.name for p in files) == sorted(["report.md", "report.json", *PLOTS])
    md = (d / "report" / "report.md").read_text()
    assert "No restarts: the run was never interrupted" in md
    assert "batch age is how many" not in md.lower()  # the spike note is for restarted runs


def test_report_leads_with_held_out_accuracy_and_teaches_the_training_curves(tmp_path: Path) -> None:
    d = tmp_path / "learned"
    d.mkdir()
    A = "runA"
    lines = [_line(100.0, A, "run_started", resumed_from_step=None, checkpoint=None, pid=1,
                   config_fingerprint="x", cleaned_tmp=[])]
    metrics = []
    for step in (1, 2, 3, 4):
        lines += [_taken(100 + step, A, step, step), *_commit(100.5 + step, A, step, [f"e0.{step}"], [step])]
        metrics.append(_metrics(100.6 + step, A, step, **{
            "trainer/loss": 0.1 * step, "trainer/kl": 0.01 * step, "trainer/clip_frac": 0.02,
            "trainer/grad_norm": 1.5, "response_length/mean": 3.0 + step}))
    for step, acc in ((0, 0.05), (2, 0.5), (4, 0.9)):
        lines.append(_line(100.7 + step, A, "eval", step=step, **{"eval/accuracy": acc, "eval/reward_mean": acc}))
    lines.append(_line(110.0, A, "run_finished", step=4, weights_sha256="ab", reason="finished"))
    (d / "trace.jsonl").write_text("\n".join(lines) + "\n")
    (d / "metrics.jsonl").write_text("\n".join(metrics) + "\n")
    rep = analyse(d)
    write_report(d, rep)
    md = (d / "report" / "report.md").read_text()
    head = md.splitlines()
    assert head[0] == f"# rollkeep report: {d}"
    assert head[2] == ("**Held-out accuracy: 0.050 at step 0 → 0.900 at step 4** (best 0.900 at step 4; "
                       "3 evaluation(s), greedy).")
    assert head[4].startswith("The run: finished, last step 4;")
    assert md.index("## Held-out accuracy") < md.index("## Training") < md.index("## Runs")
    assert "| 2 | 0.500 | 0.500 |" in md
    assert "| loss | 0.1000 | 0.4000 | 0.1000 | 0.4000 |" in md
    assert "| response length (tokens) | 4 | 7 | 4 | 7 |" in md or "| response length (tokens) | 4.0000" in md
    for key in ("trainer/loss", "trainer/kl", "trainer/clip_frac", "trainer/grad_norm", "response_length/mean"):
        assert f"(`{key}`)" in md
    assert [s.kl for s in rep.steps] == pytest.approx([0.01, 0.02, 0.03, 0.04])
    fig = _figures(rep)["training.png"]
    drawn = [ax for ax in fig.axes if ax.lines]
    assert len(drawn) == 5 and all(len(ax.lines[0].get_xdata()) == 4 for ax in drawn)
    ax, acc_axis = _figures(rep)["reward.png"].axes[:2]
    assert acc_axis.get_ylim()[0] == 0.0  # accuracy from 0, not from its first value


def test_eval_accuracy_falls_back_to_metrics_jsonl(tmp_path: Path) -> None:
    d = tmp_path / "old"
    d.mkdir()
    (d / "trace.jsonl").write_text("\n".join(_run_a()) + "\n")
    (d / "metrics.jsonl").write_text("\n".join([
        _metrics(103.6, "runA", 1), json.dumps({"t": 103.7, "run_id": "runA", "step": 1, "eval/accuracy": 0.25})]) + "\n")
    assert analyse(d).evals == [{"step": 1, "accuracy": 0.25, "reward_mean": None}]
    assert "**Held-out accuracy: 0.250 at step 1**" in render_markdown(analyse(d))


def _ended(tmp_path: Path, *ends: str) -> str:
    d = tmp_path / "ended"
    d.mkdir(exist_ok=True)
    (d / "trace.jsonl").write_text("\n".join(_run_a() + list(ends)) + "\n")
    return analyse(d).runs[-1].status


@pytest.mark.parametrize(("ends", "status"), [
    ([_line(108.0, "runA", "run_finished", step=2, weights_sha256="ab", reason="signal", signal="SIGINT")],
     "stopped (SIGINT)"),
    ([_line(108.0, "runA", "run_finished", step=2, weights_sha256="ab", reason="signal", signal="SIGTERM")],
     "stopped (SIGTERM)"),
    ([_line(108.0, "runA", "run_finished", step=2, weights_sha256="ab", reason="data exhausted")],
     "finished (data exhausted)"),
    ([_line(108.0, "runA", "run_failed", step=2, error="ExternalError: step 2 lost 5 of 8 prompts")],
     "failed: ExternalError: step 2 lost 5 of 8 prompts"),
    ([_line(108.0, "runA", "run_finished", step=2, weights_sha256="ab", reason="signal", signal="SIGINT"),
      _line(108.1, "runA", "run_failed", step=2, error="FilesystemError: the journal's last flush")],
     "failed: FilesystemError: the journal's last flush"),
    ([], "killed, or still running"),
])
def test_stop_reasons_are_labelled_truthfully(tmp_path: Path, ends, status) -> None:
    assert _ended(tmp_path, *ends) == status
    md = render_markdown(analyse(tmp_path / "ended"))
    assert f"The run: {status}," in md and "finished (signal)" not in md


def test_custody_plot_stacks_the_owners(run_dir: Path) -> None:
    from matplotlib.collections import PolyCollection

    fig = _figures(analyse(run_dir))["custody.png"]
    top, bottom = fig.axes[:2]
    # one filled band per owner (stacked areas, not overlapping lines); only the restart
    # marker is a line
    assert len([c for c in top.collections if isinstance(c, PolyCollection)]) == 6
    assert len([c for c in bottom.collections if isinstance(c, PolyCollection)]) == 2
    assert [ln.get_label() for ln in top.lines] == ["restart (after this step)"]
    assert [t.get_text() for t in top.get_legend().get_texts()][:6] == [
        "claimed", "ready", "finalizing", "generating", "reserved", "spare"]
    assert fig.get_suptitle().endswith("(stacked)")

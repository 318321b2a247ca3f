"""Crash at every named crash point, resume, finish: for each sampler and granularity,
exactly-once custody holds, and in deterministic mode the final weights are byte-identical
to a run that was never killed (SQLite's habit: crash at every sync point).

Each crash is a real SIGKILL of a forked child process; the resume is another child.
"""

from __future__ import annotations

import signal

import pytest
from run_harness import check, config, event_counts, final_sha, killed, run_child, run_to_end

SAMPLERS = ["in_order", "weight_fifo", "windowed"]
GRANULARITIES = ["sibling", "prompt_group"]

# Failures are injected so that `failed`, `abandoned` and `dropped` happen too.
FAILURES = ["engine.infra_fail_rate=0.15", "engine.data_fail_rate=0.05",
            "rollout.max_infra_attempts=2", "rollout.max_data_attempts=2", "rollout.backoff_ms=0"]
POINTS = ["ledger.taken", "ledger.admitted", "ledger.dispatched", "ledger.sealed", "ledger.failed",
          "ledger.abandoned", "ledger.finalizing", "ledger.ready", "ledger.claimed",
          "ledger.step_committed", "ledger.dropped", "ledger.evicted", "train.before_commit",
          "train.after_commit", "checkpoint.after_cut", "publish.file_written",
          "publish.manifest_written", "publish.dir_renamed", "publish.latest_written",
          "publish.latest_replaced", "publish.retention",
          # inside the journal's group commit (the first one: every journaled run flushes)
          "rowlog.before_fsync", "rowlog.after_fsync", "journal.before_fsync", "journal.after_fsync"]


TIMING_DEPENDENT = {"ledger.evicted", "ledger.dropped", "ledger.failed", "ledger.abandoned"}


def _occurrences(counts: dict[str, int], point: str) -> int:
    kind, _, name = point.partition(".")
    if kind in ("journal", "rowlog"):
        return 2  # killed at the first flush, then at the first flush of the resumed run
    if kind == "ledger":
        return counts.get(name, 0)
    if kind == "train":
        return counts.get("step_committed", 0)
    return counts.get("checkpoint_published", 0)


@pytest.mark.slow
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_crash_at_every_point(tmp_path, sampler, granularity) -> None:
    # Two short epochs: the run rolls over and ends when the data is exhausted.
    over = ["data.generated.n_rows=20", "data.epochs=2",
            f"sampler.name={sampler}", f"recovery.mode={granularity}", *FAILURES,
            "rollout.on_dropped_prompt=shrink", "rollout.min_step_batch_fraction=0.25"]
    deterministic = sampler == "in_order"
    if deterministic:
        over.append("deterministic=true")
    if sampler == "windowed":  # uneven generation: stragglers are overtaken and evicted
        over += ["sampler.max_staleness_versions=1", "engine.latency_jitter_ms=30"]
    reference = config(tmp_path / "reference", *over)
    run_to_end(reference)
    counts = event_counts(reference)
    reference_sha = final_sha(reference) if deterministic else None

    crashed = []
    for point in POINTS:
        n = _occurrences(counts, point)
        if n == 0:
            continue  # this configuration never reaches the point
        cfg = config(tmp_path / point, *over)
        # Land in the middle of the run, and for a second kill early in the resumed run.
        first = run_child(cfg, f"{point}:{max(1, n // 2)}")
        if not killed(first):
            # Only timing decides how often an unstamped sampler evicts or a group fails
            # and is dropped, so this run may not reach the point; it must then finish.
            assert first == 0 and not deterministic and point in TIMING_DEPENDENT, (point, first)
            check(cfg, reference_sha)
            continue
        second = run_child(cfg, f"{point}:1")
        if second != 0:
            assert killed(second)
            run_to_end(cfg)
        check(cfg, reference_sha)
        crashed.append(point)
    # The points every configuration must reach.
    assert {"ledger.sealed", "ledger.step_committed", "publish.latest_written",
            "checkpoint.after_cut", "train.before_commit", "rowlog.before_fsync", "rowlog.after_fsync",
            "journal.before_fsync", "journal.after_fsync"} <= set(crashed)


@pytest.mark.slow
def test_deterministic_equivalence_survives_many_kills(tmp_path) -> None:
    """A deterministic run killed at many points in a row ends byte-identical."""
    over = ["deterministic=true", "rollout.on_dropped_prompt=shrink", *FAILURES,
            "rollout.min_step_batch_fraction=0.25", "sampler.max_lookahead_versions=2"]
    reference = config(tmp_path / "reference", *over)
    run_to_end(reference)
    cfg = config(tmp_path / "killed", *over)
    for point in ["ledger.sealed:7", "publish.dir_renamed:1", "ledger.ready:5",
                  "train.before_commit:2", "ledger.taken:9", "publish.latest_written:2"]:
        code = run_child(cfg, point)
        assert code == 0 or killed(code)
    run_to_end(cfg)
    report = check(cfg, final_sha(reference))
    assert report.restarts >= 6


@pytest.mark.slow
@pytest.mark.parametrize("at", ["ledger.step_committed:3", "ledger.sealed:20", "ledger.claimed:6"])
def test_deterministic_graceful_stops_end_byte_identical(tmp_path, at) -> None:
    """A SIGTERM in deterministic mode may land while groups still have to generate under
    an older weight version; the final checkpoint is then skipped (the previous one stands)
    rather than written in a state a resumed engine could not continue."""
    over = ["deterministic=true", "rollout.on_dropped_prompt=shrink", "engine.latency_ms=3",
            "checkpoint.every_steps=3", "sampler.max_lookahead_versions=2"]
    reference = config(tmp_path / "reference", *over)
    run_to_end(reference)
    cfg = config(tmp_path / "stopped", *over)
    assert run_child(cfg, at, crash_signal="TERM") == 128 + signal.SIGTERM
    run_to_end(cfg)
    check(cfg, final_sha(reference))

"""`rollkeep bench --suite cluster`: Ray start-up, throughput on the local backend and on
Ray replicas, a replica SIGKILLed mid-run and back, weight publication. The shape and
sanity of what it reports; how fast each thing is, is the benchmark's to measure."""

from __future__ import annotations

import json
import math
import os

import pytest

from rollkeep.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


@pytest.mark.skipif(not os.environ.get("ROLLKEEP_TEST_RANKS"),
                    reason="the slower tier (a minute of Ray runs): make test-ranks (ROLLKEEP_TEST_RANKS=1)")
def test_bench_cluster_quick_reports_every_part(tmp_path, capsys):
    pytest.importorskip("ray")
    out = tmp_path / "cluster.json"
    assert main(["bench", "--suite", "cluster", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())["cluster"]
    assert r["repeats"] == 1 and r["quick"]

    init = r["ray_init"]["median"]
    assert all(init[k] > 0 for k in ("import_s", "init_s", "wall_s"))
    assert init["wall_s"] >= init["import_s"] + init["init_s"]
    assert set(r["pool_open_s"]) == {"1", "2"} and all(s > 0 for s in r["pool_open_s"].values())

    for name, variants, steps in (
        ("toy", ["local", "ray x1", "ray x2"], 10),
        ("torch", ["local", "ray x1"], 3),
    ):
        x = r[name]
        assert list(x["variants"]) == variants and x["steps"] == steps
        for label, m in x["variants"].items():
            assert m["steps"] == steps and m["tokens"] > 0 and m["attempts"] > 0
            assert m["tokens_per_s"] == pytest.approx(m["tokens"] / m["run_s"])
            assert m["steps_per_s"] == pytest.approx(steps / m["run_s"])
            assert 0 < m["peak_in_flight"] <= m["attempts"]
            n = 0 if label == "local" else int(label.removeprefix("ray x"))
            assert m["replicas_started"] == n
            assert len(m["sealed_per_replica"]) == max(n, 1)  # every replica got work
            assert sum(m["sealed_per_replica"].values()) == m["attempts"]
            assert label in printed
        assert x["variants"][x["baseline"]]["speed_vs_first"] == 1.0
    # P x (lookahead + 1) x G attempts in flight at most: 8 x 2 x 4
    assert all(m["peak_in_flight"] <= 64 for m in r["toy"]["variants"].values())

    k = r["kill"]
    assert k["all_came_back"]
    (run,) = k["runs"]
    assert run["came_back"] and run["restart"] == 1 and run["steps"] == 30
    assert run["down_s"] >= 0 and run["kill_to_back_s"] >= run["kill_to_died_s"] >= 0
    assert run["attempts_failed"] == run["failed_lines"] == run["retried"]
    if run["attempts_failed"]:
        assert 0 <= run["retry_dispatched_s"] <= run["retry_sealed_s"]
    else:
        assert math.isnan(run["retry_sealed_s"])
    assert run["sealed_after_back"] > 0  # it got work again

    w = r["weights"]
    assert w["params"] > 100_000 and w["mb"] == pytest.approx(w["params"] * 4 / 1e6)
    assert (
        w["put_s"] > 0
        and set(w["refit_s"]) == {"1", "2"}
        and all(s > 0 for s in w["refit_s"].values())
    )
    for title in ("Ray start-up", "throughput vs replicas", "killed mid-run", "weight publication"):
        assert title in printed


def test_bench_cluster_without_ray_is_skipped(tmp_path, capsys, monkeypatch):
    from rollkeep.bench import cluster

    monkeypatch.setattr(cluster, "ray_available", lambda: False)
    out = tmp_path / "cluster.json"
    assert main(["bench", "--suite", "cluster", "--quick", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["cluster"] == {"skipped": cluster.RAY_MISSING}
    assert "skipped: ray is not installed (pip install 'rollkeep[ray]')" in capsys.readouterr().out

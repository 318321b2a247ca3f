"""`rollkeep bench --suite controller`: the scheduler alone and the scale sweep. What it
measures (speed) is the benchmark's; here: the driver trains every step with every sibling
it dispatched, the sweep covers the sizes it names, and the exponent fit is a fit."""

from __future__ import annotations

import json
import math

import pytest

from rollkeep.bench.scale import fitted_exponent
from rollkeep.bench.scheduler import run_scheduler
from rollkeep.cli import main


def test_fitted_exponent_recovers_a_power_law():
    sizes = [1000, 10_000, 100_000]
    assert fitted_exponent(sizes, [3e-6 * s**1.5 for s in sizes]) == pytest.approx(1.5)
    assert fitted_exponent(sizes, [7.0] * 3) == pytest.approx(0.0, abs=1e-12)
    assert fitted_exponent([10], [1.0]) is None  # one point fits no slope
    assert fitted_exponent([10, 10], [1.0, 2.0]) is None


@pytest.mark.parametrize("sinks", [False, True])
def test_the_scheduler_driver_trains_what_it_generates(sinks):
    r = run_scheduler(group_size=4, prompts_per_step=8, steps=3, sinks=sinks)
    # Nothing fails and nothing is evicted: every dispatched sibling is sealed and trained, and
    # the lookahead's groups (admitted for step 4, which never comes) are generated too.
    assert r["steps"] == 3
    assert 3 * 8 * 4 <= r["siblings"] <= (3 + 1) * 8 * 4
    assert r["siblings"] % 4 == 0
    assert math.isfinite(r["siblings_per_cpu_s"]) and r["siblings_per_cpu_s"] > 0


@pytest.mark.slow
def test_bench_controller_suite_reports_the_sweep(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["bench", "--suite", "controller", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())["control_plane"]
    assert r["scheduler"]["bare_siblings_per_cpu_s"] > 0 and r["scheduler"]["sinks_siblings_per_cpu_s"] > 0
    sweep = r["sweep"]
    assert sweep["scheduling_by_group_size"]["group_size"] == [4, 16]
    assert sweep["checkpoint_by_inflight"]["inflight_groups"] == [1000, 4000]
    for fit in (sweep["checkpoint_by_inflight"], sweep["checkpoint_by_group_size"]):
        assert all(b > 0 for b in fit["bytes"])
        assert fit["bytes"][1] > fit["bytes"][0]  # more groups (or siblings) encode to more bytes
        assert fit["bytes_exponent"] > 0
        assert all(t > 0 for t in fit["write_after_restore_s"])
        # What a write can reach at best: the disk's time over the disk's and the manifest's hash.
        assert len(fit["write_over_disk_bound"]) == len(fit["bytes"])
        assert all(0 < x < 1 for x in fit["write_over_disk_bound"])
    # The checkpoint's medians: one size (quick), one fresh process, its numbers whole.
    m = r["checkpoint"]
    assert m["inflight_groups"] == [1000] and m["repeats"] == 1
    assert [len(runs) for runs in m["write_s_runs"]] == [1] and m["write_s"] == [m["write_s_runs"][0][0]]
    # The same checkpoint as the sweep's at that size (the manifest's time may differ in length).
    assert m["bytes"][0] == pytest.approx(sweep["checkpoint_by_inflight"]["bytes"][0], abs=64)
    assert all(t > 0 for key in ("write_s", "restore_s", "write_after_restore_s") for t in m[key])
    # The write's phases partition it: each is timed once, and together they are within it.
    ck = sweep["checkpoint_by_inflight"]
    phases = ck["write_phases"][-1]
    assert list(phases) == ["audit", "key_order", "locations", "index_columns", "encode_ledger", "encode_rows",
                            "publish"]
    assert all(t >= 0 for t in phases.values()) and sum(phases.values()) <= ck["write_s"][-1]
    assert "exponent" in printed and "siblings per CPU-second" in printed and "by phase: audit" in printed
    assert "dd/(dd + sha256)" in printed and "medians of 1 interleaved fresh processes" in printed

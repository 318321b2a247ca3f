"""`rollkeep bench --suite waste`: completions generated / trained per sampler on the same
uninterrupted job without failures. in_order and weight_fifo must generate nothing twice;
windowed may (it evicts the stragglers it overtakes); with --kills, each sampler also runs
SIGKILLed and resumed, exactly-once; how fast each one is, is the benchmark's to measure."""

from __future__ import annotations

import json

import pytest

from rollkeep.cli import main


@pytest.mark.slow
def test_bench_waste_suite_reports_generated_over_trained_per_sampler(tmp_path, capsys):
    out = tmp_path / "waste.json"
    assert main(["bench", "--suite", "waste", "--quick", "--kills", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())["waste"]
    assert r["steps"] == 10 and r["repeats"] == 1
    assert list(r["samplers"]) == ["in_order", "weight_fifo", "windowed"]
    for sampler, m in r["samplers"].items():
        assert sampler in printed
        assert m["trained"] == 10 * 8 * 4  # steps x P x G
        assert m["ratio"] == m["generated"] / m["trained"]
        assert m["steps_per_s"] == pytest.approx(10 / m["run_s"])
        assert 0 < m["goodput"] <= 1 and 0 < m["killed_goodput"] <= 1
        assert m["kills_landed"] == 1  # and the killed run was checked exactly-once
    for sampler in ("in_order", "weight_fifo"):
        m = r["samplers"][sampler]
        assert (m["generated"], m["evicted"], m["ratio"]) == (m["trained"], 0, 1.0)
    windowed = r["samplers"]["windowed"]
    assert windowed["generated"] == windowed["trained"] + 4 * windowed["evicted"]
    assert r["samplers"]["in_order"]["speed_vs_in_order"] == 1.0

"""Async speedup: the same job, uninterrupted, with generation allowed to run 0, 1 (and 2)
weight versions ahead of training (`sampler.max_lookahead_versions`, in_order).

    async_speedup(workload, repeats=..., quick=..., log=...)

Time is taken from the trace, run_started → run_finished, so subprocess start-up (Python,
imports, model build) is excluded. Per lookahead: the median over repeats of that time and
steps/s = steps / median time; speedup(n) = median time(0) / median time(n). The toy job
gets a trainer step of 100 ms, about as long as a step's generation (the longest of 32
generations of 20 + U(0, 80) ms), so overlapping the two is what there is to gain.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .preemption import run_preempted, workload

TOY_STEP_SLEEP_MS = 100


def async_speedup(
    workload_name: str,
    *,
    repeats: int,
    quick: bool = False,
    log: Any = print,
    lookaheads: Sequence[int] | None = None,
    steps: int | None = None,
    workdir: Path | None = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Median run time and steps/s per lookahead, and the speedup over lookahead 0.
    `lookaheads` defaults to (0, 1) with `quick`, else (0, 1, 2); `steps` overrides the
    workload's `train.total_steps` (default: the workload's, halved for a quick toy run). Lookaheads are interleaved within each repeat."""
    w = workload(workload_name, quick=quick)
    lookaheads = tuple(lookaheads or ((0, 1) if quick else (0, 1, 2)))
    if 0 not in lookaheads:
        raise ValueError("async_speedup: lookaheads must include 0, the synchronous baseline")
    n_steps = steps or (w.steps // 2 if quick and w.name == "toy" else w.steps)
    overrides = [*w.overrides, f"train.total_steps={n_steps}"]
    describe = w.describe.replace(f"{w.steps} steps", f"{n_steps} steps")
    if w.name == "toy":
        overrides.append(f"trainer.step_sleep_ms={TOY_STEP_SLEEP_MS}")
        describe = describe.replace("trainer 5 ms/step", f"trainer {TOY_STEP_SLEEP_MS} ms/step")
    seconds: dict[int, list[float]] = {la: [] for la in lookaheads}
    with tempfile.TemporaryDirectory(prefix="rollkeep-speedup-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        for r in range(repeats):
            for la in lookaheads:
                res = run_preempted(
                    w.config,
                    [*overrides, f"sampler.max_lookahead_versions={la}"],
                    kill_delays=[],
                    workdir=root / w.name / f"r{r}-la{la}",
                    timeout=timeout,
                )
                if res["steps"] != n_steps:
                    raise RuntimeError(
                        f"async_speedup: the run trained {res['steps']} steps, expected {n_steps}"
                    )
                seconds[la].append(res["run_s"])
                log(
                    f"speedup {w.name}: repeat {r + 1}/{repeats} lookahead {la}: "
                    f"{res['run_s']:.2f} s ({n_steps / res['run_s']:.2f} steps/s)"
                )
    base = statistics.median(seconds[0])
    out = {}
    for la in lookaheads:
        med = statistics.median(seconds[la])
        out[str(la)] = {
            "run_s": med,
            "steps_per_s": n_steps / med,
            "speedup_vs_0": base / med,
            "runs_s": seconds[la],
        }
    return {
        "workload": w.name,
        "describe": describe,
        "steps": n_steps,
        "repeats": repeats,
        "lookaheads": out,
    }

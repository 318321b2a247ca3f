"""Wasted generation: the same job without injected failures, once per sampler (in_order,
weight_fifo, windowed), uninterrupted and, with `kills`, SIGKILLed that many times.

    waste(repeats=..., quick=..., log=..., kills=0)

The job is the toy engine with very uneven latencies (20 ms + U(0, 80) ms per generation,
so groups finish far out of admission order) and a 50 ms trainer step (so admission is
asked while a step trains), P = 8, G = 4, a window of 1 for every sampler
(`max_lookahead_versions` = `max_staleness_versions` = 1). Measured from the trace:

  generated       completions sealed (every `sealed` event)
  trained         completions trained: prompts of the committed steps x group size
  ratio           generated / trained: 1.00 means nothing was generated twice
  evicted         groups evicted as stale (each one is generated again)
  run_s           run_started -> run_finished (subprocess start-up excluded)
  steps_per_s     steps / run_s; trained_per_s: trained completions / run_s
  goodput         tokens trained / tokens generated (bench/preemption.py's measure)
  killed_goodput  the same job SIGKILLed `kills` times (the instants drawn as the
                  preemption suite draws them, from the sampler's uninterrupted run time)
                  and resumed until it finishes; killed_evicted: its groups evicted

Medians over repeats (samplers interleaved within each repeat); "vs in_order" is the
median over repeats of run_s(in_order) / run_s(sampler), so above 1.00x is faster.

Without failures in_order and weight_fifo generate nothing twice (ratio 1.00). windowed
shares weight_fifo's gate but its selection waits for no one, so a straggler overtaken by
the W+1 steps of its window is evicted and generated again (`sampler.on_stale:
regenerate`); on this job that is a few groups per run (issue 29: before the gate about
half of all generation).
"""

from __future__ import annotations

import statistics
import tempfile
from collections import Counter
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

from ..core.custody.trace_schema import STEP_COMMITTED
from ..core.rollout.samplers import SAMPLERS
from ..trace import read_trace
from .preemption import kill_schedule, run_preempted

GROUP_SIZE = 4
PROMPTS_PER_STEP = 8
WINDOW = 1
TRAINER_STEP_MS = 50
MEASURES = ("generated", "trained", "ratio", "evicted", "run_s", "steps_per_s", "trained_per_s", "goodput")
KILLED_MEASURES = ("killed_goodput", "killed_evicted", "kills_landed")


def job(steps: int) -> tuple[str, list[str], str]:
    """(config path, overrides, description) of the job every sampler runs."""
    overrides = [
        "engine.latency_ms=20",
        "engine.latency_jitter_ms=80",
        "engine.infra_fail_rate=0",
        "engine.data_fail_rate=0",
        f"trainer.step_sleep_ms={TRAINER_STEP_MS}",
        f"rollout.group_size={GROUP_SIZE}",
        f"train.num_prompts_per_step={PROMPTS_PER_STEP}",
        f"train.total_steps={steps}",
        f"sampler.max_lookahead_versions={WINDOW}",
        f"sampler.max_staleness_versions={WINDOW}",
        "checkpoint.every_steps=5",
        "data.generated.n_rows=1024",
    ]
    describe = (
        f"toy engine 20+U(0,80) ms per generation, no injected failures, trainer "
        f"{TRAINER_STEP_MS} ms/step, P={PROMPTS_PER_STEP}, G={GROUP_SIZE}, window {WINDOW}, "
        f"{steps} steps, uninterrupted"
    )
    return str(files("rollkeep") / "configs" / "toy.yaml"), overrides, describe


def completions(run_dir: Path, group_size: int) -> dict[str, int]:
    """Completions generated and trained, and groups evicted, from an uninterrupted run's
    trace."""
    lines, _ = read_trace(Path(run_dir) / "trace.jsonl")
    events = Counter(x["event"] for x in lines)
    groups = sum(len(x["prompts"]) for x in lines if x["event"] == STEP_COMMITTED)
    return {
        "generated": events["sealed"],
        "trained": groups * group_size,
        "evicted": events["evicted"],
    }


def waste(
    *,
    repeats: int,
    quick: bool = False,
    log: Any = print,
    samplers: Sequence[str] = SAMPLERS,
    steps: int | None = None,
    workdir: Path | None = None,
    timeout: float = 600.0,
    kills: int = 0,
    seed: int = 0,
) -> dict[str, Any]:
    """Per sampler: the medians over repeats of the measures in the module docstring.
    `steps` defaults to 30 (10 with `quick`)."""
    n_steps = steps or (10 if quick else 30)
    config, overrides, describe = job(n_steps)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in samplers}
    with tempfile.TemporaryDirectory(prefix="rollkeep-waste-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        for r in range(repeats):
            for sampler in samplers:
                where = root / f"r{r}-{sampler}"
                res = run_preempted(
                    config,
                    [*overrides, f"sampler.name={sampler}"],
                    kill_delays=[],
                    workdir=where,
                    timeout=timeout,
                )
                if res["steps"] != n_steps:
                    raise RuntimeError(
                        f"waste: the {sampler} run trained {res['steps']} steps, expected {n_steps}"
                    )
                c = completions(where / "run", GROUP_SIZE)
                m = {
                    **c,
                    "ratio": c["generated"] / c["trained"],
                    "run_s": res["run_s"],
                    "steps_per_s": n_steps / res["run_s"],
                    "trained_per_s": c["trained"] / res["run_s"],
                    "goodput": res["goodput"],
                }
                log(
                    f"waste: repeat {r + 1}/{repeats} {sampler:11} generated {c['generated']} "
                    f"for {c['trained']} trained ({m['ratio']:.2f}), {c['evicted']} evicted, "
                    f"{res['run_s']:.2f} s ({m['steps_per_s']:.2f} steps/s)"
                )
                if kills:
                    delays, killed_dir = kill_schedule(seed, r, kills, res["run_s"]), root / f"r{r}-{sampler}-killed"
                    killed = run_preempted(config, [*overrides, f"sampler.name={sampler}"],
                                           kill_delays=delays, workdir=killed_dir, timeout=timeout)
                    if killed["steps"] != n_steps or killed["prompts_duplicated"] or killed["prompts_lost"]:
                        raise RuntimeError(f"waste: the killed {sampler} run is not exactly-once: {killed}")
                    m.update(killed_goodput=killed["goodput"], kills_landed=killed["kills_landed"],
                             killed_evicted=completions(killed_dir / "run", GROUP_SIZE)["evicted"])
                    log(f"waste: repeat {r + 1}/{repeats} {sampler:11} {killed['kills_landed']} kills: "
                        f"goodput {killed['goodput']:.3f} (uninterrupted {m['goodput']:.3f})")
                runs[sampler].append(m)
    out = {}
    for sampler in samplers:
        keys = (*MEASURES, *(KILLED_MEASURES if kills else ()))
        med = {k: statistics.median(x[k] for x in runs[sampler]) for k in keys}
        if "in_order" in runs:
            med["speed_vs_in_order"] = statistics.median(
                b["run_s"] / x["run_s"]
                for x, b in zip(runs[sampler], runs["in_order"], strict=True)
            )
        out[sampler] = med
    return {
        "describe": describe,
        "steps": n_steps,
        "repeats": repeats,
        "kills": kills,
        "samplers": out,
        "runs": runs,
    }

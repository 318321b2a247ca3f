"""Effects outside the process (`rollkeep bench --suite effects`, docs/effects.md).

    effects_bench(kills=..., repeats=..., quick=..., log=...)

Every job is `rollkeep train` on the toy engine (real subprocesses), calling the simulated
outside of `rollkeep.bench.outside` (a file that counts calls by idempotency key):

  latency        a judge reward (`outside:judge`) with a call of 0 ms and of 20 ms (awaited,
                 as an HTTP call): per call, the seconds the effect record adds (the wait for
                 the intent's fsync) against the call's own, p50 / p99 (`effects/*` metrics)
  kills          the same job SIGKILLed `kills` times at random instants, resumed to the end:
                 calls per trained sibling (the calls of the key its reward was answered
                 with), the keys called again after their outcome was recorded (must be 0:
                 a restored record answers them), and the keys sent again by `retry` because
                 a kill took their outcome (the call had happened)
  cut_hold       a lease environment (`outside:SlowLeaseEnv`, 3 turns of 20 ms steps) with 0,
                 64 and 1,024 live episodes: the cut's hold (capture, `cut_hold_seconds`) and
                 its environment phase (`env_wait_seconds`: the step boundary waiting for
                 the steps in flight), medians over the checkpoints; 0 = single-turn

The machine is noisy: medians over `repeats`, and the ratios are the point.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from importlib.resources import files
from pathlib import Path
from typing import Any

from ..core.custody.trace_schema import (
    CHECKPOINT_PUBLISHED,
    EFFECT_ANSWERED,
    EFFECT_INTENT,
    SEALED,
    STEP_COMMITTED,
)
from ..lineage import lineage
from ..trace import read_trace
from .preemption import run_preempted

JOB = ["engine.latency_ms=5", "engine.latency_jitter_ms=10", "engine.infra_fail_rate=0", "engine.data_fail_rate=0",
       "rollout.group_size=4", "train.num_prompts_per_step=8", "data.generated.n_rows=400", "data.epochs=1",
       "checkpoint.every_steps=3", "eval.every_steps=0", "reward.fn=rollkeep.bench.outside:judge"]
LIVE = (0, 64, 1024)


def _config() -> str:
    return str(files("rollkeep") / "configs" / "toy.yaml")


@contextmanager
def _outside(work: Path, **env: str):
    keep = {k: os.environ.get(k) for k in ("ROLLKEEP_TEST_CALLS", "ROLLKEEP_TEST_LEASES", *env)}
    os.environ["ROLLKEEP_TEST_CALLS"] = str(work / "calls.log")
    (work / "leases").mkdir(parents=True, exist_ok=True)
    os.environ["ROLLKEEP_TEST_LEASES"] = str(work / "leases")
    os.environ.update(env)
    try:
        yield work / "calls.log"
    finally:
        for k, v in keep.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _calls(path: Path) -> Counter:
    return Counter(path.read_text().split()) if path.exists() else Counter()


def _last_metrics(run_dir: Path) -> dict[str, Any]:
    import json

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return next(x for x in reversed(lines) if "effects/made" in x)


def latency(work: Path, call_s: float, steps: int) -> dict[str, float]:
    with _outside(work, ROLLKEEP_TEST_LATENCY_S=str(call_s)):
        run_preempted(_config(), [*JOB, f"train.total_steps={steps}"], kill_delays=[], workdir=work / "job")
    m = _last_metrics(work / "job" / "run")
    return {k.split("/", 1)[1]: float(v) for k, v in m.items() if k.startswith("effects/") and k.endswith("_s")}


def calls_per_trained_sibling(run_dir: Path, calls: Counter, resent: set[str]) -> dict[str, float]:
    """For each trained sibling, the calls of the key its reward came from: the key its
    sealed attempt recorded, or the one it was answered from (an earlier attempt's); and
    the same over the siblings whose outcome was recorded before any kill (keys never
    sent again: the goal is 1.000)."""
    lines, _ = read_trace(run_dir / "trace.jsonl")
    lin = lineage(lines)
    trained_groups = {g for x in lines if x["event"] == STEP_COMMITTED and int(x["step"]) in lin.steps
                      for g in x["group_ids"]}
    key_of: dict[tuple[str, int, int], str] = {}
    for x in lines:
        if x["event"] in (EFFECT_INTENT, EFFECT_ANSWERED):
            key_of[(x["group_id"], int(x["generation"]), int(x["attempt"]))] = x["key"]
    sealed = {(x["group_id"], int(x["generation"])): int(x["attempt"]) for x in lines if x["event"] == SEALED}
    keys = [key_of[(g, s, a)] for (g, s), a in sealed.items() if g in trained_groups and (g, s, a) in key_of]
    per = [calls[k] for k in keys]
    recorded = [calls[k] for k in keys if k not in resent]
    return {"trained_siblings": len(per), "calls_per_trained_sibling": sum(per) / len(per) if per else 0.0,
            "siblings_called_more_than_once": sum(1 for n in per if n > 1),
            "calls_per_trained_sibling_recorded": sum(recorded) / len(recorded) if recorded else 0.0}


def under_kills(work: Path, kills: int, seed: int, steps: int) -> dict[str, Any]:
    rng = random.Random(seed)
    delays = [round(rng.uniform(0.1, 0.6), 3) for _ in range(kills)]
    with _outside(work) as log:
        out = run_preempted(_config(), [*JOB, "engine.latency_ms=20", "engine.latency_jitter_ms=20",
                                        f"train.total_steps={steps}"], kill_delays=delays, workdir=work / "job")
        calls = _calls(log)
    run_dir = work / "job" / "run"
    lines, _ = read_trace(run_dir / "trace.jsonl")
    resent = {x["key"] for x in lines if x["event"] == EFFECT_ANSWERED and x.get("resent")}
    answered = sum(1 for x in lines if x["event"] == EFFECT_ANSWERED and not x.get("resent"))
    # A key called again after its outcome was recorded would have been answered instead: the
    # only repeats are the keys `retry` sent again (their outcome had died with a process).
    unexplained = [k for k, n in calls.items() if n > 1 and k not in resent]
    return {"kills_landed": out["kills_landed"], "calls": sum(calls.values()), "keys": len(calls),
            "answered_from_record": answered, "resent": len(resent), "repeats_after_record": len(unexplained),
            "prompts_duplicated": out["prompts_duplicated"], "prompts_lost": out["prompts_lost"],
            **calls_per_trained_sibling(run_dir, calls, resent)}


def cut_hold(work: Path, live: int, steps: int) -> dict[str, float]:
    if live:
        prompts = max(1, live // 8)  # G = 4 and one version of lookahead: about 8 x P episodes live
        job = [*JOB[:-1], "env.factory=rollkeep.bench.outside:SlowLeaseEnv", "env.kwargs={turns: 3, step_s: 0.02}",
               "env.max_turns=3", f"train.num_prompts_per_step={prompts}", f"data.generated.n_rows={prompts * steps}",
               "checkpoint.every_steps=1", "max_inflight_prompts=100000"]
    else:
        job = [*JOB, "checkpoint.every_steps=1"]
    with _outside(work):
        run_preempted(_config(), [*job, f"train.total_steps={steps}"], kill_delays=[], workdir=work / "job")
    lines, _ = read_trace(work / "job" / "run" / "trace.jsonl")
    pub = [x for x in lines if x["event"] == CHECKPOINT_PUBLISHED]
    return {"cut_hold_s": statistics.median(x["cut_hold_seconds"] for x in pub),
            "env_wait_s": statistics.median(x.get("env_wait_seconds", 0.0) for x in pub),
            "env_wait_max_s": max(x.get("env_wait_seconds", 0.0) for x in pub),
            "checkpoints": len(pub)}


def effects_bench(*, kills: int = 6, repeats: int = 1, quick: bool = False,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    steps = 6 if quick else 20
    out: dict[str, Any] = {"latency": {}, "kills": [], "cut_hold": {}}
    with tempfile.TemporaryDirectory(prefix="rollkeep-bench-effects-") as tmp:
        root = Path(tmp)
        for call_ms in (0, 20):
            log(f"effects: record latency with a {call_ms} ms call")
            runs = [latency(root / f"lat-{call_ms}-{r}", call_ms / 1000, steps) for r in range(repeats)]
            out["latency"][f"{call_ms}ms"] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for r in range(repeats):
            log(f"effects: {kills} kills, repeat {r + 1}")
            out["kills"].append(under_kills(root / f"kills-{r}", kills, seed=r, steps=steps * 12))
        for live in LIVE:
            log(f"effects: the cut's hold with {live} live episodes")
            runs = [cut_hold(root / f"cut-{live}-{r}", live, 4 if quick else 8) for r in range(repeats)]
            out["cut_hold"][str(live)] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return out


def table_rows(res: dict[str, Any]) -> list[list[str]]:
    rows = [["latency", f"call {name}", f"record p50 {v.get('record_p50_s', 0) * 1e3:.1f} ms, "
             f"p99 {v.get('record_p99_s', 0) * 1e3:.1f} ms; call p50 {v.get('call_p50_s', 0) * 1e3:.1f} ms, "
             f"p99 {v.get('call_p99_s', 0) * 1e3:.1f} ms"] for name, v in res["latency"].items()]
    for k in res["kills"]:
        rows.append(["kills", f"{k['kills_landed']} landed",
                     f"calls per trained sibling {k['calls_per_trained_sibling']:.3f} ({k['trained_siblings']} "
                     f"siblings, {k['siblings_called_more_than_once']} called twice), "
                     f"{k['calls_per_trained_sibling_recorded']:.3f} where the outcome was recorded; repeats after a record "
                     f"{k['repeats_after_record']}; answered {k['answered_from_record']}, resent {k['resent']}; "
                     f"prompts duplicated {k['prompts_duplicated']}, lost {k['prompts_lost']}"])
    for live, v in res["cut_hold"].items():
        rows.append(["cut hold", f"{live} live episodes", f"capture {v['cut_hold_s'] * 1e3:.2f} ms, environment "
                     f"phase median {v['env_wait_s'] * 1e3:.1f} ms (max {v['env_wait_max_s'] * 1e3:.1f} ms), "
                     f"{v['checkpoints']} checkpoints"])
    return rows

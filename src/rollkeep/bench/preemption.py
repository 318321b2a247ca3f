"""Goodput under preemption: the same job killed at the same instants, once per variant:
`journal` (the default: recovery.mode=sibling with the journal, partial generations
resumed), and each `recovery.mode` restoring from its checkpoint alone
(`journal.enabled=false`); on the long-generation workloads, `journal` against
`regenerate` (the journal on, cut-off generations started over); on the multi-turn workload
also `sibling` (whole episodes from the checkpoint alone).

    run_preempted(config, overrides, kill_delays=..., workdir=..., timeout=...)
        `rollkeep train` as a subprocess in WORKDIR/run (WORKDIR wiped first); segment i is
        SIGKILLed `kill_delays[i]` seconds after its `run_started` reaches the trace, then
        the job is resumed until it finishes. Measured from the trace and metrics.jsonl.
    goodput(workload, kills=..., repeats=..., seed=..., quick=..., log=...)
        one uninterrupted reference run, then per repeat r one kill schedule (drawn once
        from a `random.Random` seeded with (seed, r): K instants uniform in the first 70%
        of the reference's run time) applied to every variant.

The measures of one killed-and-resumed job:

  wall_s              seconds from the first launch to the exit of the final run,
                      subprocess start-up included (Python, imports, restore: paid once
                      per restart, as a real preemption pays it)
  run_s               the same, start-up excluded: the sum over runs of run_started → the
                      run's last trace line
  tokens_generated    `tokens_generated`: every attempt's new tokens, sealed or cut off
                      (a SIGKILL can lose the last ~50 ms of buffered lines of a killed
                      run, whose work no checkpoint and no journal kept either: the
                      journal is never ahead of the trace)
  tokens_trained      sum of `tokens` of the metrics.jsonl step lines of the surviving
                      lineage: the steps the final weights were trained on
  goodput             tokens_trained / tokens_generated
  prompts_lost        distinct prompts dropped with a reason starting "lost": in flight at
                      the restored cut under recovery.mode=cursor_only (0 otherwise)
  prompts_duplicated  prompts trained more than once in the surviving lineage (must be 0)
  restarts            runs after the first; kills_landed: segments the SIGKILL really hit
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

from ..chaos import _env, _trace_mark, _train_cmd, _wait_started
from ..core.custody.trace_schema import DROPPED, PROGRESSED, SEALED, STEP_COMMITTED, TURN_SEALED
from ..core.errors import RollkeepError
from ..lineage import lineage
from ..trace import read_trace

#: What each variant runs with: `journal` keeps the work since the last checkpoint (the
#: default of `rollkeep train`), the others restore from the checkpoint alone, per mode.
VARIANTS: dict[str, tuple[str, ...]] = {
    "journal": ("recovery.mode=sibling", "journal.enabled=true", "recovery.partial=resume"),
    "regenerate": ("recovery.mode=sibling", "journal.enabled=true", "recovery.partial=regenerate"),
    "sibling": ("recovery.mode=sibling", "journal.enabled=false"),
    "prompt_group": ("recovery.mode=prompt_group", "journal.enabled=false"),
    "cursor_only": ("recovery.mode=cursor_only",),
}
MODES = ("journal", "sibling", "prompt_group", "cursor_only")  # what a workload compares by default
WORKLOADS = ("toy", "model")
#: Long generations: partial generations resumed (`journal`, the default) against started
#: over (`regenerate`), both with the journal, at the same kill instants (issue 11).
LONG_WORKLOADS = ("toy_long", "model_long")
LONG_MODES = ("journal", "regenerate")
#: Multi-turn episodes (issue 12): finished turns and the turn in flight kept (`journal`),
#: finished turns kept and the turn in flight started over (`regenerate`), and whole
#: episodes from the checkpoint alone (`sibling`, the journal off), at the same instants.
EPISODE_WORKLOADS = ("toy_episodes",)
EPISODE_MODES = ("journal", "regenerate", "sibling")
KILL_WINDOW = 0.7  # kill instants are uniform in [0, KILL_WINDOW x the reference run time]
MEASURES = (
    "wall_s",
    "run_s",
    "tokens_generated",
    "tokens_trained",
    "goodput",
    "prompts_lost",
    "prompts_duplicated",
    "restarts",
    "kills_landed",
    "steps",
)


@dataclass(frozen=True)
class Workload:
    name: str
    config: str  # path of the YAML config
    overrides: tuple[str, ...]
    steps: int
    describe: str


def workload(name: str, *, quick: bool = False) -> Workload:
    """The benchmark jobs. `toy`: the toy engine with long, uneven generations (20 ms + up
    to 80 ms each, so groups are half sealed at every cut), a 5 ms trainer, in_order with
    lookahead 1. `model`: the built-in GPT on two-digit addition, no warm start, no eval."""
    if name == "toy":
        steps = 30 if quick else 60
        every = 5  # ~0.4 s apart, less than the ~0.8 s between kills: kills land between two
        return Workload(
            "toy",
            str(files("rollkeep") / "configs" / "toy.yaml"),
            (
                "engine.latency_ms=20",
                "engine.latency_jitter_ms=80",
                "trainer.step_sleep_ms=5",
                "sampler.name=in_order",
                "sampler.max_lookahead_versions=1",
                f"train.total_steps={steps}",
                f"checkpoint.every_steps={every}",
                # room for the prompts cursor_only loses and refills from the source
                "data.generated.n_rows=1024",
            ),
            steps,
            f"toy engine 20+U(0,80) ms per generation, trainer 5 ms/step, P=8, G=4, "
            f"{steps} steps, checkpoint every {every}",
        )
    if name == "model":
        steps = 8 if quick else 16
        every = 2  # ~0.3 s apart, as kills come ~0.5 s apart
        return Workload(
            "model",
            str(files("rollkeep") / "configs" / "arith.yaml"),
            (
                "warmup.sft_steps=0",
                "eval.every_steps=0",
                "sampler.name=in_order",
                "sampler.max_lookahead_versions=1",
                f"train.total_steps={steps}",
                f"checkpoint.every_steps={every}",
            ),
            steps,
            f"built-in GPT (torch, CPU) on arith, P=16, G=8, {steps} steps, checkpoint every {every}",
        )
    if name == "toy_long":
        steps = 20 if quick else 40
        every = 10
        return Workload(
            "toy_long",
            str(files("rollkeep") / "configs" / "toy.yaml"),
            (
                "engine.latency_ms=5", "engine.latency_jitter_ms=0", "engine.completion_tokens=64",
                "engine.token_ms=2", "recovery.progress_ms=10", "trainer.step_sleep_ms=5", "sampler.name=in_order",
                "sampler.max_lookahead_versions=1", f"train.total_steps={steps}",
                f"checkpoint.every_steps={every}", "data.generated.n_rows=1024",
            ),
            steps,
            f"toy engine streaming up to 64 tokens at 2 ms each (5 ms + ~130 ms per generation, "
            f"progress recorded every 10 ms: a 1-minute generation recorded every ~5 s, scaled "
            f"down), trainer 5 ms/step, P=8, G=4, {steps} steps, checkpoint every {every}",
        )
    if name == "model_long":
        steps = 6 if quick else 12
        every = 4
        return Workload(
            "model_long",
            str(files("rollkeep") / "configs" / "arith.yaml"),
            (
                "warmup.sft_steps=0", "eval.every_steps=0", "engine.max_new_tokens=24", "recovery.progress_ms=20",
                "sampler.name=in_order", "sampler.max_lookahead_versions=1",
                f"train.total_steps={steps}", f"checkpoint.every_steps={every}",
            ),
            steps,
            f"built-in GPT (torch, CPU) from scratch on arith with up to 24 new tokens (it rarely "
            f"stops early), progress recorded every 20 ms, P=16, G=8, {steps} steps, checkpoint every {every}",
        )
    if name == "toy_episodes":
        steps = 20 if quick else 40
        every = 10
        return Workload(
            "toy_episodes",
            str(files("rollkeep") / "configs" / "calc_toy.yaml"),
            (
                "env.max_turns=4", "engine.latency_ms=10", "engine.completion_tokens=16", "engine.token_ms=2",
                "engine.infra_fail_rate=0", "engine.data_fail_rate=0", "recovery.progress_ms=10",
                "trainer.step_sleep_ms=5", "sampler.name=in_order", "sampler.max_lookahead_versions=1",
                f"train.total_steps={steps}", f"checkpoint.every_steps={every}", "data.epochs=null",
                "data.generated.n_rows=1024",
            ),
            steps,
            f"calc environment on the toy engine: 4-turn episodes (3 tool calls, then the answer), "
            f"each turn 10 ms + up to ~26 streamed tokens at 2 ms (~150 ms per episode), trainer "
            f"5 ms/step, P=8, G=4, {steps} steps, checkpoint every {every}",
        )
    raise ValueError(f"unknown workload {name!r} (expected one of "
                     f"{', '.join(WORKLOADS + LONG_WORKLOADS + EPISODE_WORKLOADS)})")


# ------------------------------------------------------------------------- one job


def run_preempted(
    config: str | None,
    overrides: list[str],
    *,
    kill_delays: list[float | str],
    workdir: Path,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Run the job, SIGKILL segment i `kill_delays[i]` s after its `run_started` (or, for a
    string, at that named crash point: `ROLLKEEP_CRASH_AT`, an instant that does not depend
    on timing), resume until it finishes; return the measures listed in the module
    docstring. A segment that finishes before its kill ends the schedule. `timeout` bounds
    each segment."""
    workdir = Path(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    run_dir, logs = workdir / "run", workdir / "logs"
    logs.mkdir(parents=True)
    trace = run_dir / "trace.jsonl"
    cmd = _train_cmd(config, [*overrides, f"run_dir={run_dir}", "logger.progress=none"])
    landed = 0
    t0 = time.monotonic()
    finished = False
    for i, delay in enumerate(kill_delays):
        if _segment(cmd, trace, logs / f"segment-{i}.stderr", kill_after=delay, timeout=timeout):
            landed += 1
        else:
            finished = True
            break
    if not finished:
        _segment(cmd, trace, logs / "final.stderr", kill_after=None, timeout=timeout)
    wall = time.monotonic() - t0
    return {"wall_s": wall, **measure(run_dir), "kills_landed": landed}


def _segment(
    cmd: list[str], trace: Path, stderr: Path, *, kill_after: float | str | None, timeout: float
) -> bool:
    """One run of the job. True if the SIGKILL landed; False if it finished (exit 0)."""
    mark = _trace_mark(trace)
    crash_at = kill_after if isinstance(kill_after, str) else None
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(cmd, env=_env(crash_at), stdout=subprocess.DEVNULL, stderr=err)
        try:
            if isinstance(kill_after, float | int):
                if not _wait_started(proc, trace, mark, timeout) and proc.poll() is None:
                    raise _failed("did not trace run_started", stderr, timeout)
                try:
                    proc.wait(timeout=kill_after)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGKILL)  # a no-op if it has just exited
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise _failed("did not finish", stderr, timeout) from None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode == -signal.SIGKILL and kill_after is not None:
        return True
    if proc.returncode != 0:
        raise _failed(f"failed with exit code {proc.returncode}", stderr, timeout)
    return False


def _failed(what: str, stderr: Path, timeout: float) -> RollkeepError:
    return RollkeepError(
        f"benchmark: `rollkeep train` {what} (segment timeout {timeout:.0f} s)",
        found=stderr.read_text(errors="replace")[-2000:] or "nothing on stderr",
        path=str(stderr),
        remedy="run `rollkeep train` with this config by hand and fix the error first",
    )


def measure(run_dir: Path) -> dict[str, Any]:
    """The measures of a finished run directory, from its trace and metrics.jsonl."""
    run_dir = Path(run_dir)
    lines, _ = read_trace(run_dir / "trace.jsonl")
    lin = lineage(lines)
    if lin.finished is None:
        raise RollkeepError("benchmark: the last run of the job did not finish", path=str(run_dir))
    generated = tokens_generated(lines)
    # The surviving commit of a surviving step is its last commit in the trace: a later
    # run that forgot it would have committed it again.
    survivors = {
        int(x["step"]): x["run_id"]
        for x in lines
        if x["event"] == STEP_COMMITTED and int(x["step"]) in lin.steps
    }
    wanted = {(run_id, step) for step, run_id in survivors.items()}
    trained, seen = 0, set()
    for rec in _jsonl(run_dir / "metrics.jsonl"):
        key = (rec.get("run_id"), rec.get("step"))
        if "tokens" in rec and "groups" in rec and key in wanted and key not in seen:
            seen.add(key)
            trained += int(rec["tokens"])
    if seen != wanted:
        raise RollkeepError(
            "benchmark: metrics.jsonl lacks the step lines of surviving steps",
            path=str(run_dir / "metrics.jsonl"),
            expected=f"{len(wanted)} step lines",
            found=f"{len(seen)}; missing steps {sorted(s for _, s in wanted - seen)[:10]}",
            remedy="this is a bug: a step survives only once its metrics line is written",
        )
    lost = {
        tuple(x["prompt"])
        for x in lines
        if x["event"] == DROPPED and str(x.get("reason", "")).startswith("lost")
    }
    run_s = 0.0
    for run in lin.runs:
        ts = [x["t"] for x in lines if x["run_id"] == run["run_id"]]
        run_s += max(ts) - run["t"]
    return {
        "run_s": run_s,
        "tokens_generated": generated,
        "tokens_trained": trained,
        "goodput": trained / generated if generated else 0.0,
        "prompts_lost": len(lost),
        "prompts_duplicated": len(lin.duplicates()),
        "restarts": len(lin.runs) - 1,
        "steps": len(lin.steps),
    }


def tokens_generated(lines: list[dict[str, Any]]) -> int:
    """Tokens the engines generated, as the trace saw them: each attempt's tokens beyond
    the prefix it continued (`resumed_from`), through its seal, or through its last
    `progressed` or `turn_sealed` event if it was cut off (a kill, a stop, a failure).
    Without them (the journal off, an engine that does not stream) only sealed attempts
    count. (In an episode, the environment's tokens count as generated, as they count as
    trained.)"""
    last: dict[tuple, int] = {}
    for x in lines:
        if x["event"] in (SEALED, PROGRESSED, TURN_SEALED):
            key = (x["run_id"], x["group_id"], x["generation"], x["attempt"])
            last[key] = int(x["tokens"]) - int(x.get("resumed_from", 0))
    return sum(last.values())


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete JSON lines of `path`; a line torn by a SIGKILL is skipped."""
    out = []
    if path.exists():
        for line in path.read_bytes().split(b"\n"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


# ------------------------------------------------------------------------- the suite


def kill_schedule(
    seed: int, repeat: int, kills: int, duration: float, window: float = KILL_WINDOW
) -> list[float]:
    """The kill delays of one repeat, drawn once and shared by every recovery mode.

    K kill instants are drawn uniformly in the first `window` of the uninterrupted run's
    `duration` (run time, start-up excluded) and sorted; segment i runs for the gap between
    instants i-1 and i. The delays add up to less than the job's run time, so all K kills
    land (the job cannot finish before its run time has passed), whatever the mode: every
    mode suffers the same number of kills at the same points of its run time. (A tuple
    cannot seed `random.Random` on Python >= 3.11, so (seed, repeat) is spelled as a
    string.)"""
    rng = random.Random(f"goodput/{seed}/{repeat}")
    instants = sorted(rng.uniform(0.0, window * duration) for _ in range(kills))
    return [round(b - a, 3) for a, b in zip([0.0, *instants], instants, strict=False)]


def goodput(
    workload_name: str,
    *,
    kills: int,
    repeats: int,
    seed: int = 0,
    quick: bool = False,
    log: Any = print,
    kill_window: float = KILL_WINDOW,
    workdir: Path | None = None,
    timeout: float = 600.0,
    modes: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Per variant (`modes`: the workload's default, `MODES`, `LONG_MODES` or `EPISODE_MODES`): the median
    over repeats of each measure of `run_preempted`, and the medians of the per-repeat
    ratios to the baseline (`sibling`, else the last variant) at the same kill instants."""
    w = workload(workload_name, quick=quick)
    if modes is None:
        modes = (LONG_MODES if workload_name in LONG_WORKLOADS else
                 EPISODE_MODES if workload_name in EPISODE_WORKLOADS else MODES)
    base = "sibling" if "sibling" in modes else modes[-1]
    with tempfile.TemporaryDirectory(prefix="rollkeep-goodput-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        ref = run_preempted(
            w.config,
            list(w.overrides),
            kill_delays=[],
            workdir=root / w.name / "reference",
            timeout=timeout,
        )
        log(
            f"goodput {w.name}: uninterrupted reference {ref['run_s']:.2f} s "
            f"({ref['wall_s']:.2f} s with start-up), goodput {ref['goodput']:.3f}"
        )
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        schedules = []
        for r in range(repeats):
            delays = kill_schedule(seed, r, kills, ref["run_s"], kill_window)
            schedules.append(delays)
            for mode in modes:
                res = run_preempted(
                    w.config,
                    [*w.overrides, *VARIANTS[mode]],
                    kill_delays=delays,
                    workdir=root / w.name / f"r{r}-{mode}",
                    timeout=timeout,
                )
                runs[mode].append(res)
                log(
                    f"goodput {w.name}: repeat {r + 1}/{repeats} {mode:12} runs killed after "
                    f"{', '.join(f'{d:.2f}' for d in delays)} s: {res['kills_landed']} landed, "
                    f"goodput {res['goodput']:.3f}, lost {res['prompts_lost']}, "
                    f"wall {res['wall_s']:.1f} s"
                )
    medians = {}
    for mode in modes:
        med = {k: statistics.median(x[k] for x in runs[mode]) for k in MEASURES}
        med["goodput_vs_sibling"] = statistics.median(
            _ratio(x["goodput"], s["goodput"])
            for x, s in zip(runs[mode], runs[base], strict=True)
        )
        med["wall_vs_sibling"] = statistics.median(
            _ratio(x["wall_s"], s["wall_s"])
            for x, s in zip(runs[mode], runs[base], strict=True)
        )
        medians[mode] = med
    return {
        "workload": w.name,
        "describe": w.describe,
        "kills": kills,
        "repeats": repeats,
        "seed": seed,
        "kill_window_s": round(kill_window * ref["run_s"], 3),
        "schedules": schedules,
        "reference": ref,
        "baseline": base,
        "modes": medians,
        "runs": runs,
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")

"""What the restarts of a run cost, read from `RUN_DIR/trace.jsonl` and `metrics.jsonl`.

`analyse(run_dir)` is pure: it reads the two files (a run directory may still be written
while it reads; torn lines are skipped and counted) and returns a `Report`.
`write_report(run_dir, report)` writes `RUN_DIR/report/`: `report.md`, `report.json` and
four PNG plots (matplotlib, the `report` extra). `rollkeep trace RUN_DIR` runs both.

The model behind every number is the **surviving history**: the trace lines the final
state descends from. Walking the runs in order, a restart from a checkpoint whose cut was
taken at unix time T forgets every earlier line after T (work the checkpoint does not
hold); a fresh restart forgets everything. `lineage()` is the same walk for step commits.

Definitions (also in `DEFINITIONS`, written into the report):

- **tokens thrown away** at a restart = the `sealed.tokens` of every surviving seal made
  by an earlier run after the restored checkpoint's `cut_time` (rows the checkpoint does
  not hold), plus the tokens of the sealed siblings the checkpoint does hold but that the
  resumed run abandoned with reason "restart" (an all-or-nothing group that was not
  complete at the cut) or dropped while restoring (recovery.mode=cursor_only loses every
  group in flight at the cut). Each seal is counted once, at the first restart that
  loses it.
- **thrown-away generation time** = for each (group_id, generation) the resumed run
  abandoned with reason "restart": `cut_time` minus the time of that attempt's last
  `dispatched` before the cut (clamped at 0), summed. For a sealed sibling of an
  all-or-nothing group this includes the time the row waited for its siblings. Each
  dispatch is counted once, at the first restart that throws it away.
- **lost progress** = from the previous run's kill (its last trace line) until the resumed
  run committed again the last step the previous run had committed; if the previous run
  committed nothing after the restored checkpoint's step, until the resumed run's first
  commit instead. After a graceful stop (SIGINT/SIGTERM, the end of the steps or of the
  data: a `run_finished` line) the time the run directory sat idle is not lost: the clock
  starts when the resumed run starts, and it is 0 when the stop's final checkpoint holds
  every step the stopped run committed (nothing to redo). Null while that commit has not
  happened (yet).
- **group completion time** = a group's last surviving `ready` before the commit that
  trained it minus its first surviving `taken` (a group taken by an earlier run counts
  from there, across the downtime).
- **batch age** = the token-weighted number of weight versions between generating a token
  and training on it (metrics.jsonl `batch_age`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .core.errors import UserInputError
from .core.keys import group_id
from .core.ledger import COUNT_KEYS
from .core.schedule.commands import Reason
from .core.trace_schema import (
    ABANDONED,
    CHECKPOINT_PUBLISHED,
    DISPATCHED,
    DROPPED,
    EVAL,
    EVICTED,
    FAILED,
    RESTORED,
    RUN_FINISHED,
    RUN_STARTED,
    SEALED,
    STEP_COMMITTED,
    TAKEN,
)
from .core.untrusted import loads_json, read_regular
from .lineage import lineage
from .trace import read_trace

__all__ = [
    "DEFINITIONS",
    "Report",
    "Restart",
    "RunInfo",
    "StepInfo",
    "analyse",
    "read_metrics",
    "render_markdown",
    "write_report",
]

TRACE = "trace.jsonl"
METRICS = "metrics.jsonl"
REPORT_DIR = "report"
PLOTS = ("reward.png", "batch_age.png", "custody.png", "restart_cost.png")
OWNERS = COUNT_KEYS  # the custody counts of every metrics line, in this order
RESTORED_COUNTS = (
    "groups_reused", "groups_finalize_again", "siblings_reused", "siblings_regenerated",
    "siblings_pending", "groups_readmitted", "spare_prompts", "groups_lost",
)

DEFINITIONS: dict[str, str] = {
    "surviving history": "the trace lines the final state descends from: a restart from a "
    "checkpoint cut at time T forgets every earlier line after T; a fresh restart forgets all.",
    "tokens thrown away": "tokens of seals an earlier run made after the restored checkpoint's "
    "cut (the checkpoint does not hold them), plus tokens of sealed siblings the checkpoint "
    "holds but the resumed run abandoned with reason 'restart' (all-or-nothing groups) or "
    "dropped while restoring (recovery.mode=cursor_only); "
    "each seal counted once, at the first restart that loses it.",
    "thrown-away generation time": "for each (group, generation) the resumed run abandoned "
    "with reason 'restart': the restored cut_time minus that attempt's last dispatch before "
    "the cut (clamped at 0), summed; each dispatch counted once.",
    "attempts abandoned": "(group, generation) pairs the resumed run abandoned with reason "
    "'restart'.",
    "tokens reused": "tokens of the sealed rows the restored checkpoint holds that the resumed "
    "run keeps.",
    "lost progress": "from the previous run's kill (its last trace line) until the resumed run "
    "committed again the last step the previous run had committed; if the previous run committed "
    "nothing after the checkpoint's step, until the resumed run's first commit. After a graceful "
    "stop the idle time does not count: the clock starts when the resumed run starts, and it is 0 "
    "when the stop's final checkpoint holds every step it committed. Empty while that commit has "
    "not happened.",
    "group completion time": "a group's last surviving 'ready' before the commit that trained "
    "it minus its first surviving 'taken' (across runs and downtime).",
    "batch age": "token-weighted number of weight versions between generating a token and "
    "training on it (metrics.jsonl batch_age).",
}


# ====================================================================== the report


@dataclass
class RunInfo:
    """One process that appended to the trace."""

    run_id: str
    started: float | None  # t of run_started
    resumed_from_step: int | None
    checkpoint: str | None
    finished: bool  # a run_finished line exists
    reason: str | None  # run_finished.reason
    status: str  # "finished (<reason>)", "killed", or "killed or still running" (the last run)
    last_t: float | None  # t of its last complete trace line
    steps_committed: list[int] = field(default_factory=list)


@dataclass
class Restart:
    """One run after the first: what it reused and what the restart threw away."""

    index: int  # 1 for the first restart
    run_id: str
    previous_run_id: str
    previous_status: str
    checkpoint: str | None
    step: int | None  # the restored checkpoint's step
    cut_time: float | None
    # from the `restored` line (None where the resumed run died before writing it)
    groups_reused: int | None = None
    groups_finalize_again: int | None = None
    siblings_reused: int | None = None
    siblings_regenerated: int | None = None
    siblings_pending: int | None = None
    groups_readmitted: int | None = None
    spare_prompts: int | None = None
    groups_lost: int | None = None  # dropped at the restart (recovery.mode=cursor_only)
    recovery_mode: str | None = None
    # computed from the trace (None where the cut time is unknown)
    tokens_reused: int | None = None
    tokens_thrown_away: int | None = None
    tokens_sealed_after_cut: int | None = None
    seals_after_cut: int | None = None
    tokens_siblings_discarded: int | None = None
    siblings_discarded: int | None = None
    thrown_away_generation_seconds: float | None = None
    attempts_abandoned: int = 0
    attempts_without_dispatch: int = 0  # abandoned, but no live dispatch found before the cut
    kill_t: float | None = None  # the previous run's last trace line
    lost_progress_seconds: float | None = None
    lost_progress_until: str = ""  # "step N committed again" or "first commit"


@dataclass
class StepInfo:
    """One committed step of the surviving lineage."""

    step: int
    t: float | None
    run_id: str | None
    groups: int
    tokens: int | None = None
    batch_age: float | None = None
    tokens_generated_per_s: float | None = None
    reward_mean: float | None = None
    step_seconds: float | None = None
    completion_n: int = 0  # groups whose completion time is known
    completion_mean: float | None = None
    completion_p50: float | None = None
    completion_p90: float | None = None


@dataclass
class Report:
    run_dir: str
    runs: list[RunInfo]
    restarts: list[Restart]
    steps: list[StepInfo]
    custody: list[dict[str, Any]]  # metrics step lines: t, run_id, step, surviving, owners
    evals: list[dict[str, Any]]  # surviving eval lines: step, accuracy, reward_mean
    torn_lines: int  # torn trace lines skipped
    torn_metrics_lines: int = 0
    duplicates: list[list[int]] = field(default_factory=list)  # prompts trained twice

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "summary": self.summary(), "definitions": DEFINITIONS}

    def summary(self) -> dict[str, Any]:
        """Totals over restarts and statistics over the surviving steps."""
        completions = [s.completion_mean for s in self.steps if s.completion_mean is not None]
        ages = [s.batch_age for s in self.steps if s.batch_age is not None]
        return {
            "runs": len(self.runs),
            "restarts": len(self.restarts),
            "steps": len(self.steps),
            "last_step": self.steps[-1].step if self.steps else None,
            "finished": bool(self.runs and self.runs[-1].finished),
            "tokens_thrown_away": sum(r.tokens_thrown_away or 0 for r in self.restarts),
            "thrown_away_generation_seconds": sum(
                r.thrown_away_generation_seconds or 0.0 for r in self.restarts
            ),
            "lost_progress_seconds": sum(r.lost_progress_seconds or 0.0 for r in self.restarts),
            "batch_age_mean": _mean(ages),
            "batch_age_max": max(ages) if ages else None,
            "group_completion_mean_of_steps": _mean(completions),
        }


# ====================================================================== reading


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], int]:
    """(lines, torn lines skipped). A killed writer may leave a torn line, and the next run
    appends its first record right after it on the same line: that record is recovered."""
    path = Path(path)
    if not path.exists():
        return [], 0
    out, torn = [], 0
    for raw in read_regular(path, follow_symlinks=True).split(b"\n"):
        if not raw.strip():
            continue
        obj = _json_object(raw)
        if obj is None:
            torn += 1
            start = raw.rfind(b'{"t"')
            obj = _json_object(raw[start:]) if start > 0 else None
        if obj is not None:
            out.append(obj)
    return out, torn


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        obj = loads_json(raw, strict=False)
    except ValueError:  # torn, damaged, or nested too deeply
        return None
    return obj if isinstance(obj, dict) and "step" in obj else None


@dataclass
class _Run:
    run_id: str
    lines: list[tuple[int, dict[str, Any]]]  # (position in the trace, line)

    def first(self, event: str) -> dict[str, Any] | None:
        return next((x for _, x in self.lines if x["event"] == event), None)


def _split_runs(lines: list[dict[str, Any]]) -> list[_Run]:
    runs: dict[str, _Run] = {}
    for i, line in enumerate(lines):
        rid = str(line.get("run_id"))
        runs.setdefault(rid, _Run(rid, [])).lines.append((i, line))
    return list(runs.values())  # in order of first appearance: runs append one after another


# ====================================================================== analysis


def analyse(run_dir: Path) -> Report:
    """Read `RUN_DIR/trace.jsonl` (and `metrics.jsonl` if present) into a `Report`."""
    run_dir = Path(run_dir)
    trace_path = run_dir / TRACE
    if not run_dir.is_dir():
        raise UserInputError(
            f"run directory {run_dir} does not exist",
            path=str(run_dir),
            expected="a directory written by `rollkeep train`",
            found="no such directory" if not run_dir.exists() else "not a directory",
            remedy="pass the run_dir of a training run (the directory holding trace.jsonl)",
        )
    if not trace_path.is_file():
        raise UserInputError(
            f"{run_dir} has no trace",
            path=str(trace_path),
            expected=f"{TRACE}, written by every `rollkeep train` run",
            found="no such file",
            remedy="pass the run_dir of a training run that has started at least once",
        )
    try:
        lines, torn = read_trace(trace_path)
        metrics, torn_metrics = read_metrics(run_dir / METRICS)
    except OSError as e:
        raise UserInputError(
            f"the trace of {run_dir} cannot be read",
            path=e.filename or str(trace_path),
            expected="regular files written by `rollkeep train`",
            found=e.strerror or str(e),
            remedy="pass the run_dir of a training run",
        ) from None
    runs = _split_runs(lines)
    lin = lineage(lines)

    # Walk the runs, keeping the surviving history and measuring each restart against it.
    surviving: list[tuple[int, dict[str, Any]]] = []
    counted: set[tuple] = set()  # seals and dispatches already counted as thrown away
    restarts: list[Restart] = []
    for n, run in enumerate(runs):
        if n > 0:
            r, surviving = _restart(n, runs, lines, surviving, counted)
            restarts.append(r)
        surviving.extend(run.lines)

    steps = _steps(lin, surviving, lines, metrics)
    surviving_commits = {(s.run_id, s.step) for s in steps}
    custody = [
        {
            "t": m.get("t"),
            "run_id": m.get("run_id"),
            "step": m["step"],
            "surviving": (m.get("run_id"), m["step"]) in surviving_commits,
            **{o: m.get(f"custody/{o}") for o in OWNERS},
        }
        for m in metrics
        if _is_step_line(m)
    ]
    evals: dict[int, dict[str, Any]] = {}
    for _, x in surviving:
        if x["event"] == EVAL:
            evals[int(x["step"])] = {
                "step": int(x["step"]),
                "accuracy": x.get("eval/accuracy"),
                "reward_mean": x.get("eval/reward_mean"),
            }
    return Report(
        run_dir=str(run_dir),
        runs=[_run_info(r, last=i == len(runs) - 1) for i, r in enumerate(runs)],
        restarts=restarts,
        steps=steps,
        custody=custody,
        evals=[evals[k] for k in sorted(evals)],
        torn_lines=torn,
        torn_metrics_lines=torn_metrics,
        duplicates=[list(p) for p in lin.duplicates()],
    )


def _run_info(run: _Run, *, last: bool) -> RunInfo:
    started = run.first(RUN_STARTED) or {}
    finished = next((x for _, x in reversed(run.lines) if x["event"] == RUN_FINISHED), None)
    if finished is not None:
        status = f"finished ({finished.get('reason')})"
    else:
        status = "killed or still running" if last else "killed"
    return RunInfo(
        run_id=run.run_id,
        started=started.get("t"),
        resumed_from_step=started.get("resumed_from_step"),
        checkpoint=started.get("checkpoint"),
        finished=finished is not None,
        reason=None if finished is None else finished.get("reason"),
        status=status,
        last_t=run.lines[-1][1].get("t") if run.lines else None,
        steps_committed=[int(x["step"]) for _, x in run.lines if x["event"] == STEP_COMMITTED],
    )


def _restart(
    n: int,
    runs: list[_Run],
    lines: list[dict[str, Any]],
    surviving: list[tuple[int, dict[str, Any]]],
    counted: set[tuple],
) -> tuple[Restart, list[tuple[int, dict[str, Any]]]]:
    """Measure restart `n` (run n resumes after run n-1) against the surviving history of
    the runs before it; return it with that history cut back to what the restart keeps."""
    run, prev = runs[n], runs[n - 1]
    started = run.first(RUN_STARTED) or {}
    restored = run.first(RESTORED)
    checkpoint = started.get("checkpoint")
    resumed = started.get("resumed_from_step")
    cut_time = None
    if restored is not None:
        cut_time = restored.get("cut_time")
    if cut_time is None and checkpoint is not None:  # died before `restored`: ask the writer
        published = [x for x in lines if x["event"] == CHECKPOINT_PUBLISHED and x.get("name") == checkpoint]
        cut_time = published[-1].get("cut_time") if published else None
    prev_info = _run_info(prev, last=False)
    r = Restart(
        index=n,
        run_id=run.run_id,
        previous_run_id=prev.run_id,
        previous_status=prev_info.status,
        checkpoint=checkpoint,
        step=resumed,
        cut_time=cut_time,
        kill_t=prev_info.last_t,
    )
    for key in RESTORED_COUNTS:
        if restored is not None and restored.get(key) is not None:
            setattr(r, key, int(restored[key]))
    abandoned = [
        (x["group_id"], int(g))
        for _, x in run.lines
        if x["event"] == ABANDONED and x.get("reason") == Reason.RESTART
        for g in x.get("generations", ())
    ]
    r.attempts_abandoned = len(abandoned)
    if restored is not None:
        r.recovery_mode = restored.get("recovery_mode")
    # Groups the restart itself dropped (before `restored`): their sealed rows go too.
    restart_phase = [x for _, x in run.lines[: _index(run, restored) + 1]] if restored else []
    dropped = {x["group_id"] for x in restart_phase if x["event"] == DROPPED}

    # What the restart keeps of the history before it.
    if resumed is None:
        kept: list[tuple[int, dict[str, Any]]] = []  # a fresh start keeps nothing
    elif cut_time is not None:
        kept = [(i, x) for i, x in surviving if x["t"] <= cut_time]
    else:  # cut time unknown: keep up to the first commit after the restored step
        end = next(
            (k for k, (_, x) in enumerate(surviving)
             if x["event"] == STEP_COMMITTED and int(x["step"]) > resumed),
            len(surviving),
        )
        kept = surviving[:end]

    if resumed is None or cut_time is not None:
        kept_ids = {i for i, _ in kept}
        lost_seals = [
            (i, x) for i, x in surviving
            if i not in kept_ids and x["event"] == SEALED and ("seal", i) not in counted
        ]
        counted.update(("seal", i) for i, _ in lost_seals)
        r.seals_after_cut = len(lost_seals)
        r.tokens_sealed_after_cut = sum(int(x.get("tokens", 0)) for _, x in lost_seals)
        live = _live_attempts(kept)
        discarded_tokens = discarded = reused = 0
        seconds = 0.0
        abandoned_set = set(abandoned)
        for (gid, g), att in live.items():
            seal = att.get("seal")
            if seal is None:
                continue
            if (gid, g) not in abandoned_set and gid not in dropped:
                reused += seal[1]
            elif ("seal", seal[0]) not in counted:
                counted.add(("seal", seal[0]))
                discarded += 1
                discarded_tokens += seal[1]
        for gid, g in abandoned:
            att = live.get((gid, g))
            if att is None or "dispatch" not in att:
                r.attempts_without_dispatch += 1
                continue
            d_line, d_t = att["dispatch"]
            if ("dispatch", d_line, g) not in counted and cut_time is not None:
                counted.add(("dispatch", d_line, g))
                seconds += max(0.0, float(cut_time) - d_t)
        r.siblings_discarded = discarded
        r.tokens_siblings_discarded = discarded_tokens
        r.tokens_thrown_away = r.tokens_sealed_after_cut + discarded_tokens
        r.tokens_reused = reused
        r.thrown_away_generation_seconds = seconds

    # Lost progress: from the kill until the resumed run is back where the killed run was.
    # A graceful stop is a pause, not a loss: its idle time does not count, and a final
    # checkpoint that holds every committed step leaves nothing to redo.
    prev_steps = prev_info.steps_committed
    commits = [(int(x["step"]), float(x["t"])) for _, x in run.lines if x["event"] == STEP_COMMITTED]
    behind = bool(prev_steps) and max(prev_steps) > (resumed or 0)
    if prev_info.finished and resumed is not None and not behind:
        r.lost_progress_until = "nothing lost (graceful stop)"
        r.lost_progress_seconds = 0.0
        return r, kept
    if behind:
        target = max(prev_steps)
        r.lost_progress_until = f"step {target} committed again"
        again = next((t for s, t in commits if s == target), None)
    else:
        r.lost_progress_until = "first commit"
        again = commits[0][1] if commits else None
    since = started.get("t") if prev_info.finished else r.kill_t
    if again is not None and since is not None:
        r.lost_progress_seconds = max(0.0, again - float(since))
    return r, kept


def _index(run: _Run, line: dict[str, Any]) -> int:
    return next(k for k, (_, x) in enumerate(run.lines) if x is line)


def _live_attempts(kept: list[tuple[int, dict[str, Any]]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Replay the kept history: the current attempt of every sibling not yet trained,
    dropped or reset, with its last dispatch (line, t) and its seal (line, tokens)."""
    live: dict[str, dict[int, dict[str, Any]]] = {}
    all_or_nothing: set[str] = set()
    for i, x in kept:
        ev = x["event"]
        if ev == TAKEN:
            gid = group_id((x["epoch"], x["ordinal"]))
            if x.get("granularity") == "prompt_group":
                all_or_nothing.add(gid)
        elif ev == DISPATCHED:
            sibs = live.setdefault(x["group_id"], {})
            for g in x.get("generations", ()):
                sibs[int(g)] = {"dispatch": (i, float(x["t"]))}
        elif ev == SEALED:
            att = live.setdefault(x["group_id"], {}).setdefault(int(x["generation"]), {})
            att["seal"] = (i, int(x.get("tokens", 0)))
        elif ev == FAILED:
            if x["group_id"] in all_or_nothing:
                live.pop(x["group_id"], None)
            else:
                live.get(x["group_id"], {}).pop(int(x["generation"]), None)
        elif ev == ABANDONED:
            for g in x.get("generations", ()):
                live.get(x["group_id"], {}).pop(int(g), None)
        elif ev in (EVICTED, DROPPED):
            live.pop(x["group_id"], None)
            rep = x.get("replacement") if ev == DROPPED else None
            if rep and rep.get("granularity") == "prompt_group":
                all_or_nothing.add(group_id((rep["epoch"], rep["ordinal"])))
        elif ev == STEP_COMMITTED:
            for gid in x.get("group_ids", ()):
                live.pop(gid, None)
    return {(gid, g): att for gid, sibs in live.items() for g, att in sibs.items()}


def _is_step_line(m: dict[str, Any]) -> bool:
    return "groups" in m or "reward_mean" in m


def _steps(lin, surviving, lines, metrics) -> list[StepInfo]:
    """Per surviving step: its commit, metrics and group completion times."""
    first_taken: dict[str, float] = {}
    last_ready: dict[str, float] = {}
    commits: dict[int, tuple[dict[str, Any], list[float]]] = {}
    for _, x in surviving:
        ev = x["event"]
        if ev == TAKEN:
            first_taken.setdefault(group_id((x["epoch"], x["ordinal"])), float(x["t"]))
        elif ev == DROPPED and x.get("replacement"):
            rep = x["replacement"]
            first_taken.setdefault(group_id((rep["epoch"], rep["ordinal"])), float(x["t"]))
        elif ev == "ready":
            last_ready[x["group_id"]] = float(x["t"])
        elif ev == STEP_COMMITTED:
            times = [
                last_ready[g] - first_taken[g]
                for g in x.get("group_ids", ())
                if g in last_ready and g in first_taken
            ]
            commits[int(x["step"])] = (x, times)
    by_run_step = {(m.get("run_id"), m["step"]): m for m in metrics if _is_step_line(m)}
    out = []
    for step in sorted(lin.steps):
        commit, times = commits.get(step, (None, []))
        if commit is None:  # not in the surviving history (its cut time was unknown)
            commit = next(x for x in reversed(lines) if x["event"] == STEP_COMMITTED and int(x["step"]) == step)
        m = by_run_step.get((commit.get("run_id"), step), {})
        out.append(
            StepInfo(
                step=step,
                t=commit.get("t"),
                run_id=commit.get("run_id"),
                groups=len(commit.get("group_ids", lin.steps[step])),
                tokens=m.get("tokens"),
                batch_age=m.get("batch_age"),
                tokens_generated_per_s=m.get("tokens_generated_per_s"),
                reward_mean=m.get("reward_mean"),
                step_seconds=m.get("step_seconds"),
                completion_n=len(times),
                completion_mean=_mean(times),
                completion_p50=_percentile(times, 50),
                completion_p90=_percentile(times, 90),
            )
        )
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _percentile(xs: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default method)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# ====================================================================== markdown


def render_markdown(report: Report, files: list[Path] | None = None) -> str:
    s = report.summary()
    t0 = report.runs[0].started if report.runs and report.runs[0].started else None
    out = [f"# rollkeep trace: {report.run_dir}", ""]
    state = "finished" if s["finished"] else "not finished (killed, or still running)"
    out.append(
        f"{s['runs']} run(s), {s['restarts']} restart(s), {s['steps']} step(s) in the surviving "
        f"lineage (last step {s['last_step']}), {state}. Torn or unreadable lines skipped: "
        f"{report.torn_lines} in {TRACE}, {report.torn_metrics_lines} in {METRICS}."
    )
    if t0 is not None:
        out.append(f"Times are seconds since the first run started ({_iso(t0)}).")
    if report.duplicates:
        out.append(f"**Prompts trained more than once:** {report.duplicates}")
    out += ["", "## Runs", ""]
    out += _table(
        ["#", "run id", "started (s)", "resumed from step", "checkpoint", "steps committed",
         "last line (s)", "end"],
        [
            [i, r.run_id, _rel(r.started, t0), _f(r.resumed_from_step), _f(r.checkpoint),
             _steps_range(r.steps_committed), _rel(r.last_t, t0), r.status]
            for i, r in enumerate(report.runs)
        ],
    )
    out += ["", "## Restarts", ""]
    if report.restarts:
        out += _table(
            ["#", "run id", "checkpoint", "step", "groups reused", "siblings reused",
             "siblings regenerated", "prompts re-admitted", "groups lost", "tokens reused",
             "tokens thrown away (after cut + discarded siblings)",
             "thrown-away generation (s)", "attempts abandoned", "lost progress (s)"],
            [
                [r.index, r.run_id, _f(r.checkpoint), _f(r.step), _f(r.groups_reused),
                 _f(r.siblings_reused), _f(r.siblings_regenerated), _f(r.groups_readmitted),
                 _f(r.groups_lost), _f(r.tokens_reused),
                 f"{_f(r.tokens_thrown_away)} ({_f(r.tokens_sealed_after_cut)} + "
                 f"{_f(r.tokens_siblings_discarded)})",
                 _f(r.thrown_away_generation_seconds, 3), r.attempts_abandoned,
                 f"{_f(r.lost_progress_seconds, 3)} (until {r.lost_progress_until})"]
                for r in report.restarts
            ],
        )
        out.append("")
        out.append(
            f"Total: {s['tokens_thrown_away']} tokens thrown away, "
            f"{s['thrown_away_generation_seconds']:.3f} s of generation thrown away, "
            f"{s['lost_progress_seconds']:.3f} s of progress lost."
        )
        unmatched = sum(r.attempts_without_dispatch for r in report.restarts)
        if unmatched:
            out.append(f"{unmatched} abandoned attempt(s) had no dispatch before the cut in the trace.")
    else:
        out.append("No restarts.")
    out += ["", "## Steps", ""]
    out += _step_stats(report)
    out += ["", "## Definitions", ""]
    out += [f"- **{k}**: {v}" for k, v in DEFINITIONS.items()]
    if files:
        out += ["", "## Files", ""] + [f"- {p.name}" for p in files]
    return "\n".join(out) + "\n"


def _step_stats(report: Report) -> list[str]:
    steps = report.steps
    if not steps:
        return ["No committed steps."]
    rows = []
    for label, unit, values in [
        ("batch age", "weight versions", [s.batch_age for s in steps]),
        ("group completion, mean per step", "s", [s.completion_mean for s in steps]),
        ("group completion, p90 per step", "s", [s.completion_p90 for s in steps]),
        ("reward mean", "", [s.reward_mean for s in steps]),
        ("tokens per step", "tokens", [s.tokens for s in steps]),
        ("generation throughput", "tokens/s", [s.tokens_generated_per_s for s in steps]),
        ("step time", "s", [s.step_seconds for s in steps]),
    ]:
        xs = [float(v) for v in values if v is not None]
        if not xs:
            rows.append([label, unit, "-", "-", "-", "-", "-"])
            continue
        rows.append([label, unit, _f(xs[0], 3), _f(xs[-1], 3), _f(min(xs), 3),
                     _f(_percentile(xs, 50), 3), _f(max(xs), 3)])
    out = _table(["measure", "unit", "first", "last", "min", "median", "max"], rows)
    # One row per step, thinned to about 40 rows for long runs (report.json has them all).
    every = max(1, len(steps) // 40)
    shown = [s for k, s in enumerate(steps) if k % every == 0 or k == len(steps) - 1]
    out += ["", f"Per step{'' if every == 1 else f' (every {every}th; all in report.json)'}:", ""]
    out += _table(
        ["step", "run id", "groups", "tokens", "batch age (versions)", "reward mean",
         "tokens/s", "group completion mean / p50 / p90 (s)"],
        [
            [s.step, _f(s.run_id), s.groups, _f(s.tokens), _f(s.batch_age, 3), _f(s.reward_mean, 3),
             _f(s.tokens_generated_per_s, 0),
             f"{_f(s.completion_mean, 3)} / {_f(s.completion_p50, 3)} / {_f(s.completion_p90, 3)}"]
            for s in shown
        ],
    )
    return out


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _f(x: Any, digits: int | None = None) -> str:
    if x is None:
        return "-"
    if digits is not None and isinstance(x, float) and not float(x).is_integer():
        return f"{x:.{digits}f}"
    if digits is not None and isinstance(x, float | int) and not isinstance(x, bool):
        return f"{float(x):.{digits}f}" if isinstance(x, float) else str(x)
    return str(x)


def _rel(t: float | None, t0: float | None) -> str:
    return "-" if t is None or t0 is None else f"{t - t0:.3f}"


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def _steps_range(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{len(steps)} ({min(steps)}–{max(steps)})"


# ====================================================================== writing


def write_report(
    run_dir: Path, report: Report, out_dir: Path | None = None, *, plots: bool = True
) -> list[Path]:
    """Write report.md, report.json and (with `plots`) the PNG plots into `out_dir`
    (default `RUN_DIR/report/`). Returns the paths written. Nothing else is touched."""
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / REPORT_DIR
    written: list[Path] = []
    if plots:
        figures = _plot(report)  # before anything is written: a missing matplotlib writes nothing
    out.mkdir(parents=True, exist_ok=True)
    if plots:
        for name, fig in figures:
            path = out / name
            fig.savefig(path, dpi=100)
            written.append(path)
    json_path = out / "report.json"
    json_path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    md_path = out / "report.md"
    files = [md_path, json_path, *written]
    md_path.write_text(render_markdown(report, files))
    return files


def _plot(report: Report) -> list[tuple[str, Any]]:
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise UserInputError(
            "the report's plots need matplotlib, which is not installed",
            expected="matplotlib importable",
            found=str(e),
            remedy="pip install 'rollkeep[report]', or run `rollkeep trace RUN_DIR --no-plots`",
        ) from e
    def new(title: str) -> tuple[Any, Any]:
        fig = Figure(figsize=(10, 5.5), layout="constrained")  # no pyplot: no global state
        ax = fig.add_subplot()
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        return fig, ax

    steps = report.steps
    restart_steps = [r.step if r.step is not None else 0 for r in report.restarts]

    def mark_restarts(ax) -> None:
        for k, x in enumerate(restart_steps):
            ax.axvline(x, color="tab:red", linestyle="--", linewidth=1.2,
                       label="restart (resumed from this step)" if k == 0 else None)

    def legend(fig, *axes) -> None:
        """One legend for all axes (twin axes too), below the plot where it hides nothing."""
        handles, labels = [], []
        for ax in axes:
            h, lab = ax.get_legend_handles_labels()
            handles += h
            labels += lab
        if len(handles) > 1:
            fig.legend(handles, labels, loc="outside lower center", ncol=len(handles))

    figs = []
    # reward.png: reward per step, eval accuracy on a twin axis, restarts marked.
    fig, ax = new("Reward per step and eval accuracy")
    pts = [(s.step, s.reward_mean) for s in steps if s.reward_mean is not None]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", color="tab:blue",
            label="reward mean (train batch)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward per rollout")
    mark_restarts(ax)
    axes = [ax]
    evals = [(e["step"], e["accuracy"]) for e in report.evals if e.get("accuracy") is not None]
    if evals:
        ax2 = ax.twinx()
        ax2.plot([p[0] for p in evals], [p[1] for p in evals], marker="o", color="tab:green",
                 label="eval accuracy (greedy)")
        ax2.set_ylabel("eval accuracy (fraction correct)")
        axes.append(ax2)
    legend(fig, *axes)
    figs.append(("reward.png", fig))

    # batch_age.png
    fig, ax = new("Batch age per step")
    pts = [(s.step, s.batch_age) for s in steps if s.batch_age is not None]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", color="tab:purple",
            label="batch age (token-weighted)")
    ax.set_xlabel("step")
    ax.set_ylabel("batch age (weight versions)")
    mark_restarts(ax)
    legend(fig, ax)
    figs.append(("batch_age.png", fig))

    # custody.png: who holds the prompts after each step, stacked (the height of a band is
    # its owner's count, the top edge their total): in-flight owners on top, where the
    # counts are small, and the cumulative owners below.
    fig = Figure(figsize=(10, 7), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(1, 1))
    fig.suptitle("Custody: prompts held by each owner after each step (stacked)")
    rows = [c for c in report.custody if c["surviving"]]
    cx = [c["step"] for c in rows]
    colors = dict(zip(OWNERS, ("tab:olive", "tab:gray", "tab:blue", "tab:purple", "tab:orange",
                               "tab:red", "tab:green", "black"), strict=True))
    for axis, owners, label in [
        (top, OWNERS[:6], "in flight (prompts)"),
        (bottom, OWNERS[6:], "done (prompts, cumulative)"),
    ]:
        if rows:
            # one band per step, centred on it: step k spans [k - 0.5, k + 0.5]
            edges = [x - 0.5 for x in cx] + [cx[-1] + 0.5]
            ys = [[c.get(o) or 0 for c in rows] for o in owners]
            axis.stackplot(edges, *[y + y[-1:] for y in ys], labels=owners,
                           colors=[colors[o] for o in owners], step="post", alpha=0.85, linewidth=0)
            axis.set_xlim(edges[0], edges[-1])
        else:
            axis.text(0.5, 0.5, "no committed steps", ha="center", va="center", transform=axis.transAxes)
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        for k, x in enumerate(restart_steps):  # between the restored step and the next
            axis.axvline(x + 0.5, color="tab:red", linestyle="--", linewidth=1.2,
                         label="restart (after this step)" if k == 0 else None)
        entries = list(zip(*axis.get_legend_handles_labels(), strict=True))
        if entries:  # the top of the stack first, as it is drawn; the restart marker last
            bands = [e for e in entries if e[1] in owners][::-1]
            entries = bands + [e for e in entries if e[1] not in owners]
            axis.legend(*zip(*entries, strict=True), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlabel("step")
    figs.append(("custody.png", fig))

    # restart_cost.png: one panel per measure, one bar per restart (or one line saying
    # there were none: three empty panels say nothing).
    if not report.restarts:
        fig = Figure(figsize=(12, 5), layout="constrained")
        ax = fig.add_subplot()
        ax.set_axis_off()
        fig.suptitle("Cost of each restart")
        ax.text(0.5, 0.5, "no restarts: this run was never interrupted and resumed,\n"
                "so no generation was thrown away and no progress was lost",
                ha="center", va="center", fontsize=14, transform=ax.transAxes)
        figs.append(("restart_cost.png", fig))
        return figs
    fig = Figure(figsize=(12, 5), layout="constrained")
    panels = fig.subplots(1, 3)
    fig.suptitle("Cost of each restart")
    labels = [f"#{r.index}\nstep {_f(r.step)}" for r in report.restarts]
    for axis, (title, unit, values, color) in zip(panels, [
        ("Tokens thrown away", "tokens", [r.tokens_thrown_away for r in report.restarts], "tab:orange"),
        ("Thrown-away generation time", "seconds",
         [r.thrown_away_generation_seconds for r in report.restarts], "tab:red"),
        ("Lost progress", "seconds", [r.lost_progress_seconds for r in report.restarts], "tab:gray"),
    ], strict=True):
        axis.set_title(title)
        axis.set_xlabel("restart (resumed from step)")
        axis.set_ylabel(unit)
        axis.grid(True, axis="y", alpha=0.3)
        heights = [v or 0 for v in values]
        axis.set_ylim(0, max(heights) * 1.15 or 1.0)
        bars = axis.bar(range(len(labels)), heights, color=color)
        axis.set_xticks(range(len(labels)), labels)
        for bar, v in zip(bars, values, strict=True):
            axis.annotate("n/a" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v)),
                          (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                          ha="center", va="bottom", fontsize=9)
    figs.append(("restart_cost.png", fig))
    return figs

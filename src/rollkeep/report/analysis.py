"""Reading a run directory's trace and metrics, and computing the `Report` from them
(the definitions are in `model`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.custody.events import Reason
from ..core.custody.keys import group_id
from ..core.custody.trace_schema import (
    ABANDONED,
    CHECKPOINT_PUBLISHED,
    DISPATCHED,
    DROPPED,
    EFFECT_ANSWERED,
    EFFECT_INTENT,
    EVAL,
    EVICTED,
    FAILED,
    LEDGER_EVENTS,
    PROGRESSED,
    RESTORED,
    RUN_FAILED,
    RUN_FINISHED,
    RUN_STARTED,
    SEALED,
    STEP_COMMITTED,
    TAKEN,
    TURN_SEALED,
)
from ..core.errors import UserInputError
from ..core.io.untrusted import loads_json, read_regular
from ..lineage import lineage
from ..trace import read_trace
from .model import (
    METRICS,
    OWNERS,
    RESTORED_COUNTS,
    TRACE,
    TRAINING,
    Report,
    Restart,
    RunInfo,
    StepInfo,
    _mean,
    _percentile,
    run_status,
)

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
    if not evals:  # an older trace without eval lines: metrics.jsonl's (the last line of each step)
        for m in metrics:
            if m.get("eval/accuracy") is not None or m.get("eval/reward_mean") is not None:
                evals[int(m["step"])] = {"step": int(m["step"]), "accuracy": m.get("eval/accuracy"),
                                         "reward_mean": m.get("eval/reward_mean")}
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
    failed = next((x for _, x in reversed(run.lines) if x["event"] == RUN_FAILED), None)
    signal = None if finished is None else finished.get("signal")
    error = None if failed is None else str(failed.get("error") or "")
    status = run_status(reason=None if finished is None else finished.get("reason"), signal=signal,
                        error=error, last=last)
    return RunInfo(
        signal=signal,
        error=error,
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
    for _, x in run.lines:
        if x["event"] == EFFECT_INTENT:
            r.effects_made += 1
        elif x["event"] == EFFECT_ANSWERED:
            if x.get("resent"):
                r.effects_resent += 1
            else:
                r.effects_answered += 1
    r.effects_replayed = int((restored or {}).get("effects_replayed") or 0)
    r.effects_unknown = int((restored or {}).get("effects_unknown") or 0)
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
        # The journal's tail: the first events the killed runs traced after the cut (the
        # journal is never ahead of the trace, and both see the ledger's events in order).
        r.journal_events_replayed = int((restored or {}).get("journal_events_replayed") or 0)
        if r.journal_events_replayed:
            tail = [(i, x) for i, x in surviving if x["t"] > cut_time and x["event"] in LEDGER_EVENTS]
            tail = tail[: r.journal_events_replayed]
            kept = sorted(kept + tail, key=lambda ix: ix[0])
            seals = [x for _, x in tail if x["event"] == SEALED]
            r.seals_kept_by_journal = len(seals)
            r.tokens_kept_by_journal = sum(int(x.get("tokens", 0)) for x in seals)
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
        # Partial generations: how far each abandoned sibling had got, as the trace saw it
        # (the journal is never ahead of the trace), against what the restart continues from.
        # Likewise the finished turns of multi-turn episodes (docs/design.md §5.4).
        progress: dict[tuple[str, int], int] = {}
        turns: dict[tuple[str, int], int] = {}
        for _, x in surviving:
            if x["event"] in (PROGRESSED, TURN_SEALED):
                progress[(x["group_id"], int(x["generation"]))] = int(x["tokens"])
                if x["event"] == TURN_SEALED:
                    turns[(x["group_id"], int(x["generation"]))] = int(x["turn"]) + 1
            elif x["event"] == SEALED:
                progress.pop((x["group_id"], int(x["generation"])), None)
                turns.pop((x["group_id"], int(x["generation"])), None)
        r.tokens_resumed = int((restored or {}).get("partial_tokens") or 0)
        r.tokens_in_flight_regenerated = max(0, sum(progress.get(k, 0) for k in set(abandoned)) - r.tokens_resumed)
        r.turns_reused = int((restored or {}).get("turns_reused") or 0)
        r.turns_regenerated = max(0, sum(turns.get(k, 0) for k in set(abandoned)) - r.turns_reused)

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
    """A committed step's line: not an eval line, and not a warm-start line (`step` 0 with
    `warmup/step`, written before RL began)."""
    return "warmup/step" not in m and ("groups" in m or "reward_mean" in m)


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
                **{name: _number(m.get(key)) for name, key, _, _ in TRAINING},
                completion_n=len(times),
                completion_mean=_mean(times),
                completion_p50=_percentile(times, 50),
                completion_p90=_percentile(times, 90),
            )
        )
    return out




def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None

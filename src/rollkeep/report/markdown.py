"""The report as markdown (`report.md`, and what `rollkeep report` prints)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .model import (
    BATCH_AGE_SPIKE,
    CUSTODY_NOTE,
    DEFINITIONS,
    METRICS,
    TRACE,
    TRAINING,
    Report,
    _percentile,
)

# ====================================================================== markdown


def render_markdown(report: Report, files: list[Path] | None = None) -> str:
    s = report.summary()
    t0 = report.runs[0].started if report.runs and report.runs[0].started else None
    names = {p.name for p in files} if files else set()
    out = [f"# rollkeep report: {report.run_dir}", ""]
    out += _accuracy_headline(report)
    state = s["status"] or "no run"
    out.append(
        f"The run: {state}, last step {s['last_step']}; {s['runs']} process(es), "
        f"{s['restarts']} restart(s), {s['steps']} step(s) in the surviving lineage. Torn or "
        f"unreadable lines skipped: {report.torn_lines} in {TRACE}, {report.torn_metrics_lines} in {METRICS}."
    )
    if t0 is not None:
        out.append(f"Times are seconds since the first run started ({_iso(t0)}).")
    if report.duplicates:
        out.append(f"**Prompts trained more than once:** {report.duplicates}")
    out += ["", "## Held-out accuracy", ""]
    out += _accuracy_table(report)
    if "reward.png" in names:
        out += ["", "reward.png: the reward of each step's training batch, with the held-out accuracy "
                "(its axis from 0 to 1)."]
    out += ["", "## Training", ""]
    out += _training(report, "training.png" in names)
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
             "tokens kept by the journal", "tokens resumed mid-generation",
             "tokens in flight regenerated", "turns reused", "turns regenerated",
             "tokens thrown away (after cut + discarded siblings)",
             "thrown-away generation (s)", "attempts abandoned", "lost progress (s)"],
            [
                [r.index, r.run_id, _f(r.checkpoint), _f(r.step), _f(r.groups_reused),
                 _f(r.siblings_reused), _f(r.siblings_regenerated), _f(r.groups_readmitted),
                 _f(r.groups_lost), _f(r.tokens_reused), _f(r.tokens_kept_by_journal), r.tokens_resumed,
                 r.tokens_in_flight_regenerated, r.turns_reused, r.turns_regenerated,
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
        if any(r.effects_made or r.effects_answered or r.effects_resent or r.effects_unknown
               for r in report.restarts):
            out += ["", "Calls to the outside (rollkeep.effects), per restart:", ""]
            out += _table(
                ["#", "run id", "records restored", "intents without outcome", "calls made",
                 "calls answered from the record", "calls sent again"],
                [[r.index, r.run_id, r.effects_replayed, r.effects_unknown, r.effects_made, r.effects_answered,
                  r.effects_resent] for r in report.restarts])
        unmatched = sum(r.attempts_without_dispatch for r in report.restarts)
        if unmatched:
            out.append(f"{unmatched} abandoned attempt(s) had no dispatch before the cut in the trace.")
        out += ["", f"{BATCH_AGE_SPIKE} (batch_age.png)", "", CUSTODY_NOTE]
    else:
        out.append("No restarts: the run was never interrupted and resumed, so no generation was "
                   "thrown away and no progress lost (the batch-age, custody and restart-cost plots "
                   "are written only for restarted runs).")
    out += ["", "## Steps", ""]
    out += _step_stats(report)
    out += ["", "## Definitions", ""]
    out += [f"- **{k}**: {v}" for k, v in DEFINITIONS.items()]
    if files:
        out += ["", "## Files", ""] + [f"- {p.name}" for p in files]
    return "\n".join(out) + "\n"


def _accuracy_headline(report: Report) -> list[str]:
    """The first thing report.md says: did the model learn (held-out accuracy over steps)."""
    evals = [e for e in report.evals if e.get("accuracy") is not None]
    if not evals:
        return ["**Held-out accuracy: none recorded** (the run evaluated nothing: `eval.every_steps` 0, "
                "no eval set, or it stopped before its first evaluation).", ""]
    first, last = evals[0], evals[-1]
    best = max(evals, key=lambda e: e["accuracy"])
    text = f"**Held-out accuracy: {first['accuracy']:.3f} at step {first['step']}"
    if len(evals) > 1:
        text += f" → {last['accuracy']:.3f} at step {last['step']}"
    text += f"** (best {best['accuracy']:.3f} at step {best['step']}; {len(evals)} evaluation(s), greedy)."
    return [text, ""]


def _accuracy_table(report: Report) -> list[str]:
    evals = report.evals
    if not evals:
        return ["No evaluation was recorded (no `eval` line in the trace, no `eval/accuracy` in metrics.jsonl)."]
    every = max(1, -(-len(evals) // 30))
    shown = [e for k, e in enumerate(evals) if k % every == 0 or k == len(evals) - 1]
    note = [] if every == 1 else ["", f"(every {every}th evaluation; all in report.json)"]
    return _table(["step", "accuracy", "reward mean"],
                  [[e["step"], _f(e.get("accuracy"), 3), _f(e.get("reward_mean"), 3)] for e in shown]) + note


def _training(report: Report, plotted: bool) -> list[str]:
    rows, notes = [], []
    for name, key, label, meaning in TRAINING:
        xs = [float(v) for v in (getattr(st, name) for st in report.steps) if v is not None]
        if not xs:
            continue
        rows.append([label, _f(xs[0], 4), _f(xs[-1], 4), _f(min(xs), 4), _f(max(xs), 4)])
        notes.append(f"- **{label}** (`{key}`): {meaning}")
    if not rows:
        return ["The trainer reported no loss, KL, clip fraction, grad norm or response length "
                f"(none in {METRICS})."]
    out = _table(["measure", "first", "last", "min", "max"], rows) + [""] + notes
    if plotted:
        out += ["", "training.png: each of these per step."]
    return out


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



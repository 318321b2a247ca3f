"""The report's PNG plots (matplotlib, the `report` extra): the learning curves
(`PLOTS`) for every run, and the restart plots (`RESTART_PLOTS`) only for a run that was
restarted. Cheap to draw: no pyplot, no markers on long series, at most `_MAX_POINTS`
points a line."""

from __future__ import annotations

import textwrap
from typing import Any

from ..core.errors import UserInputError
from .markdown import _f
from .model import BATCH_AGE_SPIKE, OWNERS, TRAINING, Report

_MAX_POINTS = 2000  # a line is thinned to about this many points (the last one always kept)


def _thin(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    every = max(1, -(-len(pts) // _MAX_POINTS))
    return [p for k, p in enumerate(pts) if k % every == 0 or k == len(pts) - 1]


def figures(report: Report) -> list[tuple[str, Any]]:
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise UserInputError(
            "the report's plots need matplotlib, which is not installed",
            expected="matplotlib importable",
            found=str(e),
            remedy="pip install 'rollkeep[report]', or run `rollkeep report RUN_DIR --no-plots`",
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
    fig, ax = new("Held-out accuracy and the reward of each training batch")
    pts = _thin([(s.step, s.reward_mean) for s in steps if s.reward_mean is not None])
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) <= 200 else None,
            color="tab:blue", label="reward mean (train batch)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward per rollout")
    ys = [p[1] for p in pts]
    if ys and 0.0 <= min(ys) and max(ys) <= 1.0:  # rewards in [0, 1]: the same axis as accuracy
        ax.set_ylim(0.0, 1.02)
    elif ys:
        ax.set_ylim(bottom=min(0.0, min(ys)))
    mark_restarts(ax)
    axes = [ax]
    evals = [(e["step"], e["accuracy"]) for e in report.evals if e.get("accuracy") is not None]
    if evals:
        ax2 = ax.twinx()
        ax2.plot([p[0] for p in evals], [p[1] for p in evals], marker="o", color="tab:green",
                 label="held-out accuracy (greedy)")
        ax2.set_ylabel("held-out accuracy (fraction correct)")
        ax2.set_ylim(0.0, 1.02)  # from 0: an axis starting at the first value aligns unlike curves
        axes.append(ax2)
    legend(fig, *axes)
    figs.append(("reward.png", fig))

    # training.png: the trainer's metrics, one panel each.
    fig = Figure(figsize=(13, 7), layout="constrained")
    panels = fig.subplots(2, 3, sharex=True).ravel()
    fig.suptitle("Training: the trainer's metrics per step")
    for axis, (name, key, label, _) in zip(panels, TRAINING, strict=False):
        pts = _thin([(s.step, getattr(s, name)) for s in steps if getattr(s, name) is not None])
        axis.set_title(f"{label}  ({key})", fontsize=10)
        axis.grid(True, alpha=0.3)
        if pts:
            axis.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:blue", linewidth=1.0)
        else:
            axis.text(0.5, 0.5, "not reported by this trainer", ha="center", va="center",
                      transform=axis.transAxes)
        for x in restart_steps:
            axis.axvline(x, color="tab:red", linestyle="--", linewidth=1.0)
    for axis in panels[len(TRAINING):]:
        axis.set_axis_off()
    for axis in panels[3:]:
        axis.set_xlabel("step")
    figs.append(("training.png", fig))

    if not report.restarts:  # the custody plots teach nothing on a run never interrupted
        return figs

    # batch_age.png
    fig, ax = new("Batch age per step")
    pts = [(s.step, s.batch_age) for s in steps if s.batch_age is not None]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", color="tab:purple",
            label="batch age (token-weighted)")
    ax.set_xlabel("step")
    ax.set_ylabel("batch age (weight versions)")
    mark_restarts(ax)
    legend(fig, ax)
    fig.suptitle("Batch age per step")
    ax.set_title("")
    ax.set_title(textwrap.fill(BATCH_AGE_SPIKE, 160), fontsize=8, loc="left")  # what a spike means
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

    # restart_cost.png: one panel per measure, one bar per restart.
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

"""`rollkeep report RUN_DIR`: what a run learned (held-out accuracy, the trainer's curves)
and what its restarts cost.

    model      the report's records and the definition of every measure
    analysis   `analyse(run_dir)`: reading the trace and the metrics into a `Report`
    markdown   `render_markdown(report)`
    plots      the PNG plots

`analyse(run_dir)` is pure; `write_report(run_dir, report)` writes `RUN_DIR/report/`:
`report.md`, `report.json` and the plots.
"""

from __future__ import annotations

import json
from pathlib import Path

from .analysis import analyse, read_metrics
from .markdown import render_markdown
from .model import DEFINITIONS, PLOTS, REPORT_DIR, RESTART_PLOTS, Report, Restart, RunInfo, StepInfo
from .plots import figures as _plot

__all__ = [
    "DEFINITIONS",
    "PLOTS",
    "RESTART_PLOTS",
    "Report",
    "Restart",
    "RunInfo",
    "StepInfo",
    "analyse",
    "read_metrics",
    "render_markdown",
    "write_report",
]


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



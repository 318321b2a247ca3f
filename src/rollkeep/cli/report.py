"""`rollkeep report RUN_DIR [--json] [--no-plots]`: what each restart of a run cost.

Reads RUN_DIR/trace.jsonl and RUN_DIR/metrics.jsonl (a run still being written is fine)
and writes RUN_DIR/report/; nothing else is touched. The analysis is `rollkeep.report`.
`rollkeep trace` is the same command under its first name (`ALIASES`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = """\
Report what each restart of a run reused, regenerated and threw away, read from
RUN_DIR/trace.jsonl and RUN_DIR/metrics.jsonl:

  per run       when it started, the checkpoint it resumed from, the steps it committed,
                how it ended (finished, stopped (SIGINT), failed: <error>, or killed)
  per restart   groups and siblings reused, siblings regenerated, prompts re-admitted,
                tokens thrown away, thrown-away generation time (last dispatch -> cut),
                lost progress (kill -> the killed run's last step committed again)
  per step      batch age, tokens, throughput, reward, group completion time (p50/p90)

Writes RUN_DIR/report/: report.md (also printed; it leads with the held-out accuracy over
steps), report.json, and the plots reward.png and training.png (loss, KL, clip fraction,
grad norm, response length), plus batch_age.png, custody.png and restart_cost.png when the
run was restarted (plots need: pip install 'rollkeep[report]').
Read-only apart from RUN_DIR/report/; a run still being written can be reported on.
`rollkeep trace` is the same command (its former name).

examples:
  rollkeep report runs/a
  rollkeep report runs/a --no-plots
  rollkeep report runs/a --json | jq '.restarts[] | .tokens_thrown_away'
"""

ALIASES = ["trace"]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "report",
        aliases=ALIASES,
        help="report reused, regenerated and lost work per restart of a run",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds trace.jsonl)")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON (with the files written) instead of markdown")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots (no matplotlib needed)")
    return p


def run(args: argparse.Namespace) -> int:
    from ..report import analyse, render_markdown, write_report

    run_dir = Path(args.run_dir)
    report = analyse(run_dir)
    files = write_report(run_dir, report, plots=not args.no_plots)
    if args.json:
        print(json.dumps({**report.to_dict(), "files": [str(p) for p in files]}, indent=2))
        return 0
    print(render_markdown(report), end="")
    print()
    print("wrote:")
    for path in files:
        print(f"  {path}")
    return 0

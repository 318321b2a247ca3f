"""`rollkeep chaos [CONFIG] [key=value ...] [--kills N] [--seed S]` (5 kills by default)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict
from pathlib import Path

from ..core.errors import UserInputError

HELP = """\
Kill/resume torture run. Runs `rollkeep train` once uninterrupted (the reference), then
again as a subprocess that is SIGKILLed N times — at random instants and at named crash
points, some in the middle of checkpoint writes — resuming after each kill until it
finishes. Then checks from the trace and the final checkpoint that no prompt was trained
twice, none of a completed epoch was lost, the final checkpoint passes the restore chain,
and (with deterministic=true) that the final weights equal the reference's.
Runs in RUN_DIR/chaos/{reference,killed} (wiped first). Exit 0 only on PASS.

With engine replicas on Ray (cluster.backend=ray), --replica-kills R also SIGKILLs an
engine replica's process in R of the runs, before the controller's kill. With trainer
ranks (trainer.world_size=2 or more), --rank-kills K makes K of the kills SIGKILL a rank
at a random instant instead of the controller (which then exits 5; the next run resumes).

examples:
  rollkeep chaos configs/toy.yaml --kills 10
  rollkeep chaos configs/toy.yaml deterministic=true rollout.on_dropped_prompt=shrink --kills 6 --seed 3
  rollkeep chaos configs/toy.yaml cluster.backend=ray engine.replicas=2 cluster.replica_cpus=0.5 --kills 4 --replica-kills 4
  rollkeep chaos configs/arith.yaml trainer.world_size=2 train.total_steps=20 --kills 4 --rank-kills 2
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("chaos", help="kill/resume torture run with a pass/fail report",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="YAML config file (optional)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--kills", type=int, default=5, help="how many times to kill the run, 0 or more (default 5)")
    p.add_argument("--replica-kills", type=int, default=0,
                   help="with cluster.backend=ray only: SIGKILL an engine replica in this many runs (default 0)")
    p.add_argument("--rank-kills", type=int, default=0,
                   help="with trainer.world_size > 1: of the --kills, this many SIGKILL a trainer rank instead of "
                        "the controller (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    p.add_argument("--workdir", help="where to run: a writable directory, created if missing (default RUN_DIR/chaos)")
    # --json as in inspect and report: print JSON on stdout (the text goes to stderr); --json-out
    # PATH writes a file, and the older `--json PATH` still does.
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="print the report as one JSON object on stdout (the text goes to stderr); "
                   "`--json PATH` is --json-out PATH")
    p.add_argument("--json-out", dest="json", metavar="PATH", help="also write the report as JSON to PATH")
    return p


def run(args: argparse.Namespace) -> int:
    from ..chaos import run_chaos

    if args.json is not None and args.json != "-":
        _check_json(Path(args.json))
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:
        overrides.insert(0, config)
        config = None
    to_stdout = args.json == "-"  # `--json`: stdout carries the JSON only, the text goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if to_stdout else contextlib.nullcontext():
        report = run_chaos(config, overrides, kills=args.kills, replica_kills=args.replica_kills,
                           rank_kills=args.rank_kills, seed=args.seed, workdir=args.workdir)
        for line in report.lines():
            print(line)
    if to_stdout:
        print(json.dumps({**asdict(report), "passed": report.passed}))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump({**asdict(report), "passed": report.passed}, f, indent=2)
    return 0 if report.passed else 1


def _check_json(path: Path) -> None:
    """The report is written at the end: refuse a place it cannot go before the runs."""
    if path.is_dir() or not path.parent.is_dir():
        raise UserInputError(
            f"--json {path} cannot be written",
            path=str(path),
            field="--json",
            expected="a file in an existing directory",
            found="a directory" if path.is_dir() else f"no directory {path.parent}",
            remedy="pass --json with a file name in an existing directory",
        )

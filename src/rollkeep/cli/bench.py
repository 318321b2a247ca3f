"""`rollkeep bench [--quick] [--json PATH]`: the benchmark suite."""

from __future__ import annotations

import argparse
import json

HELP = """\
Run the benchmark suite and print what it measured, next to the targets of DESIGN.md §13:
ledger lifecycle rate, cut hold, encoded bytes, decode + audit time and memory per
in-flight group; checkpoint write and restore time; the control-plane ceiling.

examples:
  rollkeep bench --quick              # a smoke run, seconds
  rollkeep bench --json bench.json    # the full suite, a few minutes
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="benchmarks", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--json", help="also write the results as JSON to this file")
    return p


def run(args: argparse.Namespace) -> int:
    from ..bench import controller, ledger

    print("== custody core (one core)")
    results = {"ledger": ledger.run(args.quick)}
    print("== controller")
    results["controller"] = controller.run(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0

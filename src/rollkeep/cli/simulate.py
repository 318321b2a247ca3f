"""`rollkeep simulate --schedules N --seed S`: deterministic simulation of whole runs."""

from __future__ import annotations

import argparse
import sys

from ..core.errors import UserInputError

#: The most schedules one command runs: at tens of schedules a second, 10**7 is days of
#: work already; a larger number is a typo, refused before anything runs.
MAX_SCHEDULES = 10**7

HELP = """\
Run N small training runs against the real scheduler, ledger, codec, checkpoint store and
restore chain, on a fake clock, with a scripted engine (random latencies, infra and data
failures, hangs past the deadline), the toy trainer and an in-memory disk that fails or
tears writes, fsyncs and renames and forgets what was never fsynced at a power cut. Each
run is crashed at random ledger events and at named crash points (the first schedules go
through every point), restarted through the real restore chain until it finishes, and
checked: exactly-once custody from the trace and the final checkpoint, the custody audit,
and in deterministic mode the same weights as the run without crashes.

Prints one line `N schedules, K crashes, F faults, V violations` and exits 0, or prints
each violation (its seed, and the fewest crashes and faults that still show it) and
exits 4. Every schedule is a function of --seed: the same command finds the same runs.
--schedules is 1 to 10000000; --index is only read with --replay.

examples:
  rollkeep simulate --schedules 600
  rollkeep simulate --schedules 2000 --seed 7
  rollkeep simulate --replay 1234567 --index 3      # one schedule, as a violation printed it
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("simulate", help="deterministic simulation of whole runs with crashes and faults",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", type=int, default=600, metavar="N",
                   help=f"how many runs (default 600, at most {MAX_SCHEDULES})")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the whole sweep (default 0)")
    p.add_argument("--keep-going", action="store_true", help="do not stop at the first violation")
    p.add_argument("--replay", type=int, metavar="SEED", help="run the one schedule of this seed")
    p.add_argument("--index", type=int, help="with --replay: its index in the sweep (default 0)")
    return p


def run(args: argparse.Namespace) -> int:
    from ..simulate import check, plan, report, simulate
    from ..simulate.schedules import Summary, shrink

    if not 1 <= args.schedules <= MAX_SCHEDULES:
        raise UserInputError(
            f"--schedules {args.schedules} is out of range",
            field="--schedules",
            expected=f"a number of schedules from 1 to {MAX_SCHEDULES}",
            found=str(args.schedules),
            remedy="ask for fewer schedules, or split a sweep into several commands "
            "with different --seed",
        )
    if args.index is not None and args.replay is None:
        raise UserInputError(
            "--index is given without --replay",
            field="--index",
            expected="--index N together with --replay SEED (the seed and index a violation printed)",
            found=f"--index {args.index} alone",
            remedy="add --replay SEED to run that one schedule, or leave --index out to run the sweep",
        )
    if args.replay is not None:
        p = plan(args.replay, index=args.index or 0)
        outcome = check(p)
        summary = Summary(schedules=1, crashes=outcome.crashes, faults=outcome.faults)
        if outcome.problems:
            summary.violations.append(shrink(p))
    else:
        summary = simulate(args.schedules, args.seed, stop_at_first=not args.keep_going,
                           log=lambda line: print(line, file=sys.stderr, flush=True))
    for p, outcome in summary.violations:
        print(report(p, outcome))
    print(summary.line())
    if summary.seconds:
        print(f"simulate: {summary.schedules / summary.seconds:.0f} schedules/s "
              f"({summary.seconds:.1f} s)", file=sys.stderr)
    return 4 if summary.violations else 0

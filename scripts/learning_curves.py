"""Learning curves of the default job (docs/results.md, "Measured learning curves").

    python scripts/learning_curves.py [--config FILE] [--seeds 0 1 2] [--out runs/curves] [key=value ...]

Runs `rollkeep train` (the default config, configs/arith.yaml, or `--config`, plus any overrides) once
per seed, one after the other, each in a fresh run directory OUT/seed-S, and prints a
markdown table per seed: greedy accuracy on the held-out problems at every eval step
(step 0 = right after the warm start), the wall time from the launch of the process to
that eval, and at the end the process's whole wall time (warm start, RL and start-up
included) and GRPO's gain (final - step 0). Also writes OUT/curves.json.

Wall times are the machine's: run it alone (a run uses two cores, the engine's thread
and the trainer's) or say that it was not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def run_seed(seed: int, out: Path, overrides: list[str], config: str | None = None) -> dict:
    run_dir = out / f"seed-{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "rollkeep", "train", *([config] if config else []), f"run_dir={run_dir}",
           f"seed={seed}", "logger.progress=none", *overrides]
    launched = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ))
    wall = time.time() - launched
    lines = [json.loads(x) for x in (run_dir / "trace.jsonl").read_text().splitlines()]
    evals = [{"step": x["step"], "accuracy": x["eval/accuracy"], "wall_s": x["t"] - launched}
             for x in lines if x["event"] == "eval"]
    warmup = [x for x in lines if x["event"] == "run_started"][0]["t"] - launched
    return {"seed": seed, "wall_s": wall, "until_rl_s": warmup, "evals": evals,
            "warm_start": evals[0]["accuracy"], "final": evals[-1]["accuracy"],
            "gain": evals[-1]["accuracy"] - evals[0]["accuracy"], "command": " ".join(cmd[1:])}


def table(r: dict) -> str:
    rows = [f"seed {r['seed']}: warm start {r['warm_start']:.3f} -> final {r['final']:.3f} "
            f"(GRPO {r['gain']:+.3f}), {r['wall_s']:.0f} s in all "
            f"({r['until_rl_s']:.0f} s to the end of the warm start)", "",
            "| step | " + " | ".join(str(e["step"]) for e in r["evals"]) + " |",
            "|---" * (len(r["evals"]) + 1) + "|",
            "| accuracy | " + " | ".join(f"{e['accuracy']:.3f}" for e in r["evals"]) + " |",
            "| wall s | " + " | ".join(f"{e['wall_s']:.0f}" for e in r["evals"]) + " |"]
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default="runs/curves")
    p.add_argument("--config", default=None, help="a config file (default: rollkeep train's, configs/arith.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        r = run_seed(seed, out, args.overrides, args.config)
        results.append(r)
        print(table(r), "\n", flush=True)
    (out / "curves.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

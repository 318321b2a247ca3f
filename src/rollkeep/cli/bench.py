"""`rollkeep bench [--suite S] [--quick] [--kills K] [--repeats N] [--json PATH]`."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from typing import Any

SUITES = ("core", "controller", "preemption", "speedup", "waste", "restart", "cluster", "remote", "effects", "ranks", "all")

HELP = """\
Run the benchmark suite and print what it measured, side by side, in one invocation:

  core        ledger lifecycle rate, cut hold, encoded bytes, decode + audit time and
              memory per in-flight group; checkpoint write and restore time; the
              control-plane ceiling (next to the targets of docs/design.md §9)
  controller  the sans-IO scheduler alone (no asyncio, no engine): siblings per CPU-second
              at G=16, bare and with the trace and the journal (targets 50,000 / 20,000),
              medians of --repeats interleaved runs (default 5); the same through the
              runner on the toy engine; the scale sweep: per-result scheduling at G = 4 ...
              64 and 1 k / 10 k / 100 k groups in flight, cut, write (against dd),
              restore and the restored run's first write at 1 k / 10 k / 100 k in-flight
              groups and G = 4 ... 64, each with its fitted exponent, and the largest
              write phase by phase (docs/design.md §9); then the checkpoint at 10 k and
              100 k in-flight groups, medians of --repeats runs each in a fresh process:
              write, its share of dd and the most that share can be (dd/(dd + sha256)),
              restore, the restored run's first write
  preemption  goodput under preemption: the same job (toy engine with uneven latency, and
              the built-in GPT) SIGKILLed K times at the same random instants for each
              variant (journal; sibling, prompt_group, cursor_only from the checkpoint
              alone): fraction of generated tokens that end up trained, prompts lost,
              prompts duplicated, wall time; then long generations (toy_long: 64 streamed
              tokens; model_long: the GPT with 24 new tokens) with partial generations
              resumed (journal) against started over (regenerate); then multi-turn
              episodes (toy_episodes: the calc environment, 4 turns) with finished turns
              and the turn in flight kept (journal), finished turns kept (regenerate),
              and whole episodes from the checkpoint alone (sibling)
  speedup     async speedup: the same jobs uninterrupted with sampler.max_lookahead_versions
              0 vs 1 (and 2)
  waste       wasted generation: the same uneven toy job, uninterrupted and without
              failures, per sampler (in_order, weight_fifo, windowed): completions
              generated / trained (1.00 = nothing generated twice), groups evicted as
              stale, run time and throughput, goodput (tokens trained / generated),
              and goodput with the job SIGKILLed --kills times (0: not run)
  restart     restart latency: the default job killed after its first RL checkpoint and
              restarted again and again (each SIGKILLed at its first dispatch and step):
              process start -> run_started, -> the first generation dispatched after
              the restore and -> the first step committed after it, next to `import
              torch` alone (targets: at most import torch + 0.3 s to the dispatch, + 0.5
              s to the step), and the restore chain's own time. 7 restarts (3 with
              --quick) unless --repeats says otherwise
  cluster     Ray scale-out on this machine (a local Ray head; needs the ray extra, else
              skipped): import ray + ray.init in a fresh process, EnginePool.open until 1,
              2, 4 toy replicas answer; tokens/s and steps/s of the same job on the local
              backend and on 1, 2, 4 replicas (toy engine at 50 ms per generation) and 1, 2
              (the built-in GPT), with the most attempts in flight; a replica SIGKILLed
              mid-run: until it is back, and until its failed attempts are dispatched and
              sealed again; the built-in GPT's weights: size, ray.put, refit of 1, 2, 4
              replicas
  remote      server mode against in-process generation (`rollkeep serve` on loopback)
  effects     calls to the outside (a judge reward and a lease environment on the toy
              engine): the latency an effect record adds to a call (p50 / p99) against
              the call's own; calls per trained sibling under --kills SIGKILLs, and keys
              called again after their outcome was recorded (must be 0); the cut's hold
              and its environment phase with 0, 64 and 1,024 live episodes
  ranks       training on several ranks (FSDP2 on gloo, the built-in GPT at the main job's
              size and 8x it): step time on 1 and 2 ranks; sharded checkpoint bytes,
              snapshot, write and restore by world size 1, 2, 3; rank 0's peak memory while
              the weights are published

Medians over --repeats; ratios against sibling (preemption), lookahead 0 (speedup) and
in_order (waste).

examples:
  rollkeep bench --quick                                  # everything small, about a minute and a half
  rollkeep bench --suite core --json core.json            # the custody core, a few minutes
  rollkeep bench --suite controller --json c.json         # scheduler rates, the scale sweep, the checkpoint medians: ~12 min
  rollkeep bench --suite preemption --kills 4 --repeats 3 --json p.json  # ~7 minutes
  rollkeep bench --suite speedup                          # ~3 minutes
  rollkeep bench --suite waste --json w.json              # ~30 seconds
  rollkeep bench --suite restart --json r.json            # ~1 minute (the warm start first)
  rollkeep bench --suite cluster --json c.json            # ~4 minutes (pip install 'rollkeep[ray]')
  rollkeep bench --suite remote --json s.json             # ~2 minutes: server mode vs in-process
  rollkeep bench --suite effects --kills 8 --json e.json  # ~2 minutes: calls to the outside
  rollkeep bench --suite ranks --repeats 5 --json k.json  # ~1 minute: trainer ranks
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="benchmarks",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--suite", choices=SUITES, default="all", help="which sections to run (default all)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, 1 repeat, 1 kill unless --kills/--repeats say otherwise: a smoke run",
    )
    p.add_argument(
        "--kills",
        type=int,
        default=None,
        help="preemption: SIGKILLs per job (default 4; 1 with --quick)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="preemption, speedup, waste and cluster: repeats, medians reported (default 3; 1 "
        "with --quick); restart: restarts (default 7; 3 with --quick); controller: scheduler runs and "
        "checkpoint runs per size (default 5; 1 with --quick)",
    )
    p.add_argument("--seed", type=int, default=0, help="preemption: seed of the kill schedules")
    # --json as in inspect and report: print JSON on stdout (the text goes to stderr); --json-out
    # PATH writes a file, and the older `--json PATH` still does.
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="print the results as one JSON object on stdout (the text goes to stderr); "
                   "`--json PATH` is --json-out PATH")
    p.add_argument("--json-out", dest="json", metavar="PATH", help="also write the results as JSON to PATH")
    return p


def run(args: argparse.Namespace) -> int:
    if args.json != "-":
        return _run(args)
    with contextlib.redirect_stdout(sys.stderr):  # `--json`: stdout carries the JSON only
        args.json, out = None, {}
        code = _run(args, out=out)
    print(json.dumps(out))
    return code


def _run(args: argparse.Namespace, *, out: dict | None = None) -> int:
    from ..core.errors import UserInputError

    kills = args.kills if args.kills is not None else (1 if args.quick else 4)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if kills < 0 or repeats < 1:
        raise UserInputError(
            "bench: --kills must be >= 0 and --repeats >= 1",
            found=f"--kills {kills} --repeats {repeats}",
        )
    suites = SUITES[:-1] if args.suite == "all" else (args.suite,)
    results: dict = {
        "settings": {
            "suite": args.suite,
            "quick": args.quick,
            "kills": kills,
            "repeats": repeats,
            "seed": args.seed,
        }
    }
    t0 = time.monotonic()
    if "core" in suites:
        from ..bench import controller, ledger

        print("== custody core (one core)")
        results["ledger"] = ledger.run(args.quick)
        print("== controller")
        results["controller"] = controller.run(args.quick)
    if "controller" in suites:
        from ..bench import scale

        print("== the control plane: the scheduler alone, and the scale sweep")
        results["control_plane"] = scale.run(quick=args.quick, repeats=args.repeats or (1 if args.quick else 5),
                                             log=_note)
    if "preemption" in suites:
        from ..bench.preemption import EPISODE_WORKLOADS, LONG_WORKLOADS, WORKLOADS, goodput

        print(
            f"== goodput under preemption ({kills} kill(s), {repeats} repeat(s), seed {args.seed})"
        )
        results["preemption"] = {}
        for name in WORKLOADS + LONG_WORKLOADS + EPISODE_WORKLOADS:
            r = goodput(
                name, kills=kills, repeats=repeats, seed=args.seed, quick=args.quick, log=_note
            )
            results["preemption"][name] = r
            _print(preemption_table(r))
    if "speedup" in suites:
        from ..bench.preemption import WORKLOADS
        from ..bench.speedup import async_speedup

        print(f"== async speedup ({repeats} repeat(s))")
        results["speedup"] = {}
        for name in WORKLOADS:
            r = async_speedup(name, repeats=repeats, quick=args.quick, log=_note)
            results["speedup"][name] = r
            _print(speedup_table(r))
    if "waste" in suites:
        from ..bench.waste import waste

        print(f"== wasted generation per sampler ({repeats} repeat(s))")
        results["waste"] = waste(repeats=repeats, quick=args.quick, log=_note, kills=kills)
        _print(waste_table(results["waste"]))
    if "restart" in suites:
        from ..bench.restart import restart_latency

        restarts = args.repeats if args.repeats is not None else (3 if args.quick else 7)
        print(f"== restart latency ({restarts} restart(s))")
        results["restart"] = restart_latency(repeats=restarts, quick=args.quick, log=_note)
        _print(restart_table(results["restart"]))
    if "cluster" in suites:
        from ..bench.cluster import cluster_bench

        print(f"== Ray scale-out ({repeats} repeat(s))")
        results["cluster"] = cluster_bench(repeats=repeats, quick=args.quick, log=_note)
        if "skipped" in results["cluster"]:
            _note(results["cluster"]["skipped"])
        else:
            for titled in cluster_tables(results["cluster"]):
                _print(titled)
    if "remote" in suites:
        from ..bench.remote import remote_bench, table_rows

        print(f"== server mode ({repeats} repeat(s))")
        results["remote"] = remote_bench(repeats=repeats, quick=args.quick, log=_note)
        if "skipped" in results["remote"]:
            _note(results["remote"]["skipped"])
        else:
            t = _table("engine", "tokens/s", "fence ms\n(per server)", "refit ms\n(write+reload)", "bytes read\nper token")
            for row in table_rows(results["remote"]):
                t.add_row(*row)
            _print((f"server mode on {results['remote']['weight_bytes']:,} bytes of weights, "
                    f"{results['remote']['requests']} concurrent completions; medians", t))
            rs = results["remote"]["restart_s"]
            _note(f"restart after SIGKILL, launch -> first trained step: remote {rs['remote']['median']:.2f} s "
                  f"(servers running), in-process hf {rs['inprocess']['median']:.2f} s (medians)")
    if "effects" in suites:
        from ..bench.effects import effects_bench
        from ..bench.effects import table_rows as effect_rows

        print(f"== effects outside the process ({kills} kill(s), {repeats} repeat(s))")
        results["effects"] = effects_bench(kills=max(kills, 1), repeats=repeats, quick=args.quick, log=_note)
        t = _table("measure", "job", "result")
        for row in effect_rows(results["effects"]):
            t.add_row(*row)
        _print(("effects: the journal's record of each call, calls under kills, the cut's environment phase", t))
    if "ranks" in suites:
        from ..bench.ranks import ranks_bench
        from ..bench.ranks import table_rows as rank_rows

        print(f"== training on several ranks ({repeats} step(s) per median)")
        results["ranks"] = ranks_bench(repeats=repeats, quick=args.quick, log=_note)
        t = _table("measure", "job", "result")
        for row in rank_rows(results["ranks"]):
            t.add_row(*row)
        _print(("trainer ranks (FSDP2, gloo): step time, sharded checkpoints, weight publication", t))
    results["settings"]["seconds"] = time.monotonic() - t0
    if out is not None:
        out.update(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


# ----------------------------------------------------------------------------- tables


def preemption_table(r: dict) -> tuple[str, Any]:
    """(title, rich table) of one workload's `goodput` result."""
    title = (
        f"goodput under preemption, {r['workload']}: {r['describe']}; "
        f"{r['kills']} kill(s) per job at instants uniform in the first "
        f"{r['kill_window_s']:.2f} s of run time (the same instants for every mode); "
        f"medians of {r['repeats']} repeat(s)"
    )
    base = r.get("baseline", "sibling")
    t = _table(
        "variant",
        "goodput\ntrained/gen",
        f"vs {base}\n(goodput)",
        "tokens\ngenerated",
        "tokens\ntrained",
        "prompts\nlost",
        "prompts\nduplicated",
        "kills\nlanded",
        "wall s\n(w/ start-up)",
        f"vs {base}\n(wall)",
        "run s\n(no start-up)",
    )
    ref = r["reference"]
    t.add_row(
        "uninterrupted",
        f"{ref['goodput']:.3f}",
        "",
        f"{ref['tokens_generated']:,.0f}",
        f"{ref['tokens_trained']:,.0f}",
        str(ref["prompts_lost"]),
        str(ref["prompts_duplicated"]),
        "0",
        f"{ref['wall_s']:.1f}",
        "",
        f"{ref['run_s']:.1f}",
        end_section=True,
    )
    for mode, m in r["modes"].items():
        t.add_row(
            mode,
            f"{m['goodput']:.3f}",
            _x(m["goodput_vs_sibling"]),
            f"{m['tokens_generated']:,.0f}",
            f"{m['tokens_trained']:,.0f}",
            _n(m["prompts_lost"]),
            _n(m["prompts_duplicated"]),
            _n(m["kills_landed"]),
            f"{m['wall_s']:.1f}",
            _x(m["wall_vs_sibling"]),
            f"{m['run_s']:.1f}",
        )
    return title, t


def speedup_table(r: dict) -> tuple[str, Any]:
    """(title, rich table) of one workload's `async_speedup` result."""
    from rich.table import Table

    title = (
        f"async speedup, {r['workload']}: {r['describe']}; uninterrupted, "
        f"time from run_started to run_finished; medians of {r['repeats']} repeat(s)"
    )
    t = Table()
    for col in ("max_lookahead_versions", "run s", "steps/s", "speedup vs 0"):
        t.add_column(col, justify="right")
    for la, m in r["lookaheads"].items():
        t.add_row(la, f"{m['run_s']:.2f}", f"{m['steps_per_s']:.2f}", _x(m["speedup_vs_0"]))
    return title, t


def waste_table(r: dict) -> tuple[str, Any]:
    """(title, rich table) of a `waste` result."""
    title = (
        f"wasted generation per sampler: {r['describe']}; completions generated / trained "
        f"(1.00 = nothing generated twice); medians of {r['repeats']} repeat(s)"
    )
    t = _table(
        "sampler",
        "completions\ngenerated",
        "completions\ntrained",
        "generated\n/ trained",
        "groups\nevicted",
        "run s",
        "steps/s",
        "trained\ncompletions/s",
        "vs in_order\n(speed)",
        "goodput",
        f"goodput\n{r.get('kills', 0)} kills",
    )
    for sampler, m in r["samplers"].items():
        t.add_row(
            sampler,
            f"{m['generated']:g}",
            f"{m['trained']:g}",
            f"{m['ratio']:.2f}",
            f"{m['evicted']:g}",
            f"{m['run_s']:.2f}",
            f"{m['steps_per_s']:.2f}",
            f"{m['trained_per_s']:.0f}",
            _x(m.get("speed_vs_in_order", float("nan"))),
            f"{m['goodput']:.3f}",
            f"{m['killed_goodput']:.3f}" if "killed_goodput" in m else "-",
        )
    return title, t


def restart_table(r: dict) -> tuple[str, Any]:
    """(title, rich table) of a `restart_latency` result."""
    verdict = "meets" if r["meets_target"] else "MISSES"
    step_verdict = "meets" if r["meets_first_step_target"] else "MISSES"
    title = (
        f"restart latency: {r['describe']}; seconds, medians of {r['repeats']}; the first "
        f"dispatch comes {r['median']['overhead_s']:.2f} s after import torch would be done "
        f"({verdict} the target of <= {r['target_overhead_s']:.2f} s), the first trained step "
        f"{r['median']['first_step_overhead_s']:.2f} s after it ({step_verdict} the target of "
        f"<= {r['target_first_step_overhead_s']:.2f} s)"
        + ("" if r["bytecode_cache"] else "; rollkeep's modules had no .pyc cache")
    )
    t = _table("measure", "median", "min", "max")
    for key, label in (
        ("import_torch_s", "import torch: process start -> imported"),
        ("import_torch_inprocess_s", "import torch: the import alone"),
        ("run_started_s", "restart: process start -> run_started"),
        ("first_dispatch_s", "restart: process start -> first dispatched after restore"),
        ("overhead_s", "first dispatched - import torch (both from process start)"),
        ("to_first_step_s", "restart: process start -> first step committed after restore"),
        ("first_step_overhead_s", "first step committed - import torch (both from process start)"),
        ("restore_chain_s", "restore chain (in process, read-only)"),
    ):
        t.add_row(label, f"{r['median'][key]:.3f}", f"{r['min'][key]:.3f}", f"{r['max'][key]:.3f}")
    return title, t


def cluster_tables(r: dict) -> list[tuple[str, Any]]:
    """(title, rich table) pairs of a `cluster_bench` result (the parts it ran)."""
    out = []
    reps = f"medians of {r['repeats']} repeat(s)"
    if "ray_init" in r:
        t = _table("measure", "seconds")
        m = r["ray_init"]["median"]
        t.add_row("import ray (fresh process)", f"{m['import_s']:.2f}")
        t.add_row("ray.init(num_cpus=2), a new local Ray", f"{m['init_s']:.2f}")
        t.add_row("ray.shutdown", f"{m['shutdown_s']:.2f}")
        t.add_row("the whole subprocess", f"{m['wall_s']:.2f}", end_section=True)
        for n, s in r["pool_open_s"].items():
            t.add_row(f"EnginePool.open: {n} toy replica(s) answer (on a running Ray)", f"{s:.2f}")
        out.append((f"Ray start-up on {r['cpus']} CPU(s); {reps}", t))
    for name in ("toy", "torch"):
        if name not in r:
            continue
        x = r[name]
        t = _table(
            "backend",
            "tokens/s",
            "attempts/s",
            "steps/s",
            f"speed vs\n{x['baseline']}",
            "peak attempts\nin flight",
            "sealed per\nreplica",
            "run s",
            "wall s\n(w/ start-up)",
        )
        for label, m in x["variants"].items():
            t.add_row(
                label,
                f"{m['tokens_per_s']:,.0f}",
                f"{m['attempts_per_s']:,.0f}",
                f"{m['steps_per_s']:.2f}",
                _x(m["speed_vs_first"]),
                f"{m['peak_in_flight']:g}",
                "/".join(str(v) for v in m["sealed_per_replica"].values()),
                f"{m['run_s']:.2f}",
                f"{m['wall_s']:.1f}",
            )
        out.append(
            (
                f"throughput vs replicas, {x['describe']}; replicas at cluster.replica_cpus="
                f"{r['replica_cpus']:g}, uninterrupted, run_started -> run_finished; {reps}",
                t,
            )
        )
    if "kill" in r:
        k = r["kill"]
        t = _table("measure", "median")
        m = k["median"]
        for key, label, fmt in (
            ("kill_to_died_s", "SIGKILL -> engine_replica_died (the pool sees it), s", "{:.3f}"),
            ("down_s", "down_seconds: death -> restarted, refit and getting work, s", "{:.3f}"),
            ("kill_to_back_s", "SIGKILL -> engine_replica_started (restart 1), s", "{:.3f}"),
            ("attempts_failed", "attempts it failed (infra)", "{:g}"),
            ("retry_dispatched_s", "death -> all of them dispatched again, s", "{:.3f}"),
            ("retry_sealed_s", "death -> all of them sealed, s", "{:.3f}"),
            ("sealed_after_back", "attempts it sealed after coming back", "{:g}"),
        ):
            t.add_row(label, fmt.format(m[key]))
        back = (
            "every killed replica came back"
            if k["all_came_back"]
            else "a killed replica DID NOT come back"
        )
        out.append((f"a replica killed mid-run: {k['describe']}; {back}; {reps}", t))
    if "weights" in r:
        w = r["weights"]
        t = _table("measure", "ms")
        t.add_row("ray.put(trainer.weights())", f"{w['put_s'] * 1e3:.1f}")
        for n, s in w["refit_s"].items():
            t.add_row(
                f"EnginePool.update_weights, {n} replica(s) (publish + refit all)", f"{s * 1e3:.1f}"
            )
        out.append(
            (
                f"weight publication, built-in GPT at arith.yaml's size ({w['params']:,} parameters, "
                f"{w['mb']:.2f} MB); medians",
                t,
            )
        )
    return out


def _x(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.2f}x"


def _n(v: float) -> str:
    return f"{v:g}"


def _note(line: str) -> None:
    print(f"  {line}", flush=True)


def _print(titled: tuple[str, Any]) -> None:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(width=160, highlight=False)  # piped: do not squeeze to 80 columns
    title, table = titled
    console.print(title, markup=False)
    console.print(table)


def _table(*columns: str) -> Any:
    """A rich table whose first column (the row's label) is left-aligned, the numbers right."""
    from rich.table import Table

    t = Table()
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i == 0 else "right")
    return t

"""`rollkeep bench --suite controller`: the control plane's costs and how they scale.

  scheduler   the sans-IO scheduler alone (`bench.scheduler`): siblings per CPU-second at
              G = 16, bare and with the trace and the journal, medians of interleaved repeats
  ceiling     the same through the runner (`controller.train`) on the toy engine and
              trainer at zero latency: siblings per CPU-second of the whole process
  sweep       cost against size, with the fitted exponent (the slope of log cost on log
              size; 1.0 = linear): per-result scheduling at G = 4 ... 64 (per group) and
              with 1 k / 10 k / 100 k groups in flight (per sibling); the cut's hold,
              the checkpoint's write and its restore at 1 k / 10 k / 100 k in-flight groups
              (G = 16) and at G = 4 ... 64 (10 k groups), and the write at the largest size
              phase by phase (`checkpoint.cut.checkpoint_files`' phases and the publish)
  checkpoint  the write (and its share of the `dd` yardstick, and the most that share can
              be), the restore and the restored run's first write at 10 k and 100 k
              in-flight groups: medians of --repeats runs, each in a fresh process, the
              sizes interleaved (issue 29's targets)

Per-result scheduling "with N in flight" runs `bench.scheduler` with N/2 prompts per step
and one step of lookahead, so about N groups are admitted at once.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from ..core.errors import RollkeepError
from .scheduler import run_scheduler


def fitted_exponent(sizes: Sequence[float], costs: Sequence[float]) -> float | None:
    """Least-squares slope of log(cost) on log(size): cost ∝ size^exponent."""
    pts = [(math.log(s), math.log(c)) for s, c in zip(sizes, costs, strict=True) if s > 0 and c > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / var if var else None


def scheduler_rates(repeats: int, *, quick: bool) -> dict:
    """Siblings per CPU-second, bare and with sinks, interleaved `repeats` times."""
    p, steps = (64, 4) if quick else (256, 8)
    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for sinks in (False, True):
            runs[sinks].append(run_scheduler(group_size=16, prompts_per_step=p, steps=steps,
                                             sinks=sinks)["siblings_per_cpu_s"])
    return {"group_size": 16, "prompts_per_step": p, "steps": steps, "repeats": repeats,
            "bare_siblings_per_cpu_s": statistics.median(runs[False]),
            "sinks_siblings_per_cpu_s": statistics.median(runs[True]),
            "bare_runs": runs[False], "sinks_runs": runs[True]}


def runner_ceiling(repeats: int, *, quick: bool) -> dict:
    """The toy job through the runner, CPU-seconds of the process per sibling."""
    from .controller import ceiling

    steps = 10 if quick else 40
    rates = []
    for _ in range(repeats):
        t0 = time.process_time()
        r = ceiling(steps=steps)
        rates.append(r["steps"] * r["prompts_per_step"] * r["group_size"] / (time.process_time() - t0))
    return {"steps": steps, "repeats": repeats, "siblings_per_cpu_s": statistics.median(rates), "runs": rates}


#: What `checkpoint_costs` reports that the medians keep (seconds, and the bytes).
_CHECKPOINT_KEYS = ("write_s", "restore_s", "write_after_restore_s", "bytes")
_FRESH_PROCESS_TIMEOUT_S = 600


def _checkpoint_in_fresh_process(n: int) -> dict:
    """`checkpoint_costs(n)` in a new interpreter (no heap, cache or collector state left by
    an earlier size), its numbers back as JSON."""
    code = ("import json, sys\n"
            "from rollkeep.bench.controller import checkpoint_costs\n"
            "r = checkpoint_costs(int(sys.argv[1]))\n"
            f"print(json.dumps({{k: r[k] for k in {_CHECKPOINT_KEYS!r}}}))")
    try:  # ~20 s at 100 k groups: a child this slow is stuck, not measuring
        done = subprocess.run([sys.executable, "-c", code, str(n)], capture_output=True, text=True,
                              check=False, timeout=_FRESH_PROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RollkeepError(f"bench controller: the checkpoint at {n:,} groups in a fresh process did not finish",
                            expected=f"done within {_FRESH_PROCESS_TIMEOUT_S} s", found="still running; killed",
                            remedy="run `rollkeep bench --suite controller --quick` to see where it stops") from None
    if done.returncode != 0:
        raise RollkeepError(f"bench controller: the checkpoint at {n:,} groups in a fresh process failed",
                            expected="exit code 0", found=f"exit code {done.returncode}: {done.stderr.strip()[-2000:]}",
                            remedy="fix the error it printed; the bench measures a working checkpoint")
    return json.loads(done.stdout.strip().splitlines()[-1])


def checkpoint_medians(sizes: Sequence[int], repeats: int) -> dict:
    """The checkpoint's write, restore and the restored run's first write at each size,
    each run in a fresh process, the sizes interleaved `repeats` times: medians, with the
    write's share of the `dd` yardstick and its bound (`hash_s`)."""
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            runs[n].append(_checkpoint_in_fresh_process(n))
    out: dict = {"inflight_groups": list(sizes), "repeats": repeats}
    for key in _CHECKPOINT_KEYS:
        out[key] = [statistics.median(r[key] for r in runs[n]) for n in sizes]
        out[key + "_runs"] = [[r[key] for r in runs[n]] for n in sizes]
    out["write_over_disk"], out["write_over_disk_bound"] = _disk_shares(out["bytes"], out["write_s"])
    return out


def sweep(*, quick: bool) -> dict:
    from .controller import checkpoint_costs

    out: dict = {}
    gs = [4, 16] if quick else [4, 8, 16, 32, 64]
    per_group = []
    for g in gs:
        r = run_scheduler(group_size=g, prompts_per_step=64 if quick else 256, steps=4)
        per_group.append(r["cpu_s"] / (r["siblings"] / g))
    out["scheduling_by_group_size"] = {"group_size": gs, "cpu_s_per_group": per_group,
                                       "exponent": fitted_exponent(gs, per_group)}
    ns = [1000, 4000] if quick else [1000, 10_000, 100_000]
    per_sibling = []
    for n in ns:
        r = run_scheduler(group_size=16, prompts_per_step=n // 2, steps=2)
        per_sibling.append(r["cpu_s"] / r["siblings"])
    out["scheduling_by_inflight"] = {"inflight_groups": ns, "cpu_s_per_sibling": per_sibling,
                                     "exponent": fitted_exponent(ns, per_sibling)}
    ck = [checkpoint_costs(n) for n in ns]
    out["checkpoint_by_inflight"] = _checkpoint_fit(ns, ck)
    ng = 2000 if quick else 10_000
    ckg = [checkpoint_costs(ng, group_size=g) for g in gs]
    out["checkpoint_by_group_size"] = {"inflight_groups": ng, **_checkpoint_fit(gs, ckg, size="group_size")}
    return out


def disk_write_s(nbytes: int) -> float:
    """What `dd ... conv=fsync` takes for `nbytes` in the temporary directory: one write of
    that many bytes and an fsync, best of three (the disk's bandwidth, the write's yardstick)."""
    import os
    import tempfile

    data, best = b"\0" * nbytes, math.inf
    for _ in range(3):
        with tempfile.NamedTemporaryFile() as f:
            t0 = time.perf_counter()
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            best = min(best, time.perf_counter() - t0)
    return best


def hash_s(nbytes: int) -> float:
    """What sha256 of `nbytes` in memory takes, best of three: a publish hashes every file
    for the manifest before it writes any (`CheckpointStore.publish`, P1), so no write of
    these bytes beats `disk_write_s + hash_s`, and write/dd is at most dd / (dd + sha256)."""
    import hashlib

    data, best = b"\0" * nbytes, math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        hashlib.sha256(data).digest()
        best = min(best, time.perf_counter() - t0)
    return best


def _disk_shares(sizes: Sequence[float], writes: Sequence[float]) -> tuple[list[float], list[float]]:
    """Each write's share of the `dd` yardstick for its bytes, and the most that share can be."""
    disk = [disk_write_s(int(b)) for b in sizes]
    return ([d / w for d, w in zip(disk, writes, strict=True)],
            [d / (d + hash_s(int(b))) for d, b in zip(disk, sizes, strict=True)])


def _checkpoint_fit(sizes: list[int], results: list[dict], *, size: str = "inflight_groups") -> dict:
    fit: dict = {size: sizes}
    fit["write_over_disk"], fit["write_over_disk_bound"] = _disk_shares([r["bytes"] for r in results],
                                                                        [r["write_s"] for r in results])
    fit["write_phases"] = [r["write_phases"] for r in results]
    for key in ("cut_hold_s_median", "write_s", "write_after_restore_s", "restore_s", "bytes"):
        values = [r[key] for r in results]
        fit[key] = values
        fit[key + "_exponent"] = fitted_exponent(sizes, values)
    return fit


def run(*, quick: bool, repeats: int, log=print) -> dict:
    out: dict = {}
    s = out["scheduler"] = scheduler_rates(max(repeats, 1 if quick else 5), quick=quick)
    # The best run too: a noisy machine only ever slows a run down.
    log(f"scheduler alone (sans-IO, G=16, P={s['prompts_per_step']}, medians of {s['repeats']} interleaved): "
        f"{s['bare_siblings_per_cpu_s']:,.0f} siblings per CPU-second bare (best {max(s['bare_runs']):,.0f}; "
        f"target >= 50,000), {s['sinks_siblings_per_cpu_s']:,.0f} with the trace and the journal "
        f"(best {max(s['sinks_runs']):,.0f}; target >= 20,000)")
    c = out["runner"] = runner_ceiling(1 if quick else 3, quick=quick)
    log(f"through the runner (toy engine and trainer, zero latency): {c['siblings_per_cpu_s']:,.0f} siblings "
        f"per CPU-second of the process (median of {c['repeats']})")
    w = out["sweep"] = sweep(quick=quick)
    g = w["scheduling_by_group_size"]
    log("per-result scheduling by G: " + ", ".join(
        f"G={n} {t * 1e6:.0f} us/group" for n, t in zip(g["group_size"], g["cpu_s_per_group"], strict=True))
        + f"; exponent {_fmt(g['exponent'])} (1.0 = linear in G)")
    i = w["scheduling_by_inflight"]
    log("per-result scheduling by groups in flight: " + ", ".join(
        f"{n:,} {t * 1e6:.1f} us/sibling" for n, t in zip(i["inflight_groups"], i["cpu_s_per_sibling"], strict=True))
        + f"; exponent {_fmt(i['exponent'])} (0 = flat)")
    for name, fit, unit in (("in-flight groups (G=16)", w["checkpoint_by_inflight"], "inflight_groups"),
                            (f"G ({w['checkpoint_by_group_size']['inflight_groups']:,} groups)",
                             w["checkpoint_by_group_size"], "group_size")):
        log(f"checkpoint by {name}: " + "; ".join(
            f"{n:,}: cut {h * 1e6:.0f} us, write {wr:.3f} s, restore {rs:.3f} s, write after it {wa:.3f} s, "
            f"{b / 1e6:.1f} MB"
            for n, h, wr, rs, wa, b in zip(fit[unit], fit["cut_hold_s_median"], fit["write_s"], fit["restore_s"],
                                           fit["write_after_restore_s"], fit["bytes"], strict=True))
            + "; write/dd " + ", ".join(f"{x:.0%}" for x in fit["write_over_disk"])
            + " (at most " + ", ".join(f"{x:.0%}" for x in fit["write_over_disk_bound"]) + ": dd/(dd + sha256))"
            + f"; exponents: cut {_fmt(fit['cut_hold_s_median_exponent'])}, write {_fmt(fit['write_s_exponent'])}, "
            f"restore {_fmt(fit['restore_s_exponent'])}")
    m = out["checkpoint"] = checkpoint_medians([1000] if quick else [10_000, 100_000], s["repeats"])
    log(f"checkpoint, medians of {m['repeats']} interleaved fresh processes: " + "; ".join(
        f"{n:,} in-flight groups: write {wr:.3f} s (dd's share {x:.0%}, at most {b:.0%}), restore {rs:.3f} s, "
        f"the restored run's first write {wa:.3f} s"
        for n, wr, x, b, rs, wa in zip(m["inflight_groups"], m["write_s"], m["write_over_disk"],
                                       m["write_over_disk_bound"], m["restore_s"], m["write_after_restore_s"],
                                       strict=True))
        + " (targets: write >= 50 % of dd at 100 k; restore <= 0.3 s at 10 k, <= 3 s at 100 k)")
    ck = w["checkpoint_by_inflight"]
    log(f"checkpoint write at {ck['inflight_groups'][-1]:,} in-flight groups, by phase: " + ", ".join(
        f"{name} {t:.3f} s" for name, t in ck["write_phases"][-1].items()))
    return out


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"

"""Ray scale-out (`cluster.backend: ray`, docs/design.md §10), measured on one machine with
a local Ray.

    cluster_bench(repeats=..., quick=..., log=...)

Four parts, medians over repeats:

  startup     `import ray` and `ray.init(num_cpus=2, include_dashboard=False,
              _node_ip_address="127.0.0.1", address="local")` in a fresh subprocess (what a
              run without `cluster.address` pays before its replicas start), then, on the
              suite's Ray head, the time `EnginePool.open` takes until N toy replicas
              answer (N = 1, 2, 4; actors created and the pool ready)
  throughput  the same uninterrupted job with cluster.backend=local (one engine in the
              controller's process) and with 1, 2, 4 replicas (`cluster.replica_cpus` 0.25):
              the toy engine at a fixed 50 ms per generation and at most 8 at once per
              engine (`engine.max_concurrent`: a GPU engine's batch capacity), and the built-in GPT (torch,
              CPU) on arith from scratch; tokens generated per second and steps per second
              over run_started -> run_finished (start-up, the replicas' included, excluded;
              `wall_s` includes it), and the most attempts in flight at once (from the
              trace: `dispatched` generations minus `sealed` / `failed`)
  kill        a toy run on 2 replicas; once replica 0 has sealed some attempts its
              process (the pid of its `engine_replica_started`) is SIGKILLed: `down_s`, the
              `down_seconds` of its restart event (from the pool seeing its death until it
              got work again); `kill_to_died_s` / `kill_to_back_s`, from the SIGKILL to its
              `engine_replica_died` / second `engine_replica_started` line (one clock: the
              trace's `t` and the kill's are unix seconds on this machine);
              `retry_dispatched_s` / `retry_sealed_s`, from the `engine_replica_died` line
              to the moment every attempt it failed ("engine replica 0 died" in a `failed`
              line) has a later `dispatched` / `sealed` of the same (group, generation)
  weights     the built-in GPT at configs/arith.yaml's size: its weights' size, `ray.put`
              of `trainer.weights()`, and `EnginePool.update_weights` (one publish, every
              replica refit) with 1, 2, 4 replicas

Every run connects to one Ray head the suite starts in a helper process (`cluster.address`,
as tests/cluster/conftest.py does; auth off, loopback only); the pool and weight probes run
in a subprocess of their own, so this process never becomes a Ray driver. Without Ray the
suite returns `{"skipped": RAY_MISSING}`.

What limits throughput: with in_order, lookahead 1 and no `max_inflight_prompts`, at most
P x (lookahead + 1) prompt groups are in flight, i.e. 2 x P x G = 64 attempts. An unbounded
toy engine only sleeps, so one replica would run all 64 at once and more replicas could add
nothing. Each toy engine therefore runs at most 8 attempts at once: one replica's ceiling is
8 / 50 ms = 160 attempts/s, and the replica count shows how the pool scales until Ray's
per-attempt cost on these 2 cores (also measured: the local engine, unbounded) caps it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

from ..chaos import _env, _train_cmd
from ..core.errors import RollkeepError
from ..trace import read_trace
from .preemption import measure, run_preempted

RAY_MISSING = "skipped: ray is not installed (pip install 'rollkeep[ray]')"
REPLICA_CPUS = 0.25
TOY_LATENCY_MS = 50
TOY_MAX_CONCURRENT = 8  # per engine: a batch capacity, so replicas add generation capacity
KILL_AFTER_SEALED = 16  # replica 0 is killed once it has sealed this many attempts

HEAD = """
import sys, ray
ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
print("GCS", ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the suite closes our stdin
ray.shutdown()
"""

STARTUP = """
import json, time
t0 = time.perf_counter()
import ray
t1 = time.perf_counter()
ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", address="local",
         log_to_driver=False)
t2 = time.perf_counter()
ray.shutdown()
t3 = time.perf_counter()
print("RESULT", json.dumps({"import_s": t1 - t0, "init_s": t2 - t1, "shutdown_s": t3 - t2}), flush=True)
"""

PROBE = "import sys; from rollkeep.bench.cluster import probe_main; probe_main(sys.argv[1])"


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _ray_env() -> dict[str, str]:
    """The environment of the head and of every run: this machine only, no token to hand
    around, nothing sent out, no RAY_ADDRESS of the caller's."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    return env


@contextlib.contextmanager
def ray_head(timeout: float = 120.0) -> Iterator[str]:
    """A local Ray head in a helper process for the duration; yields its GCS address.
    While it is up, this process's environment has RAY_AUTH_MODE=disabled (the runs
    inherit it) and no RAY_ADDRESS."""
    saved = {
        k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED", "RAY_ADDRESS")
    }
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    os.environ.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_ray_env(),
    )
    try:
        address = _read_marked(head, "GCS", timeout)
        if address is None:
            raise RollkeepError(
                "bench cluster: the Ray head did not start",
                remedy="run `python -c 'import ray; ray.init()'` by hand and fix the error",
            )
        yield address
    finally:
        with contextlib.suppress(OSError):
            head.stdin.close()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _read_marked(proc: subprocess.Popen, mark: str, timeout: float) -> str | None:
    """The rest of the first stdout line of `proc` that starts with `mark` (None if it
    exits or `timeout` passes first)."""
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith(mark + " "):
                found.append(line[len(mark) + 1 :].strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return found[0] if found else None


def _subprocess_json(args: list[str], timeout: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_ray_env(),
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RollkeepError(
        f"bench cluster: a probe failed with exit code {proc.returncode}",
        found=(proc.stderr or proc.stdout)[-2000:] or "no output",
    )


# ----------------------------------------------------------------------------- start-up


def ray_startup(repeats: int, timeout: float = 120.0) -> dict[str, Any]:
    """`import ray` and `ray.init` of a fresh local Ray in a fresh subprocess, `repeats`
    times; wall_s is the subprocess's whole life (Python start-up and shutdown included)."""
    runs = []
    for _ in range(repeats):
        t0 = time.monotonic()
        r = _subprocess_json([STARTUP], timeout)
        runs.append({**r, "wall_s": time.monotonic() - t0})
    return {"median": _medians(runs), "runs": runs}


# ----------------------------------------------------------------------------- probes


def probe_main(spec_json: str) -> None:
    """Entry point of the probe subprocess: connect to the head, measure, print RESULT."""
    import asyncio

    import ray

    spec = json.loads(spec_json)
    ray.init(address=spec["address"], log_to_driver=False, configure_logging=False)
    try:
        fn = {"pool_open": _probe_pool_open, "weights": _probe_weights}[spec["what"]]
        result = asyncio.run(fn(spec))
    finally:
        ray.shutdown()
    print("RESULT", json.dumps(result), flush=True)


def _ray_overrides(address: str, replicas: int) -> list[str]:
    return [
        "cluster.backend=ray",
        f"cluster.address={address}",
        f"engine.replicas={replicas}",
        f"cluster.replica_cpus={REPLICA_CPUS}",
        "logger.progress=none",
    ]


async def _probe_pool_open(spec: dict[str, Any]) -> dict[str, Any]:
    """Per N: seconds from creating the pool's actors to all N answering (`open`)."""
    from ..cluster import open_engine
    from ..config import load_config
    from ..engines import EngineRecipe

    out: dict[str, list[float]] = {}
    for n in spec["replicas"]:
        out[str(n)] = []
        for _ in range(spec["repeats"]):
            cfg = load_config(
                None, ["engine.name=toy", "trainer.name=toy", *_ray_overrides(spec["address"], n)]
            )
            t0 = time.perf_counter()
            pool = open_engine(cfg, EngineRecipe(cfg.engine, {"tool_turns": 0}))
            await pool.open()
            seconds = time.perf_counter() - t0
            live = pool.stats()["live"]
            await pool.close()
            if live != n:
                raise RuntimeError(f"pool of {n}: only {live} replica(s) answered")
            out[str(n)].append(seconds)
    return out


async def _probe_weights(spec: dict[str, Any]) -> dict[str, Any]:
    """The built-in GPT at arith.yaml's size: weight size, ray.put, and per N the pool's
    update_weights (publish once, refit all) over `repeats` new versions."""
    import ray

    from ..config import load_config
    from ..controller.build import build

    arith = str(files("rollkeep") / "configs" / "arith.yaml")
    out: dict[str, Any] = {"put_s": [], "refit_s": {}}
    for n in spec["replicas"]:
        cfg = load_config(
            arith,
            [
                "warmup.sft_steps=0",
                "eval.every_steps=0",
                *_ray_overrides(spec["address"], n),
                f"run_dir={tempfile.gettempdir()}/unused",
            ],
        )
        parts = build(cfg)
        pool, trainer = parts.engine, parts.trainer
        await pool.open()
        try:
            weights = trainer.weights()
            unique = {t.data_ptr(): t for t in weights.values()}
            out["mb"] = sum(t.numel() * t.element_size() for t in unique.values()) / 1e6
            out["params"] = sum(t.numel() for t in unique.values())
            if not out["put_s"]:
                for _ in range(spec["repeats"]):
                    t0 = time.perf_counter()
                    ref = ray.put(trainer.weights())
                    out["put_s"].append(time.perf_counter() - t0)
                    del ref
            out["refit_s"][str(n)] = []
            for v in range(1, spec["repeats"] + 1):
                w = trainer.weights()
                t0 = time.perf_counter()
                await pool.update_weights(w, v)
                out["refit_s"][str(n)].append(time.perf_counter() - t0)
            if pool.stats()["live"] != n:
                raise RuntimeError(
                    f"pool of {n}: only {pool.stats()['live']} replica(s) live after refits"
                )
        finally:
            await pool.close()
    return out


def _probe(
    address: str, what: str, replicas: Sequence[int], repeats: int, timeout: float
) -> dict[str, Any]:
    spec = {"address": address, "what": what, "replicas": list(replicas), "repeats": repeats}
    return _subprocess_json([PROBE, json.dumps(spec)], timeout)


# ----------------------------------------------------------------------------- throughput


def toy_job(steps: int) -> tuple[str, list[str], str]:
    overrides = [
        f"engine.latency_ms={TOY_LATENCY_MS}",
        f"engine.max_concurrent={TOY_MAX_CONCURRENT}",
        "engine.latency_jitter_ms=0",
        "engine.infra_fail_rate=0",
        "engine.data_fail_rate=0",
        "trainer.step_sleep_ms=0",
        f"train.total_steps={steps}",
        "checkpoint.every_steps=10",
        "data.generated.n_rows=1024",
        "data.epochs=null",
    ]
    describe = (
        f"toy engine {TOY_LATENCY_MS} ms per generation, at most {TOY_MAX_CONCURRENT} at once per engine, "
        f"no failures, trainer 0 ms/step, P=8, G=4, "
        f"in_order lookahead 1 (at most 16 groups = 64 attempts in flight), {steps} steps"
    )
    return str(files("rollkeep") / "configs" / "toy.yaml"), overrides, describe


def torch_job(steps: int) -> tuple[str, list[str], str]:
    overrides = ["warmup.sft_steps=0", "eval.every_steps=0", f"train.total_steps={steps}"]
    describe = (
        f"built-in GPT (torch, CPU, arith.yaml's 2x128 model) from scratch, P=16, G=8, "
        f"in_order lookahead 1, {steps} steps"
    )
    return str(files("rollkeep") / "configs" / "arith.yaml"), overrides, describe


def peak_in_flight(lines: list[dict[str, Any]]) -> int:
    """The most attempts dispatched and not yet sealed or failed at once."""
    now = peak = 0
    for x in lines:
        if x["event"] == "dispatched":
            now += len(x["generations"])
            peak = max(peak, now)
        elif x["event"] in ("sealed", "failed", "abandoned"):
            now -= 1
    return peak


def _run(config: str, overrides: list[str], workdir: Path, timeout: float) -> dict[str, Any]:
    res = run_preempted(config, overrides, kill_delays=[], workdir=workdir, timeout=timeout)
    lines, _ = read_trace(workdir / "run" / "trace.jsonl")
    sealed = [x for x in lines if x["event"] == "sealed"]
    per_replica: dict[str, int] = {}
    for x in sealed:
        per_replica[str(x.get("replica", 0))] = per_replica.get(str(x.get("replica", 0)), 0) + 1
    started = [x for x in lines if x["event"] == "engine_replica_started"]
    return {
        "run_s": res["run_s"],
        "wall_s": res["wall_s"],
        "steps": res["steps"],
        "tokens": res["tokens_generated"],
        "attempts": len(sealed),
        "tokens_per_s": res["tokens_generated"] / res["run_s"],
        "steps_per_s": res["steps"] / res["run_s"],
        "attempts_per_s": len(sealed) / res["run_s"],
        "peak_in_flight": peak_in_flight(lines),
        "replicas_started": len(started),
        "sealed_per_replica": per_replica,
    }


def throughput(
    job: Any,
    variants: Sequence[int],
    *,
    address: str,
    steps: int,
    repeats: int,
    root: Path,
    log: Any,
    timeout: float,
) -> dict[str, Any]:
    """Per variant (0: cluster.backend=local; N: N Ray replicas), medians over repeats
    (variants interleaved within each repeat)."""
    config, overrides, describe = job(steps)
    name = job.__name__.removesuffix("_job")
    runs: dict[str, list[dict[str, Any]]] = {_label(v): [] for v in variants}
    for r in range(repeats):
        for v in variants:
            extra = [] if v == 0 else _ray_overrides(address, v)
            m = _run(config, [*overrides, *extra], root / name / f"r{r}-{_label(v)}", timeout)
            if m["steps"] != steps:
                raise RollkeepError(
                    f"bench cluster: the {name} run on {_label(v)} trained {m['steps']} steps, "
                    f"expected {steps}"
                )
            runs[_label(v)].append(m)
            log(
                f"cluster {name}: repeat {r + 1}/{repeats} {_label(v):9} {m['tokens_per_s']:8.0f} tokens/s "
                f"{m['steps_per_s']:6.2f} steps/s, peak {m['peak_in_flight']} in flight, "
                f"run {m['run_s']:.2f} s (wall {m['wall_s']:.1f} s)"
            )
    med = {}
    base = runs[_label(variants[0])]
    for label, xs in runs.items():
        med[label] = _medians(xs, skip=("sealed_per_replica",))
        med[label]["speed_vs_first"] = statistics.median(
            b["run_s"] / x["run_s"] for x, b in zip(xs, base, strict=True)
        )
        med[label]["sealed_per_replica"] = xs[-1]["sealed_per_replica"]
    return {
        "describe": describe,
        "steps": steps,
        "baseline": _label(variants[0]),
        "variants": med,
        "runs": runs,
    }


def _label(v: int) -> str:
    return "local" if v == 0 else f"ray x{v}"


# ----------------------------------------------------------------------------- kill


def kill_replica(
    *, address: str, steps: int, workdir: Path, timeout: float, kill_after: int = KILL_AFTER_SEALED
) -> dict[str, Any]:
    """One toy run on 2 replicas; replica 0 SIGKILLed after it sealed `kill_after`
    attempts; the measures of the module docstring, from the trace."""
    import shutil

    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    run_dir = workdir / "run"
    config, overrides, _ = toy_job(steps)
    overrides = [
        *overrides,
        "trainer.step_sleep_ms=50",
        *_ray_overrides(address, 2),
        f"run_dir={run_dir}",
    ]
    trace = run_dir / "trace.jsonl"
    with open(workdir / "train.stderr", "wb") as err:
        proc = subprocess.Popen(
            _train_cmd(config, overrides), env=_env(None), stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            killed, kill_t = _kill_when_sealed(proc, trace, 0, kill_after, timeout)
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        raise RollkeepError(
            f"bench cluster: the killed-replica run exited {proc.returncode}",
            found=(workdir / "train.stderr").read_text(errors="replace")[-2000:],
        )
    if killed is None:
        raise RollkeepError(
            "bench cluster: the run ended before replica 0 sealed enough attempts to kill it"
        )
    lines, _ = read_trace(trace)
    return {**replica_recovery(lines, 0, killed, kill_t), "steps": measure(run_dir)["steps"]}


def _kill_when_sealed(
    proc: subprocess.Popen, trace: Path, replica: int, after: int, timeout: float
) -> tuple[int | None, float]:
    """Follow the trace; once `replica` sealed `after` attempts, SIGKILL its process.
    Returns the pid killed (None if the run ended first) and when (unix seconds, the
    trace's clock)."""
    deadline = time.monotonic() + timeout
    pid, seen, sealed, pos, buf = None, 0, 0, 0, b""
    while time.monotonic() < deadline and proc.poll() is None:
        if trace.exists():
            with open(trace, "rb") as f:
                f.seek(pos)
                buf += f.read()
                pos = f.tell()
            *complete, buf = buf.split(b"\n")
            for line in complete:
                seen += 1
                x = json.loads(line)
                if x["event"] == "engine_replica_started" and x["replica"] == replica:
                    pid = x["pid"]
                elif x["event"] == "sealed" and x.get("replica") == replica and pid is not None:
                    sealed += 1
                    if sealed >= after:
                        os.kill(pid, signal.SIGKILL)
                        return pid, time.time()
        time.sleep(0.005)  # a supervisor polling a file another process writes
    return None, float("nan")


def replica_recovery(
    lines: list[dict[str, Any]], replica: int, pid: int, kill_t: float
) -> dict[str, Any]:
    """From a trace where `replica` (process `pid`) was killed once, at `kill_t` (unix
    seconds): its death and return, and how long its failed attempts took to be
    dispatched and sealed again."""
    died = [x for x in lines if x["event"] == "engine_replica_died" and x["replica"] == replica]
    started = [
        x for x in lines if x["event"] == "engine_replica_started" and x["replica"] == replica
    ]
    if not died or len(started) < 2:
        raise RollkeepError(
            f"bench cluster: replica {replica} did not die and come back",
            found=f"{len(died)} died, {len(started)} started lines",
        )
    death, back = died[0], started[1]
    marker = f"engine replica {replica} died"
    failed = [x for x in lines if x["event"] == "failed" and marker in x.get("error", "")]
    pending = {(x["group_id"], x["generation"]) for x in failed}
    redispatched: dict[tuple, float] = {}
    resealed: dict[tuple, float] = {}
    for x in lines:
        if x["t"] < death["t"]:
            continue
        if x["event"] == "dispatched":
            for g in x["generations"]:
                key = (x["group_id"], g)
                if key in pending and key not in redispatched:
                    redispatched[key] = x["t"]
        elif x["event"] == "sealed":
            key = (x["group_id"], x["generation"])
            if key in pending and key not in resealed:
                resealed[key] = x["t"]
    complete = len(redispatched) == len(resealed) == len(pending)
    return {
        "killed_pid": pid,
        "came_back": back["pid"] != pid and back["restart"] == 1,
        "restart": back["restart"],
        "down_s": back["down_seconds"],
        "kill_to_died_s": death["t"] - kill_t,  # until the pool saw the death
        "kill_to_back_s": back["t"] - kill_t,  # until it got work again
        "attempts_failed": death["attempts_failed"],
        "failed_lines": len(failed),
        "retried": len(resealed),
        "retry_dispatched_s": max(redispatched.values()) - death["t"]
        if complete and pending
        else float("nan"),
        "retry_sealed_s": max(resealed.values()) - death["t"]
        if complete and pending
        else float("nan"),
        "sealed_after_back": sum(
            1
            for x in lines
            if x["event"] == "sealed" and x.get("replica") == replica and x["t"] >= back["t"]
        ),
    }


# ----------------------------------------------------------------------------- the suite


def cluster_bench(
    *,
    repeats: int,
    quick: bool = False,
    log: Any = print,
    workdir: Path | None = None,
    timeout: float = 300.0,
    parts: Sequence[str] = ("startup", "throughput", "kill", "weights"),
) -> dict[str, Any]:
    """The four parts of the module docstring; {"skipped": RAY_MISSING} without Ray."""
    if not ray_available():
        return {"skipped": RAY_MISSING}
    replicas = (1, 2) if quick else (1, 2, 4)
    toy_steps, torch_steps, kill_steps = (10, 3, 30) if quick else (100, 16, 60)
    out: dict[str, Any] = {
        "repeats": repeats,
        "quick": quick,
        "replica_cpus": REPLICA_CPUS,
        "cpus": os.cpu_count(),
    }
    if "startup" in parts:  # before the head: a fresh Ray on an idle machine
        out["ray_init"] = ray_startup(repeats, timeout)
        m = out["ray_init"]["median"]
        log(
            f"cluster: import ray {m['import_s']:.2f} s, ray.init {m['init_s']:.2f} s, "
            f"subprocess {m['wall_s']:.2f} s"
        )
    with (
        tempfile.TemporaryDirectory(prefix="rollkeep-cluster-") as tmp,
        ray_head(timeout) as address,
    ):
        root = Path(workdir) if workdir is not None else Path(tmp)
        if "startup" in parts:
            opened = _probe(address, "pool_open", replicas, repeats, timeout)
            out["pool_open_s"] = {n: statistics.median(xs) for n, xs in opened.items()}
            out["pool_open_runs"] = opened
            log(
                "cluster: pool open "
                + ", ".join(f"{n} replica(s) {s:.2f} s" for n, s in out["pool_open_s"].items())
            )
        if "throughput" in parts:
            out["toy"] = throughput(
                toy_job,
                (0, *replicas),
                address=address,
                steps=toy_steps,
                repeats=repeats,
                root=root,
                log=log,
                timeout=timeout,
            )
            out["torch"] = throughput(
                torch_job,
                (0, 1) if quick else (0, 1, 2),
                address=address,
                steps=torch_steps,
                repeats=repeats,
                root=root,
                log=log,
                timeout=timeout,
            )
        if "kill" in parts:
            kills = []
            for r in range(repeats):
                k = kill_replica(
                    address=address, steps=kill_steps, workdir=root / f"kill-r{r}", timeout=timeout
                )
                kills.append(k)
                log(
                    f"cluster kill: repeat {r + 1}/{repeats}: replica 0 (pid {k['killed_pid']}) seen dead "
                    f"{k['kill_to_died_s']:.3f} s after the SIGKILL, back {k['down_s']:.3f} s later; "
                    f"{k['attempts_failed']} attempt(s) failed, all sealed again {k['retry_sealed_s']:.3f} s "
                    "after its death"
                )
            out["kill"] = {
                "describe": f"toy engine {TOY_LATENCY_MS} ms, trainer 50 ms/step, 2 replicas, "
                f"{kill_steps} steps; replica 0 SIGKILLed after it sealed "
                f"{KILL_AFTER_SEALED} attempts",
                "median": _medians(kills, skip=("killed_pid", "came_back")),
                "all_came_back": all(k["came_back"] for k in kills),
                "runs": kills,
            }
        if "weights" in parts:
            w = _probe(address, "weights", replicas, max(repeats, 3), timeout)
            out["weights"] = {
                "mb": w["mb"],
                "params": w["params"],
                "put_s": statistics.median(w["put_s"]),
                "refit_s": {n: statistics.median(xs) for n, xs in w["refit_s"].items()},
                "runs": w,
            }
            log(
                f"cluster weights: {w['mb']:.2f} MB, ray.put {out['weights']['put_s'] * 1e3:.1f} ms, refit "
                + ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in out["weights"]["refit_s"].items())
            )
    return out


def _medians(runs: list[dict[str, Any]], skip: Sequence[str] = ()) -> dict[str, Any]:
    keys = [k for k in runs[0] if k not in skip]
    return {k: statistics.median(float(x[k]) for x in runs) for k in keys}

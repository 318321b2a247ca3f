"""Restart latency: how long a killed default job takes to be generating again.

    restart_latency(repeats=..., quick=..., log=..., workdir=None, timeout=...)

Preparation: the default job (`configs/arith.yaml`, nothing overridden; with `quick` its
warm start is cut to QUICK_WARMUP steps, which a restart from an RL checkpoint never
reads) runs in WORKDIR/run until its first RL checkpoint is published, and is SIGKILLed.
Then, `repeats` times, interleaved so that a busy machine slows both alike:

  import torch         `python -c "import torch"` in a fresh process: from its launch
                       (taken here, just before the process is started) to the end of
                       the import (unix time printed by the child: interpreter start-up
                       included, its exit not), and the import alone, timed inside it
  restart              `rollkeep train` on the killed run directory, as a user reruns it,
                       in a fresh process: the launch time is taken here just before the
                       process is started; `run_started`, the first `dispatched` and the
                       first `step_committed` of the new run are read from the trace (their
                       `t` is unix time). The process is SIGKILLed as soon as both of the
                       last two are in the trace, long before its next checkpoint, so every
                       restart restores the same checkpoint.
  restore chain        in this process: the eight-step chain (`restore_chain`, read-only)
                       on that checkpoint, with a freshly built dataset and prompt source,
                       as a restart runs it (the dataset fingerprint is not cached)

Reported: medians (and min / max) over the repeats; `overhead_s` is process start → the
first dispatch after the restore minus `import torch` (launch → imported), and the target is
`overhead_s <= TARGET_OVERHEAD_S`; `first_step_overhead_s` is process start → the first
`step_committed` after the restore (`to_first_step_s`) minus `import torch`, and its target
is `first_step_overhead_s <= TARGET_FIRST_STEP_OVERHEAD_S`. `bytecode_cache` says whether
rollkeep's modules load from compiled `.pyc` files (PYTHONDONTWRITEBYTECODE with no
`__pycache__` makes every start compile them, which costs about 0.1 s).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

from ..chaos import _env, _trace_mark, _train_cmd
from ..core.errors import RollkeepError

TARGET_OVERHEAD_S = 0.3  # issue 14, item 13: first dispatch <= import torch + 0.3 s
TARGET_FIRST_STEP_OVERHEAD_S = 0.5  # first trained step <= import torch + 0.5 s
QUICK_WARMUP = 20
_IMPORT_TORCH = (
    "import time; t = time.perf_counter(); import torch; "
    "print(time.time(), time.perf_counter() - t)"
)
MEASURES = ("import_torch_s", "import_torch_inprocess_s", "run_started_s", "first_dispatch_s",
            "overhead_s", "to_first_step_s", "first_step_overhead_s", "restore_chain_s")


def restart_latency(
    *,
    repeats: int,
    quick: bool = False,
    log: Any = print,
    workdir: Path | None = None,
    timeout: float = 900.0,
    config: str | None = None,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """Medians over `repeats` restarts of a killed default job (module docstring).
    `config` and `overrides` replace the default job (tests use a smaller one)."""
    job = config is not None or bool(overrides)
    config = config or str(files("rollkeep") / "configs" / "arith.yaml")
    overrides = [*([f"warmup.sft_steps={QUICK_WARMUP}"] if quick and not job else []), *overrides]
    with tempfile.TemporaryDirectory(prefix="rollkeep-restart-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        shutil.rmtree(root / "run", ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        run_dir = root / "run"
        cmd = _train_cmd(config, [*overrides, f"run_dir={run_dir}", "logger.progress=none"])
        t0 = time.monotonic()
        checkpoint = _prepare(cmd, run_dir, root / "prepare.stderr", timeout)
        log(f"restart: killed the default job after its checkpoint {checkpoint} "
            f"({time.monotonic() - t0:.0f} s)")
        runs = []
        for r in range(repeats):
            torch_wall, torch_inside = _import_torch(timeout)
            started, dispatched, stepped, step = _restart(cmd, run_dir, root / f"restart-{r}.stderr", timeout)
            chain = _restore_chain_seconds(config, overrides, run_dir)
            runs.append({
                "import_torch_s": torch_wall,
                "import_torch_inprocess_s": torch_inside,
                "run_started_s": started,
                "first_dispatch_s": dispatched,
                "overhead_s": dispatched - torch_wall,
                "to_first_step_s": stepped,
                "first_step_overhead_s": stepped - torch_wall,
                "restore_chain_s": chain,
                "resumed_from_step": step,
            })
            log(f"restart: {r + 1}/{repeats}: import torch {torch_wall:.3f} s, run_started "
                f"{started:.3f} s, first dispatched {dispatched:.3f} s, first step {stepped:.3f} s (from step {step}), "
                f"restore chain {chain:.3f} s")
    med = {k: statistics.median(x[k] for x in runs) for k in MEASURES}
    return {
        "describe": (f"{Path(config).name} {' '.join(overrides)}".rstrip() if job else
                     "the default job" + (f" (warm start cut to {QUICK_WARMUP} steps)" if quick else ""))
        + f" killed after its first RL checkpoint ({checkpoint}), restarted {repeats} time(s)",
        "repeats": repeats,
        "checkpoint": checkpoint,
        "bytecode_cache": _bytecode_cached(),
        "target_overhead_s": TARGET_OVERHEAD_S,
        "meets_target": med["overhead_s"] <= TARGET_OVERHEAD_S,
        "target_first_step_overhead_s": TARGET_FIRST_STEP_OVERHEAD_S,
        "meets_first_step_target": med["first_step_overhead_s"] <= TARGET_FIRST_STEP_OVERHEAD_S,
        "median": med,
        "min": {k: min(x[k] for x in runs) for k in MEASURES},
        "max": {k: max(x[k] for x in runs) for k in MEASURES},
        "runs": runs,
    }


def _prepare(cmd: list[str], run_dir: Path, stderr: Path, timeout: float) -> str:
    """Run the job until its first RL checkpoint is published; SIGKILL it. Its name."""
    trace = run_dir / "trace.jsonl"
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(cmd, env=_env(None), stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and proc.poll() is None:
                if trace.exists() and b'"event":"checkpoint_published"' in trace.read_bytes():
                    break
                time.sleep(0.05)
            else:
                raise _failed("did not publish a checkpoint", stderr, timeout)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
    return (run_dir / "checkpoints" / "LATEST").read_text().strip()


def _import_torch(timeout: float) -> tuple[float, float]:
    """(launch → `import torch` done, the import alone) of a fresh interpreter."""
    launched = time.time()
    out = subprocess.run([sys.executable, "-c", _IMPORT_TORCH], capture_output=True, text=True,
                         timeout=timeout, check=True, env=_env(None))
    done, inside = (float(x) for x in out.stdout.split())
    return done - launched, inside


def _restart(cmd: list[str], run_dir: Path, stderr: Path,
             timeout: float) -> tuple[float, float, float, int]:
    """One restart: seconds from launch to `run_started`, to the new run's first
    `dispatched` and to its first `step_committed` (trace times), and the step it resumed from."""
    trace = run_dir / "trace.jsonl"
    mark = _trace_mark(trace)
    with open(stderr, "wb") as err:
        launched = time.time()
        proc = subprocess.Popen(cmd, env=_env(None), stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + timeout
            started = dispatched = stepped = None
            tail = b""
            with open(trace, "rb") as f:
                f.seek(mark)
                while stepped is None or dispatched is None:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise _failed("did not dispatch a generation after its restore" if dispatched
                                      is None else "did not commit a step after its restore",
                                      stderr, timeout)
                    tail += f.read()
                    *lines, tail = tail.split(b"\n")
                    for line in lines:
                        try:
                            x = json.loads(line)
                        except json.JSONDecodeError:  # a line the previous SIGKILL tore
                            continue
                        if x["event"] == "run_started":
                            started = x
                        elif not started or x.get("run_id") != started["run_id"]:
                            continue
                        elif x["event"] == "dispatched" and dispatched is None:
                            dispatched = x
                        elif x["event"] == "step_committed" and stepped is None:
                            stepped = x  # may precede the first dispatch (restored rollouts)
                    else:
                        time.sleep(0.002)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
    if started["resumed_from_step"] is None:
        raise _failed("started fresh instead of resuming", stderr, timeout)
    return (started["t"] - launched, dispatched["t"] - launched, stepped["t"] - launched,
            started["resumed_from_step"])


def _restore_chain_seconds(config: str, overrides: list[str], run_dir: Path) -> float:
    """The restore chain on the run's LATEST, in this process, read-only."""
    from ..config import ADDED_KEYS, load_config, semantic
    from ..controller.build import build_data
    from ..core.checkpoint.store import CheckpointStore
    from ..core.restore.chain import restore_chain
    from ..core.rollout.source import PromptSource

    cfg = load_config(config, [*overrides, f"run_dir={run_dir}"])
    dataset, _ = build_data(cfg)
    source = PromptSource(dataset, seed=cfg.seed, epochs=cfg.data.epochs)
    store = CheckpointStore(run_dir / "checkpoints")
    t0 = time.perf_counter()
    restore_chain(store, name=store.latest(), source=source, config=semantic(cfg), config_added=ADDED_KEYS)
    return time.perf_counter() - t0


def _bytecode_cached() -> bool:
    """Do rollkeep's modules load from compiled files (a `.pyc` next to the source)?"""
    from ..controller import runner

    pyc = importlib.util.cache_from_source(runner.__file__)
    return os.path.exists(pyc)


def _failed(what: str, stderr: Path, timeout: float) -> RollkeepError:
    return RollkeepError(
        f"benchmark: `rollkeep train` {what} (timeout {timeout:.0f} s)",
        found=stderr.read_text(errors="replace")[-2000:] or "nothing on stderr",
        path=str(stderr),
        remedy="run `rollkeep train` with the default config by hand and fix the error first",
    )

"""Server mode against in-process generation, on one model (`rollkeep bench --suite remote`).

    remote_bench(repeats=..., quick=..., log=..., model_dir=None)

Starts `rollkeep serve` processes on loopback (vLLM flavor) for a model directory (a tiny
GPT-2 built offline unless `model_dir` is given), and measures, in this process:

  fence_s           per server, from the first probe until it was ready (`server_fenced`)
  refit_s           per version: the weight directory written (RUN_DIR/weights/v<N>) and
                    every server reloaded from it and checked, against the weights' bytes
  tokens_per_s      N concurrent completions through the remote engine on 1 and on 2
                    servers, and through the in-process hf engine, same requests and seeds
  bytes_per_token   what the controller read of the answers per generated token
  restart_s         process start -> first trained step after a SIGKILL, `rollkeep train`
                    on the same job with the remote engine (servers left running) and with
                    the in-process hf engine

Medians over `repeats` (min and max beside them); the machine is noisy, the ratios matter.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

N_REQUESTS = 64


def _serve(model_dir: Path, work: Path) -> tuple[subprocess.Popen, str]:
    port_file = work / f"port-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, "-m", "rollkeep", "serve", str(model_dir), "--flavor", "vllm",
                             "--port", "0", "--port-file", str(port_file), "--exit-with-parent"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("rollkeep serve did not start")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}"


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)


def _section(urls: list[str], model_dir: Path) -> Any:
    from ..config.sections import RemoteEngineConfig

    return RemoteEngineConfig(servers=urls, tokenizer_path=str(model_dir), max_new_tokens=8)


def _requests(n: int) -> list[Any]:
    from ..core.custody.keys import Key
    from ..core.rollout.generation import GenRequest
    from ..core.rollout.source import Prompt

    return [GenRequest(group_id=f"e0.{i}", generation=0, attempt=0, seed=1000 + i, pinned_version=None,
                       prompt=Prompt(key=Key(0, i), group_id=f"e0.{i}", idx=i, task="arith", row={},
                                     row_fingerprint=0, prompt=f"{i % 50}+{i % 7}="))
            for i in range(n)]


async def _fleet_run(urls: list[str], model_dir: Path, run_dir: Path, weights: dict, repeats: int) -> dict[str, Any]:
    from ..core.custody.trace_schema import ServerFenced
    from ..remote import remote_pool

    pool = remote_pool(_section(urls, model_dir), run_dir=run_dir, source_dir=str(model_dir))
    events: list[Any] = []
    pool.attach(events.append, lambda why: None)
    try:
        await pool.open()
        await pool.update_weights(weights, 1)
        fence = [e.seconds for e in events if isinstance(e, ServerFenced)]
        refits = []
        for v in range(2, 2 + repeats):
            t0 = time.perf_counter()
            await pool.update_weights(_shifted(weights, 1e-3 * v), v)
            refits.append(time.perf_counter() - t0)
        rates, read0 = [], sum(h.bytes_read for h in pool._handles)
        tokens = 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            done = await asyncio.gather(*(pool.generate(r) for r in _requests(N_REQUESTS)))
            n = sum(len(c.completion_ids) for c in done)
            tokens += n
            rates.append(n / (time.perf_counter() - t0))
        read = sum(h.bytes_read for h in pool._handles) - read0
        return {"fence_s": fence, "refit_s": refits, "tokens_per_s": rates, "bytes_per_token": read / max(1, tokens)}
    finally:
        await pool.close()


async def _inprocess(model_dir: Path, weights: dict, repeats: int) -> list[float]:
    from ..engines.hf import HFEngine

    eng = HFEngine(model_path=str(model_dir), temperature=1.0, top_p=1.0, max_new_tokens=8, chat_template=False,
                   max_batch_size=64)
    try:
        await eng.update_weights(weights, 1)
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            done = await asyncio.gather(*(eng.generate(r) for r in _requests(N_REQUESTS)))
            rates.append(sum(len(c.completion_ids) for c in done) / (time.perf_counter() - t0))
        return rates
    finally:
        await eng.close()


def _job(model_dir: Path, work: Path, name: str, engine: list[str]) -> list[str]:
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7), "task": "arith"}) + "\n"
                            for i in range(400)))
    return [f"run_dir={work / name}", *engine, "engine.max_new_tokens=4", "trainer.name=hf",
            f"trainer.model_path={model_dir}", f"data.path={data}", "data.epochs=1", "train.total_steps=1000",
            "train.num_prompts_per_step=4", "rollout.group_size=3", "warmup.sft_steps=0", "checkpoint.every_steps=1",
            "eval.every_steps=0", "logger.progress=none"]


def _restart_s(over: list[str], trace: Path, timeout: float = 300.0) -> float:
    """Launch -> the first step a restarted `rollkeep train` commits, after a SIGKILL."""
    from ..chaos import _env, _trace_mark, _train_cmd

    def until(proc: subprocess.Popen, mark: int, event: str) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if trace.exists() and trace.stat().st_size > mark:
                with open(trace, "rb") as f:
                    f.seek(mark)
                    lines = [json.loads(x) for x in f.read().splitlines() if x.strip().endswith(b"}")]
                hit = [x for x in lines if x.get("event") == event]
                if hit:
                    return hit[0]["t"]
            if proc.poll() is not None:
                raise RuntimeError(f"rollkeep train exited {proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError(f"no {event} within {timeout:g} s")

    mark = _trace_mark(trace)
    proc = subprocess.Popen(_train_cmd(None, over), env=_env(None), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        until(proc, mark, "checkpoint_published")
    finally:
        proc.kill()
        proc.wait()
    mark = _trace_mark(trace)
    launched = time.time()
    proc = subprocess.Popen(_train_cmd(None, over), env=_env(None), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return until(proc, mark, "step_committed") - launched
    finally:
        proc.kill()
        proc.wait()


def _shifted(weights: dict, by: float) -> dict:
    """Other weights of the same shapes, ties kept (one new tensor per shared one)."""
    new: dict[int, Any] = {}
    return {k: new.setdefault(t.data_ptr(), t + by) for k, t in weights.items()}


def _med(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {}


def remote_bench(*, repeats: int, quick: bool, log: Callable[[str], None], model_dir: Path | None = None) -> dict:
    try:
        import fastapi  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return {"skipped": f"server mode needs fastapi, uvicorn, httpx and transformers ({e})"}
    with tempfile.TemporaryDirectory(prefix="rollkeep-bench-remote-") as tmp:
        work = Path(tmp)
        if model_dir is None:
            from ..models.tiny_hf import make_tiny_hf_model

            model_dir = make_tiny_hf_model(work / "model")
        from transformers import AutoModelForCausalLM

        # the state dict a trainer hands the engine (tied names share one tensor)
        weights = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()
        weight_bytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in weights.values()}.values())
        out: dict[str, Any] = {"model": str(model_dir), "weight_bytes": weight_bytes, "requests": N_REQUESTS}
        procs: list[subprocess.Popen] = []
        try:
            log("starting 2 rollkeep serve processes")
            urls = []
            for _ in range(2):
                p, u = _serve(model_dir, work)
                procs.append(p)
                urls.append(u)
            for n in (1, 2):
                run_dir = work / f"run{n}"
                run_dir.mkdir()
                log(f"{n} server(s)")
                r = asyncio.run(_fleet_run(urls[:n], model_dir, run_dir, weights, repeats))
                out[f"servers_{n}"] = {"fence_s": _med(r["fence_s"]), "refit_s": _med(r["refit_s"]),
                                       "tokens_per_s": _med(r["tokens_per_s"]), "bytes_per_token": r["bytes_per_token"]}
            log("restart: remote (servers left running) and in-process hf")
            servers = "engine.servers=[" + ",".join(f'"{u}"' for u in urls) + "]"
            remote = _job(model_dir, work, "restart-remote", ["engine.name=remote", servers,
                                                               f"engine.tokenizer_path={model_dir}"])
            local = _job(model_dir, work, "restart-hf", ["engine.name=hf", f"engine.model_path={model_dir}"])
            times = {"remote": [], "inprocess": []}
            for _ in range(repeats):  # interleaved: a busy machine slows both alike
                times["remote"].append(_restart_s(remote, work / "restart-remote" / "trace.jsonl"))
                times["inprocess"].append(_restart_s(local, work / "restart-hf" / "trace.jsonl"))
            out["restart_s"] = {k: _med(v) for k, v in times.items()}
        finally:
            _stop(procs)
        log("in-process hf engine")
        out["inprocess"] = {"tokens_per_s": _med(asyncio.run(_inprocess(model_dir, weights, repeats)))}
    return out


def table_rows(r: dict) -> list[tuple[str, ...]]:
    rows = []
    for key, label in (("servers_1", "remote, 1 server"), ("servers_2", "remote, 2 servers"),
                       ("inprocess", "in-process hf")):
        x = r.get(key, {})
        tps = x.get("tokens_per_s", {})
        rows.append((label, f"{tps.get('median', float('nan')):.0f}",
                     f"{x['fence_s']['median'] * 1000:.0f}" if x.get("fence_s") else "-",
                     f"{x['refit_s']['median'] * 1000:.0f}" if x.get("refit_s") else "-",
                     f"{x['bytes_per_token']:.0f}" if "bytes_per_token" in x else "-"))
    return rows


if __name__ == "__main__":
    print(json.dumps(remote_bench(repeats=3, quick=True, log=print), indent=2))

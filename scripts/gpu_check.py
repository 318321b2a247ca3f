"""GPU check: what a machine with one CUDA GPU can run, checked in a few minutes, offline.

    scripts/gpu_check.sh [--out DIR] [--only NAME,...] [--vllm-python PY] [--list]

Run it through scripts/gpu_check.sh (which picks the interpreter and sets PYTHONPATH);
docs/backends.md, "GPU check", says how to set up the two environments. Every check prints one line,
`PASS|FAIL|SKIP|INFO name: detail`; the last line counts them, and the exit status is 1
if any check FAILed (0 otherwise; SKIP and INFO do not fail the run). Results also go to
OUT/gpu_check.json, logs of the training runs to OUT/*.log.

Nothing is downloaded: the model is a tiny random GPT-2 built here (tokenizer from
tests/hf_fixture.py; head size 32, which vLLM's attention kernels need), with its final
layer norm scaled up so its distributions are peaked (a uniform-ish random model would
make every log-prob comparison below pass vacuously) and its EOS embedding zeroed so
completions rarely stop early.

Checks, in order (base: this interpreter; vllm: the interpreter that has vllm):
  base  cuda                    torch sees a CUDA device
  base  toy-kill-resume         the kill/resume machinery itself (toy engine, CPU)
  base  torch-kill-resume       engine.name=torch trainer.name=torch: SIGKILL, resume,
                                exactly-once (the built-in backend computes on the CPU
                                by design, also on this machine)
  base  hf-on-cuda              the hf engine and trainer both land on the GPU; the
                                engine's behaviour log-probs equal the trainer's
                                log_softmax(logits / T) for the same tokens (|d| <= 1e-4)
  base  hf-kill-resume          engine.name=hf trainer.name=hf on CUDA: SIGKILL, resume,
                                exactly-once
  vllm  vllm-logprobs           vllm (float32) behaviour log-probs at T = 0.7, top_p = 1
                                against the hf model's log_softmax(logits / 0.7) for the
                                same tokens: max |d| <= 0.02 and mean |d| <= 0.005 nats
                                (vLLM's Triton attention may compute in TF32); the
                                check must also discriminate (T = 1 values are far off)
  vllm  vllm-continuation       a prefix continued with the same seed reproduces the
                                completion on Model Runner V2 (INFO on the V1 runner)
  vllm  vllm-stale-cache        after update_weights, a repeated prompt's log-probs are
                                the new weights' (same tolerance)
  vllm  vllm-inflight-versions  an update lands while 8 completions run: every token
                                stamped with the old version matches the old weights'
                                log-probs, every token stamped with the new one does not
  vllm  vllm-stale-cache-control INFO: the same with the salt made constant, i.e. what
                                the bug would do (whether this vLLM reuses stale blocks)
  vllm  vllm-shutdown           close() gives the GPU memory back (within 1 GiB)
  vllm  vllm-kill-resume        `rollkeep train` engine.name=vllm trainer.name=hf:
                                SIGKILL, resume, exactly-once

A kill/resume check runs `python -m rollkeep train` in a subprocess, waits (reading
RUN_DIR/trace.jsonl) until a checkpoint is published and a later step committed, SIGKILLs
it, resumes it to the end, and checks exactly-once with `rollkeep.chaos.verify` (the
surviving lineage of `rollkeep.lineage`: each [epoch, idx] in one surviving step only;
the final checkpoint passes the restore chain and matches the lineage). If the run is
too fast to be caught, the kill is the crash point `ledger.step_committed:3` instead
(same SIGKILL, from inside), and the line says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT / "src"), str(ROOT / "tests")) if p not in sys.path]

DEVICE = "cuda"  # the CPU self-test (tests/test_gpu_check.py) sets "cpu"
TEMPERATURE = 0.7
LOGPROB_MAX, LOGPROB_MEAN = 0.02, 0.005  # vllm vs hf, float32 on both sides
HF_TOLERANCE = 1e-4  # hf engine vs hf trainer: the same model and kernels
PROMPTS = ["12+34=", "7+8=", "Hello, world: 1+1=", "what is 99+1? ", "abc def ghi jkl mno pqr stu vwx yz 12+3="]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog: 12+34=46, 5+6=11, 7+"  # > 2 KV blocks


class Skip(Exception):
    """The check cannot run here (what it needs is missing)."""


class Info(Exception):
    """The check ran and its outcome is reported, not judged."""


@dataclass
class Result:
    name: str
    status: str  # PASS | FAIL | SKIP | INFO
    detail: str


CHECKS: dict[str, tuple[str, Callable]] = {}


def check(name: str, group: str):
    def register(fn):
        CHECKS[name] = (group, fn)
        return fn

    return register


# ------------------------------------------------------------------------------ helpers


def build_model(path: Path, seed: int = 0) -> Path:
    """The tokenizer and a peaked tiny GPT-2 (head size 32) in `path` (see the docstring)."""
    import torch
    from hf_fixture import make_tiny_hf_model
    from transformers import AutoTokenizer, GPT2LMHeadModel

    if (path / "config.json").is_file():
        return path
    make_tiny_hf_model(path, n_embd=64, n_head=2, n_positions=128)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel.from_pretrained(path)
    peak(model, AutoTokenizer.from_pretrained(path).eos_token_id)
    model.save_pretrained(path, safe_serialization=True)
    return path


def peak(model, eos_id: int) -> None:
    import torch

    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(20.0)  # logits' std ~ 3 instead of ~ 0.2
        model.transformer.wte.weight[eos_id].zero_()  # tied head: EOS logit 0, rarely sampled


def other_weights(path: Path, seed: int) -> dict:
    """A state dict of the same architecture with other random (peaked) weights, on CUDA."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(AutoConfig.from_pretrained(path))
    peak(model, AutoTokenizer.from_pretrained(path).eos_token_id)
    return {k: v.to(DEVICE) for k, v in model.state_dict().items()}


class Reference:
    """Teacher-forced log_softmax(logits / T) of an hf model for given tokens (float32)."""

    def __init__(self, path: Path) -> None:
        from transformers import GPT2LMHeadModel

        self.model = GPT2LMHeadModel.from_pretrained(path).to(DEVICE).eval()

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state, strict=True)

    def __call__(self, prompt_ids, completion_ids, temperature: float = TEMPERATURE):
        import torch

        from rollkeep.trainers.grpo_loss import token_logprobs

        ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=DEVICE)
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits  # (1, L, V)
        p = len(prompt_ids)
        return token_logprobs(logits[:, p - 1 : -1], ids[:, p:], temperature)[0].cpu().numpy()


def request(text: str, seed: int, gid: str = "check"):
    from rollkeep.core.custody.keys import Key
    from rollkeep.core.rollout.source import Prompt
    from rollkeep.engines import GenRequest

    prompt = Prompt(key=Key(0, 0), group_id=gid, idx=0, task="default", row={}, row_fingerprint=0, prompt=text)
    return GenRequest(group_id=gid, generation=0, attempt=0, prompt=prompt, seed=seed, pinned_version=None)


def gaps(a, b) -> tuple[float, float]:
    import numpy as np

    d = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
    return (float(d.max()), float(d.mean())) if d.size else (0.0, 0.0)


def kill_and_resume(ctx: Context, name: str, overrides: list[str], *, timeout: float) -> str:
    """SIGKILL `rollkeep train` after a checkpoint and a later commit, resume it to the end,
    and check exactly-once from the trace and the final checkpoint. Returns the detail."""
    from rollkeep.chaos import ChaosReport, verify
    from rollkeep.config import load_config
    from rollkeep.trace import read_trace

    run_dir = ctx.out / name
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    empty = ctx.out / "empty.yaml"  # every key at its default (no file would mean arith.yaml)
    empty.write_text("{}\n")
    overrides = [*overrides, f"run_dir={run_dir}", "logger.progress=none"]
    cmd = [sys.executable, "-m", "rollkeep", "train", str(empty), *overrides]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("ROLLKEEP_CRASH_AT", None)
    trace = run_dir / "trace.jsonl"
    with open(ctx.out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        killed_at = _wait_for_kill_point(proc, trace, timeout)
        how = f"SIGKILL after step {killed_at}"
        if killed_at is not None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        if killed_at is None:  # too fast to catch from outside: the same SIGKILL from inside
            if proc.returncode != 0:
                raise AssertionError(f"the run failed (exit {proc.returncode}) before it could be killed; "
                                     f"see {log.name}")
            import shutil

            shutil.rmtree(run_dir)
            proc = subprocess.run(cmd, env=env | {"ROLLKEEP_CRASH_AT": "ledger.step_committed:3"},
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            how = "crash point ledger.step_committed:3 (too fast for an outside kill)"
        if proc.returncode != -signal.SIGKILL:
            raise AssertionError(f"the killed run ended with {proc.returncode}, expected SIGKILL; see {log.name}")
        resumed = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if resumed.returncode != 0:
        raise AssertionError(f"the resumed run failed (exit {resumed.returncode}); see {log.name}")
    cfg = load_config(str(empty), overrides)
    report = ChaosReport()
    verify(cfg, run_dir, report)
    runs = [x for x in read_trace(trace)[0] if x["event"] == "run_started"]
    problems = list(report.problems)
    if report.restarts != 1:
        problems.append(f"{report.restarts} restarts in the trace, expected 1")
    if report.steps != cfg.train.total_steps:
        problems.append(f"{report.steps} surviving steps, expected {cfg.train.total_steps}")
    if problems:
        raise AssertionError("; ".join(problems))
    return (f"{how}, resumed from step {runs[-1].get('resumed_from_step')}; {report.steps} steps, "
            f"{report.trained} prompts each trained once, {report.dropped} dropped, 0 duplicates")


def _wait_for_kill_point(proc, trace: Path, timeout: float) -> int | None:
    """The step at which to kill: once a checkpoint is published and a later step has
    committed (so the resume must redo committed work). None if the run ended first.
    A supervisor's poll of the trace, not a test's sleep."""
    from rollkeep.trace import read_trace

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None
        if trace.exists():
            lines, _ = read_trace(trace)
            published = [x["step"] for x in lines if x["event"] == "checkpoint_published"]
            if published:
                later = [x["step"] for x in lines if x["event"] == "step_committed" and x["step"] > published[0]]
                if later:
                    return later[-1]
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"no checkpoint and later commit within {timeout:.0f} s")


SMALL_RUN = [
    "data.generated.n_rows=256", "data.epochs=1", "rollout.group_size=4", "train.num_prompts_per_step=4",
    "checkpoint.every_steps=2", "checkpoint.keep_last=2", "eval.every_steps=0", "warmup.sft_steps=0",
]


@dataclass
class Context:
    out: Path
    vllm_python: str | None


# ------------------------------------------------------------------------------- checks


@check("cuda", "base")
def _cuda(ctx: Context) -> str:
    import torch

    if not torch.cuda.is_available():
        raise AssertionError(f"torch {torch.__version__} sees no CUDA device (a CPU build, or no GPU)")
    return f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}"


@check("toy-kill-resume", "base")
def _toy(ctx: Context) -> str:
    return kill_and_resume(ctx, "toy", [*SMALL_RUN, "engine.name=toy", "trainer.name=toy", "engine.latency_ms=2",
                                        "train.total_steps=30"], timeout=120)


@check("torch-kill-resume", "base")
def _torch(ctx: Context) -> str:
    return kill_and_resume(ctx, "torch", [
        *SMALL_RUN, "engine.name=torch", "trainer.name=torch", "engine.max_new_tokens=4",
        "trainer.model.n_layer=1", "trainer.model.n_embd=64", "trainer.model.n_head=2",
        "trainer.model.block_size=32", "train.total_steps=30",
    ], timeout=300) + " (CPU compute: the built-in backend does not use CUDA)"


def _need_cuda() -> None:
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise Skip("no CUDA device")


def _free_memory() -> int:
    """Free bytes on the GPU (0 in the CPU self-test)."""
    import torch

    if DEVICE != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@check("hf-on-cuda", "base")
def _hf_on_cuda(ctx: Context) -> str:
    _need_cuda()
    import numpy as np
    import torch

    from rollkeep.config import load_config
    from rollkeep.engines.hf import HFEngine
    from rollkeep.trainers.hf import HFTrainer

    path = build_model(ctx.out / "model-base")
    cfg = load_config(None, ["engine.name=hf", f"engine.model_path={path}", "trainer.name=hf",
                             f"trainer.model_path={path}"])
    trainer = HFTrainer(cfg.trainer, temperature=TEMPERATURE, seed=0)
    engine = HFEngine(model_path=str(path), temperature=TEMPERATURE, top_p=1.0, max_new_tokens=12,
                      chat_template=False, max_batch_size=8)
    devices = (engine.device.type, trainer.device.type)
    if devices != (DEVICE, DEVICE):
        raise AssertionError(f"engine on {devices[0]}, trainer on {devices[1]}; expected both on {DEVICE}")

    async def body():
        try:
            await engine.update_weights(trainer.weights(), 1)  # CUDA -> CUDA weight sync
            return await asyncio.gather(*(engine.generate(request(p, seed=i)) for i, p in enumerate(PROMPTS)))
        finally:
            await engine.close()

    completions = asyncio.run(body())
    worst = 0.0
    trainer.model.eval()
    from rollkeep.trainers.grpo_loss import token_logprobs

    for c in completions:
        ids = torch.tensor([c.prompt_ids.tolist() + c.completion_ids.tolist()], device=DEVICE)
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits
        p = len(c.prompt_ids)
        ref = token_logprobs(logits[:, p - 1 : -1], ids[:, p:], TEMPERATURE)[0].cpu().numpy()
        worst = max(worst, gaps(c.logprobs, ref)[0])
        if c.versions.tolist() != [1] * len(c.versions):
            raise AssertionError(f"versions {c.versions.tolist()}, expected all 1")
    if worst > HF_TOLERANCE:
        raise AssertionError(f"engine vs trainer log-probs differ by up to {worst:.2e} (> {HF_TOLERANCE})")
    n = int(np.sum([len(c.completion_ids) for c in completions]))
    return f"engine and trainer on {DEVICE}; {n} tokens, max |engine - trainer| log-prob {worst:.1e}"


@check("hf-kill-resume", "base")
def _hf(ctx: Context) -> str:
    _need_cuda()
    path = build_model(ctx.out / "model-base")
    return kill_and_resume(ctx, "hf", [
        *SMALL_RUN, "engine.name=hf", f"engine.model_path={path}", "engine.max_new_tokens=4",
        "trainer.name=hf", f"trainer.model_path={path}", "trainer.lr=1e-3", "train.total_steps=12",
    ], timeout=400) + f" (engine and trainer on {DEVICE})"


class VLLMSession:
    """One vllm engine (float32, so it can be compared with the hf model) shared by the
    vllm engine checks, which run in order."""

    def __init__(self, ctx: Context) -> None:
        from rollkeep.engines.vllm import VLLMEngine

        self.path = build_model(ctx.out / "model-vllm")
        self.ref = Reference(self.path)
        self.w0 = {k: v.detach().clone() for k, v in self.ref.model.state_dict().items()}
        self.w1 = other_weights(self.path, seed=1)
        self.free_before = _free_memory()
        self.engine = VLLMEngine(model_path=str(self.path), temperature=TEMPERATURE, top_p=1.0, max_new_tokens=48,
                                 gpu_memory_utilization=0.25, tensor_parallel_size=1, dtype="float32")
        self.loop = asyncio.new_event_loop()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def generate(self, text: str, seed: int, **kw):
        return self.run(self.engine.generate(request(text, seed), **kw))


_session: VLLMSession | None = None


def _vllm(ctx: Context) -> VLLMSession:
    global _session
    if _session is None:
        _need_cuda()
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise Skip(f"vllm is not installed in {sys.executable} ({e})") from e
        _session = VLLMSession(ctx)
    return _session


@check("vllm-logprobs", "vllm")
def _vllm_logprobs(ctx: Context) -> str:
    s = _vllm(ctx)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(s.path)
    worst, means, raw, n = 0.0, [], 0.0, 0
    for i, text in enumerate(PROMPTS):
        c = s.generate(text, seed=100 + i)
        if c.prompt_ids.tolist() != tok.encode(text, add_special_tokens=True):
            raise AssertionError(f"vllm's prompt ids for {text!r} differ from the hf tokenizer's")
        ref = s.ref(c.prompt_ids, c.completion_ids)
        big, mean = gaps(c.logprobs, ref)
        worst, n = max(worst, big), n + len(ref)
        means.append(mean)
        raw = max(raw, gaps(c.logprobs, s.ref(c.prompt_ids, c.completion_ids, 1.0))[0])
    mean = sum(means) / len(means)
    detail = (f"{n} tokens at T={TEMPERATURE}: max |vllm - hf| {worst:.2e}, mean {mean:.2e} "
              f"(tolerance {LOGPROB_MAX}, {LOGPROB_MEAN}); against T=1 values: max {raw:.2f}; "
              f"vllm {s.engine.vllm_version}, weights via {s.engine.weight_loading}")
    if worst > LOGPROB_MAX or mean > LOGPROB_MEAN:
        raise AssertionError(detail)
    if raw < 5 * LOGPROB_MAX:
        raise AssertionError("inconclusive: the model's T=0.7 and T=1 log-probs are too close; " + detail)
    return detail


@check("vllm-continuation", "vllm")
def _vllm_continuation(ctx: Context) -> str:
    s = _vllm(ctx)
    from rollkeep.engines.vllm import Prefix

    full = s.generate(PROMPTS[0], seed=7)
    k = min(8, len(full.completion_ids) - 1)
    cut = Prefix(full.completion_ids[:k].tolist(), full.logprobs[:k].tolist(), full.versions[:k].tolist())
    cont = s.generate(PROMPTS[0], seed=7, prefix=cut)
    a, b = full.completion_ids.tolist(), cont.completion_ids.tolist()
    same = sum(x == y for x, y in zip(a, b, strict=False))
    detail = (f"prefix of {k}, {len(a)} tokens: {'identical' if a == b else f'{same} of {len(a)} equal'}; "
              f"runner {'V2' if s.engine.continuation_token_identical else 'V1'}")
    if not s.engine.continuation_token_identical:
        raise Info(detail + " (the V1 runner restarts its random stream: not expected to match)")
    if a != b:
        raise AssertionError(detail)
    return detail


@check("vllm-stale-cache", "vllm")
def _vllm_stale_cache(ctx: Context) -> str:
    s = _vllm(ctx)
    before = s.generate(LONG_PROMPT, seed=3)  # its prompt blocks are now in the prefix cache
    s.run(s.engine.update_weights(s.w1, 1))
    after = s.generate(LONG_PROMPT, seed=3)
    s.ref.load(s.w1)
    big, mean = gaps(after.logprobs, s.ref(after.prompt_ids, after.completion_ids))
    s.ref.load(s.w0)
    old = gaps(after.logprobs, s.ref(after.prompt_ids, after.completion_ids))[0]
    s.ref.load(s.w1)
    detail = (f"{len(after.prompt_ids)}-token prompt, {len(after.completion_ids)} tokens after the update: "
              f"max |vllm - new weights| {big:.2e}, mean {mean:.2e}; |vllm - old weights| max {old:.2f}")
    if after.versions.tolist() != [1] * len(after.versions) or before.versions.max() != 0:
        raise AssertionError("wrong versions; " + detail)
    if big > LOGPROB_MAX or mean > LOGPROB_MEAN or old < 5 * LOGPROB_MAX:
        raise AssertionError(detail)
    return detail


@check("vllm-inflight-versions", "vllm")
def _vllm_inflight(ctx: Context) -> str:
    s = _vllm(ctx)
    # The engine holds w1 at version 1 (vllm-stale-cache); load it if that check was skipped.
    if s.engine.version != 1:
        s.run(s.engine.update_weights(s.w1, 1))
    s.ref.load(s.w1)

    async def body():
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        counts: dict[int, int] = {}

        def on_delta(i):
            def seen(d):
                counts[i] = counts.get(i, 0) + len(d.token_ids)
                if counts[i] >= 8:
                    loop.call_soon_threadsafe(started.set)
            return seen

        tasks = [asyncio.create_task(s.engine.generate(request(PROMPTS[i % len(PROMPTS)], seed=50 + i, gid=f"f{i}"),
                                                       on_delta=on_delta(i))) for i in range(8)]
        await started.wait()
        await s.engine.update_weights(s.w0, 2)
        return await asyncio.gather(*tasks)

    completions = s.run(body())
    old_gap, new_gap, mixed = 0.0, 0.0, 0
    for c in completions:
        v = c.versions.tolist()
        if v != sorted(v) or not set(v) <= {1, 2}:
            raise AssertionError(f"versions {v}")
        ref = s.ref(c.prompt_ids, c.completion_ids)  # the version-1 weights, all the way
        old = [i for i, x in enumerate(v) if x == 1]
        new = [i for i, x in enumerate(v) if x == 2]
        mixed += bool(old and new)
        if old:
            old_gap = max(old_gap, gaps(c.logprobs[old], ref[old])[0])
        if new:
            new_gap = max(new_gap, gaps(c.logprobs[new], ref[new])[0])
    detail = (f"{mixed} of 8 completions span the update; tokens stamped 1: max |vllm - version-1 weights| "
              f"{old_gap:.2e}; tokens stamped 2: max {new_gap:.2f} (must be far off)")
    if not mixed:
        raise AssertionError("inconclusive: no completion spans the update; " + detail)
    if old_gap > LOGPROB_MAX or new_gap < 5 * LOGPROB_MAX:
        raise AssertionError(detail)
    return detail


@check("vllm-stale-cache-control", "vllm")
def _vllm_stale_cache_control(ctx: Context) -> str:
    """INFO: the stale-cache bug itself, with the per-version salt replaced by a constant."""
    s = _vllm(ctx)
    from rollkeep.engines import vllm as engine_module

    salted = engine_module.prompt_kwargs
    engine_module.prompt_kwargs = lambda p, x, v: {**salted(p, x, v), "cache_salt": "constant"}
    try:
        v = s.engine.version
        s.run(s.engine.update_weights(s.w0, v + 1))
        s.generate(LONG_PROMPT + " ", seed=4)  # its prompt blocks cached under w0
        s.run(s.engine.update_weights(s.w1, v + 2))
        after = s.generate(LONG_PROMPT + " ", seed=4)
    finally:
        engine_module.prompt_kwargs = salted
    s.ref.load(s.w1)
    big = gaps(after.logprobs, s.ref(after.prompt_ids, after.completion_ids))[0]
    seen = "vLLM reused KV blocks of the old weights" if big > LOGPROB_MAX else "no stale reuse seen"
    raise Info(f"without the version salt: max |vllm - new weights| {big:.2e} ({seen})")


@check("vllm-shutdown", "vllm")
def _vllm_shutdown(ctx: Context) -> str:
    s = _vllm(ctx)
    close_session()
    held = (s.free_before - _free_memory()) / 2**30
    detail = f"after close() the GPU holds {held:.2f} GiB more than before the engine was built"
    if held > 1.0:
        raise AssertionError(detail)
    return detail


def close_session() -> None:
    global _session
    if _session is not None:
        s, _session = _session, None
        s.run(s.engine.close())
        s.loop.close()
        del s.engine
        import gc

        gc.collect()


@check("vllm-kill-resume", "vllm")
def _vllm_train(ctx: Context) -> str:
    _need_cuda()
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise Skip(f"vllm is not installed in {sys.executable}") from e
    path = build_model(ctx.out / "model-vllm")
    return kill_and_resume(ctx, "vllm", [
        *SMALL_RUN, "engine.name=vllm", f"engine.model_path={path}", "engine.max_new_tokens=4",
        "engine.gpu_memory_utilization=0.3", "trainer.name=hf", f"trainer.model_path={path}",
        "trainer.lr=1e-3", "train.total_steps=12",
    ], timeout=480)


# --------------------------------------------------------------------------------- main


def run_checks(ctx: Context, names: list[str]) -> list[Result]:
    results = []
    for name in names:
        _, fn = CHECKS[name]
        t0 = time.monotonic()
        try:
            status, detail = "PASS", fn(ctx)
        except Skip as e:
            status, detail = "SKIP", str(e)
        except Info as e:
            status, detail = "INFO", str(e)
        except Exception as e:
            status, detail = "FAIL", f"{type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
        results.append(Result(name, status, f"{detail} [{time.monotonic() - t0:.0f} s]"))
        print(f"{status} {name}: {results[-1].detail}", flush=True)
    return results


def find_vllm_python(given: str | None) -> str | None:
    """The interpreter for the vllm checks: --vllm-python, $VLLM_PYTHON, this one if it
    imports vllm, or ROOT/.venv-vllm/bin/python."""
    import importlib.util

    if given or os.environ.get("VLLM_PYTHON"):
        return given or os.environ["VLLM_PYTHON"]
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    candidate = ROOT / ".venv-vllm" / "bin" / "python"
    return str(candidate) if candidate.exists() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu_check"), help="where models, runs and logs go")
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--vllm-python", default=None, help="interpreter with vllm installed (default: see docs/backends.md)")
    ap.add_argument("--group", choices=("all", "base", "vllm"), default="all", help=argparse.SUPPRESS)
    ap.add_argument("--list", action="store_true", help="list the checks and exit")
    args = ap.parse_args(argv)
    if args.list:
        for name, (group, _) in CHECKS.items():
            print(f"{group:5} {name}")
        return 0
    wanted = [n for n in args.only.split(",") if n] or list(CHECKS)
    unknown = [n for n in wanted if n not in CHECKS]
    if unknown:
        print(f"unknown check(s) {unknown}; --list shows them", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out, find_vllm_python(args.vllm_python))
    groups = ("base", "vllm") if args.group == "all" else (args.group,)
    results: list[Result] = []
    for group in groups:
        names = [n for n, (g, _) in CHECKS.items() if g == group and n in wanted]  # in order
        if not names:
            continue
        if group == "base" or args.group == "vllm" or ctx.vllm_python == sys.executable:
            try:
                results += run_checks(ctx, names)
            finally:
                close_session()
        elif ctx.vllm_python is None:
            for n in names:
                results.append(Result(n, "SKIP", "no interpreter with vllm (--vllm-python, $VLLM_PYTHON, .venv-vllm)"))
                print(f"SKIP {n}: {results[-1].detail}", flush=True)
        else:  # the vllm environment brings its own torch: run the vllm checks there
            sub = out / "vllm-results.json"
            sub.unlink(missing_ok=True)
            code = subprocess.run([ctx.vllm_python, __file__, "--group", "vllm", "--out", str(out),
                                   "--only", ",".join(names), "--vllm-python", ctx.vllm_python]).returncode
            if sub.exists():
                results += [Result(**r) for r in json.loads(sub.read_text())]
            else:
                results.append(Result("vllm", "FAIL", f"{ctx.vllm_python} exited {code} without results"))
                print(f"FAIL vllm: {results[-1].detail}", flush=True)
    if args.group == "vllm":
        (out / "vllm-results.json").write_text(json.dumps([r.__dict__ for r in results], indent=1))
        return int(any(r.status == "FAIL" for r in results))
    (out / "gpu_check.json").write_text(json.dumps([r.__dict__ for r in results], indent=1))
    counts = {k: sum(r.status == k for r in results) for k in ("PASS", "FAIL", "SKIP", "INFO")}
    print(f"gpu_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped, "
          f"{counts['INFO']} info", flush=True)
    return int(counts["FAIL"] > 0)


if __name__ == "__main__":
    sys.exit(main())

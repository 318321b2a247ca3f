"""GPU check: what a machine with one CUDA GPU can run, checked in a few minutes, offline.

    scripts/gpu_check.sh [--out DIR] [--only NAME,...] [--vllm-python PY] [--budget-s S] [--list]

Run it through scripts/gpu_check.sh (which picks the interpreter and sets PYTHONPATH);
docs/backends.md, "GPU check", says how to set up the two environments. Every check prints one line,
`PASS|FAIL|SKIP|INFO name: detail`; the last line counts them, and the exit status is 1
if any check FAILed (0 otherwise; SKIP and INFO do not fail the run). Results also go to
OUT/gpu_check.json, logs of the training runs to OUT/*.log. The whole run is bounded by
--budget-s (600 s): every check's waits are cut to what is left, and a check that finds
the budget spent FAILs without running.

In bf16, as users run: the fixture checkpoints are saved in bfloat16 (as Qwen and Llama
ship), the hf trainer keeps float32 master weights (`trainer.dtype`, its default), and the
engines hold them in bfloat16 (`engine.dtype`). Every engine log-prob is compared with a
float32 reference of the same weights -- the trainer's view, the side of the PPO ratio
the engine's log-probs meet -- so the tolerances below are bf16's (`LOGPROB_MAX`).

Nothing is downloaded: the model is a tiny random GPT-2 built here (tokenizer from
tests/hf_fixture.py; head size 32, which vLLM's attention kernels need), with its final
layer norm scaled up so its distributions are peaked (a uniform-ish random model would
make every log-prob comparison below pass vacuously), its attention's values and output
projection scaled up so the next token depends on the context (with the residual
dominating, a random GPT-2 predicts mostly its current token, ignores its KV cache, and
a stale cache would change nothing a check can see), and its EOS embedding zeroed so
completions rarely stop early.

Checks, in order (base: this interpreter; vllm: the interpreter that has vllm):
  base  cuda                    torch sees a CUDA device
  base  toy-kill-resume         the kill/resume machinery itself (toy engine, CPU)
  base  torch-kill-resume       engine.name=torch trainer.name=torch: SIGKILL, resume,
                                exactly-once (the built-in backend computes on the CPU
                                by design, also on this machine)
  base  hf-on-cuda              the hf engine (bf16) and trainer (float32 master weights
                                of the bf16 checkpoint) both land on the GPU; the engine's
                                behaviour log-probs match the trainer's
                                log_softmax(logits / T) for the same tokens (bf16 tolerance)
  base  hf-kill-resume          engine.name=hf trainer.name=hf on CUDA: SIGKILL, resume,
                                exactly-once
  vllm  vllm-logprobs           vllm (bf16) behaviour log-probs at T = 0.7, top_p = 1
                                against the float32 hf model's log_softmax(logits / 0.7)
                                for the same tokens: max |d| <= 0.3 and mean |d| <= 0.01
                                nats (the bf16 gap that enters the PPO ratio, reported);
                                the check must also discriminate (T = 1 values fail it)
  vllm  vllm-continuation       a prefix continued with the same seed reproduces the
                                completion on Model Runner V2 (INFO on the V1 runner)
  vllm  vllm-stale-cache        after update_weights, a repeated prompt's log-probs are
                                the new weights' (same tolerance)
  vllm  vllm-inflight-versions  an update (to inverted weights) lands while 8
                                completions run: every token stamped with the old version
                                matches the old weights' log-probs, and in most completions
                                that span the update the FIRST token stamped with the new
                                one is far from them (async scheduling would stamp a token
                                the old weights sampled with the new version: that token)
  vllm  vllm-stale-cache-control the same with the salt made constant, i.e. what the bug
                                would do: vLLM must reuse the stale blocks (else the check
                                above proved nothing, and this one FAILs as inconclusive)
  vllm  vllm-shutdown           close() gives the GPU memory back (within 1 GiB)
  vllm  vllm-kill-resume        `rollkeep train` engine.name=vllm trainer.name=hf:
                                SIGKILL, resume, exactly-once; then the rows the resumed
                                run sampled under the restored version match the
                                restored checkpoint's weights (float32 hf at the run's
                                temperature) and not engine.model_path's

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

DEVICE = "cuda"  # the CPU self-test (tests/engines/test_gpu_check.py) sets "cpu"
ENGINE_DTYPE = "bfloat16"  # engine.dtype, as users run; the references are float32
TEMPERATURE = 0.7
# Engine (bf16) against the float32 reference of the same weights. bf16 keeps 8 bits of
# mantissa, so every activation and every published weight is rounded by up to 2^-9
# relative; at T = 0.7 that moves a log-prob by hundredths of a nat, more where the top
# logits nearly tie. Measured with this model, hf in bf16 against float32 on the CPU
# (1,920 tokens, weights not bf16-representable): max 0.15, mean 0.002, 99th percentile
# 0.04. vLLM's bf16 kernels (flash attention, fused norms) round otherwise: 2x on the max,
# 5x on the mean. (With float32 on both sides these were 0.02 and 0.005.)
LOGPROB_MAX, LOGPROB_MEAN = 0.3, 0.01
FAR = 1.0  # nats: a token sampled under other weights (the inverted ones: many nats off)
STALE_SEEN = 5 * LOGPROB_MAX  # a gap from the new weights' log-probs that only stale KV explains
MIN_SPANNING = 4  # of the 8 in-flight completions, at least this many must span the update
MOST = 0.75  # the share of those whose first new-version token must be far from the old weights
STARTUP_S = 240  # one vLLM start-up (torch.compile and CUDA graphs, cold): 1-2 min on an H200
CALL_S = 60  # one generate or update of the vLLM session (tiny model: well under a second)
BUDGET_S = 600  # the whole check, on one GPU
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
    """The tokenizer and a peaked tiny GPT-2 (head size 32) in `path`, saved in bfloat16
    (see the docstring)."""
    import torch
    from hf_fixture import make_tiny_hf_model
    from transformers import AutoTokenizer, GPT2LMHeadModel

    if (path / "config.json").is_file():
        return path
    make_tiny_hf_model(path, n_embd=64, n_head=2, n_positions=128)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32)
    peak(model, AutoTokenizer.from_pretrained(path).eos_token_id)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def peak(model, eos_id: int) -> None:
    import torch

    with torch.no_grad():
        model.transformer.ln_f.weight.fill_(20.0)  # logits' std ~ 3 instead of ~ 0.2
        model.transformer.wte.weight[eos_id].zero_()  # tied head: EOS logit 0, rarely sampled
        n = model.config.n_embd
        for block in model.transformer.h:  # the context matters: 3x the values, 3x the output
            block.attn.c_attn.weight[:, 2 * n :] *= 3.0  # (Conv1D: [in, q | k | v])
            block.attn.c_proj.weight *= 3.0


def other_weights(path: Path, seed: int) -> dict:
    """A float32 state dict of the same architecture with other random (peaked) weights,
    on DEVICE: as the trainer's master weights would be (not bf16-representable)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(AutoConfig.from_pretrained(path)).float()
    peak(model, AutoTokenizer.from_pretrained(path).eos_token_id)
    return {k: v.to(DEVICE) for k, v in model.state_dict().items()}


def inverted_weights(state: dict) -> dict:
    """`state` with the final layer norm negated, so its logits are the negated logits of
    `state` for the same context (the blocks, and so the KV cache, are unchanged): a token
    it samples is one `state` finds least likely, many nats off `state`'s log-prob."""
    inverted = {k: v.clone() for k, v in state.items()}
    for name in ("transformer.ln_f.weight", "transformer.ln_f.bias"):
        inverted[name].neg_()
    return inverted


class Reference:
    """Teacher-forced log_softmax(logits / T) of an hf model for given tokens, in float32
    (the trainer's master weights; the checkpoint's bf16 values, exactly, until loaded)."""

    def __init__(self, path: Path) -> None:
        import torch
        from transformers import GPT2LMHeadModel

        self.model = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state, strict=True)

    def load_trainer_file(self, path: Path) -> None:
        """Weights from a checkpoint's trainer/model.safetensors (each storage once: the tied
        head is left out there and follows the embedding here)."""
        from safetensors.torch import load_file

        missing, unexpected = self.model.load_state_dict(load_file(path, device=DEVICE), strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise AssertionError(f"{path} does not fit the model: missing {missing}, unexpected {unexpected}")

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


def kill_and_resume(ctx: Context, name: str, overrides: list[str], *, timeout: float,
                    after: Callable | None = None) -> str:
    """SIGKILL `rollkeep train` after a checkpoint and a later commit, resume it to the end,
    and check exactly-once from the trace and the final checkpoint. Each wait takes at most
    `timeout` s (less when the budget is nearly spent). `after(run_dir, cfg, started,
    segments)` then checks the resumed run further, given its `run_started` event and the
    row-log segments that existed before it (a detail to append). Returns the detail."""
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
        killed_at = _wait_for_kill_point(proc, trace, ctx.left(timeout))
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
                                  stdout=log, stderr=subprocess.STDOUT, timeout=ctx.left(timeout))
            how = "crash point ledger.step_committed:3 (too fast for an outside kill)"
        if proc.returncode != -signal.SIGKILL:
            raise AssertionError(f"the killed run ended with {proc.returncode}, expected SIGKILL; see {log.name}")
        before = row_segments(run_dir)
        resumed = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=ctx.left(timeout))
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
    detail = (f"{how}, resumed from step {runs[-1].get('resumed_from_step')}; {report.steps} steps, "
              f"{report.trained} prompts each trained once, {report.dropped} dropped, 0 duplicates")
    return detail if after is None else f"{detail}; {after(run_dir, cfg, runs[-1], before)}"


def row_segments(run_dir: Path) -> set[int]:
    """The numbers of the row-log segments in RUN_DIR/rows."""
    from rollkeep.core.rowlog.segments import ROWS_DIR, segments

    rows = run_dir / ROWS_DIR
    return {n for n, _ in segments(rows)} if rows.is_dir() else set()


def rows_sealed_since(run_dir: Path, before: set[int]) -> list:
    """Every row in the segments not in `before`: those a later process sealed (a writer
    never appends to an existing segment, `rollkeep.core.rowlog.writer` 3.). A torn tail
    (a frame cut short) ends a segment's rows."""
    from rollkeep.core.rowlog.segments import FRAME_HEADER, ROWS_DIR, _row_of, segment_path

    rows = []
    for n in sorted(row_segments(run_dir) - before):
        data = segment_path(run_dir / ROWS_DIR, n).read_bytes()
        at, first = 0, True
        while at + FRAME_HEADER.size <= len(data):
            length, _ = FRAME_HEADER.unpack_from(data, at)
            payload = data[at + FRAME_HEADER.size : at + FRAME_HEADER.size + length]
            if len(payload) < length:
                break
            if not first:  # (frame 0 is the segment's header)
                rows.append(_row_of(payload)[1])
            at, first = at + FRAME_HEADER.size + length, False
    return rows


def check_restored_generation(run_dir: Path, cfg, started: dict, before: set[int]) -> str:
    """After a resume (`kill_and_resume`'s `after`): does the resumed engine generate with
    the weights of the restored lineage? The rows the resumed run sealed, each sampled
    wholly under one version v that has a checkpoint of that lineage (the restored one,
    step s, or one the resumed run published), are scored by float32 hf models at the run's
    temperature with that checkpoint's trainer weights, and with engine.model_path's (what
    an engine that missed its refits would have sampled with). Rows under the restored
    version itself are rare: the groups the killed process admitted are generated no
    earlier than the version they were admitted under (`recovery.lost_versions`), so most
    rows after a resume come from the next versions, whose weights the trainer derived
    from the restored ones."""
    import numpy as np

    from rollkeep.core.checkpoint.cut import TRAINER_DIR
    from rollkeep.trace import read_trace

    step, name = started.get("resumed_from_step"), started.get("checkpoint")
    if step is None or name is None:
        raise AssertionError(f"the resumed run restored no checkpoint (run_started: {started})")
    names = {step: name} | {x["step"]: x["name"] for x in read_trace(run_dir / "trace.jsonl")[0]
                            if x["event"] == "checkpoint_published" and x.get("run_id") == started.get("run_id")}
    rows = [r for r in rows_sealed_since(run_dir, before)
            if len(r.versions) and int(r.versions[0]) in names and bool(np.all(r.versions == r.versions[0]))]
    initial, by_version = Reference(Path(cfg.engine.model_path)), {}
    t, engine, ref, ini = cfg.engine.temperature, [], [], []
    for r in rows:
        v = int(r.versions[0])
        if v not in by_version:
            by_version[v] = Reference(Path(cfg.engine.model_path))
            by_version[v].load_trainer_file(run_dir / "checkpoints" / names[v] / TRAINER_DIR / "model.safetensors")
        engine.append(r.logprobs)
        ref.append(by_version[v](r.prompt_ids.tolist(), r.completion_ids.tolist(), t))
        ini.append(initial(r.prompt_ids.tolist(), r.completion_ids.tolist(), t))
    flat = (lambda xs: np.concatenate(xs)) if rows else (lambda xs: np.zeros(0))
    detail = restored_generation_verdict(gaps(flat(engine), flat(ref)), gaps(flat(engine), flat(ini))[0],
                                         len(rows), len(flat(engine)))
    return f"{detail} (versions {sorted(by_version)}; restored: {step})"


def restored_generation_verdict(gaps_restored: tuple[float, float], gap_initial: float, n_rows: int,
                                n_tokens: int) -> str:
    """Judge whether the resumed engine generated with the restored weights: its behaviour
    log-probs of the rows sampled under the restored version against the restored
    checkpoint's weights (within the bf16 tolerance), and far from engine.model_path's,
    which an engine that missed its refit would have sampled with."""
    big, mean = gaps_restored
    detail = (f"{n_rows} rows ({n_tokens} tokens) sampled after the resume under checkpointed versions: "
              f"max |engine - those checkpoints' weights| {big:.2e}, mean {mean:.2e}; |engine - engine.model_path's| "
              f"max {gap_initial:.2f}")
    if not n_rows:
        raise AssertionError("inconclusive: the resumed run sealed no row sampled wholly under a version it "
                             "has a checkpoint of; " + detail)
    if big > LOGPROB_MAX or mean > LOGPROB_MEAN:
        raise AssertionError("the resumed engine does not generate with the restored weights; " + detail)
    if gap_initial < FAR:
        raise AssertionError("inconclusive: the restored weights are too close to engine.model_path's; " + detail)
    return detail


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
# For `check_restored_generation`: a warm start moves the weights away from engine.model_path's
# (RL on a random model may not: with every reward 0 every advantage is 0), so an engine
# that missed the refit after the resume is told apart; and the restored checkpoint is kept.
RESTORED_WEIGHTS_VISIBLE = ["warmup.sft_steps=4", "checkpoint.keep_last=100"]


@dataclass
class Context:
    out: Path
    vllm_python: str | None
    deadline: float = float("inf")  # time.time() by which every check must be done

    def left(self, at_most: float) -> float:
        """Seconds a wait may take: `at_most`, cut to what is left of the budget."""
        left = self.deadline - time.time()
        if left <= 0:
            raise AssertionError("the time budget (--budget-s) is spent")
        return min(at_most, left)


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
                                        "train.total_steps=30"], timeout=60)


@check("torch-kill-resume", "base")
def _torch(ctx: Context) -> str:
    return kill_and_resume(ctx, "torch", [
        *SMALL_RUN, "engine.name=torch", "trainer.name=torch", "engine.max_new_tokens=4",
        "trainer.model.n_layer=1", "trainer.model.n_embd=64", "trainer.model.n_head=2",
        "trainer.model.block_size=32", "train.total_steps=30",
    ], timeout=120) + " (CPU compute: the built-in backend does not use CUDA)"


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
                             f"trainer.model_path={path}", f"engine.dtype={ENGINE_DTYPE}"])
    trainer = HFTrainer(cfg.trainer, temperature=TEMPERATURE, seed=0)
    engine = HFEngine(model_path=str(path), temperature=TEMPERATURE, top_p=1.0, max_new_tokens=12,
                      chat_template=False, max_batch_size=8, dtype=cfg.engine.dtype)
    devices = (engine.device.type, trainer.device.type)
    if devices != (DEVICE, DEVICE):
        raise AssertionError(f"engine on {devices[0]}, trainer on {devices[1]}; expected both on {DEVICE}")
    dtypes = ({p.dtype for p in engine.model.parameters()}, {p.dtype for p in trainer.model.parameters()})
    if dtypes != ({getattr(torch, ENGINE_DTYPE)}, {torch.float32}):
        raise AssertionError(f"engine weights in {dtypes[0]}, trainer's in {dtypes[1]} (a bf16 checkpoint); "
                             f"expected {ENGINE_DTYPE} and float32 master weights (trainer.dtype)")

    async def body():
        try:
            await engine.update_weights(trainer.weights(), 1)  # CUDA -> CUDA weight sync
            return await asyncio.gather(*(engine.generate(request(p, seed=i)) for i, p in enumerate(PROMPTS)))
        finally:
            await engine.close()

    completions = asyncio.run(body())
    worst, means = 0.0, []
    trainer.model.eval()
    from rollkeep.trainers.grpo_loss import token_logprobs

    for c in completions:
        ids = torch.tensor([c.prompt_ids.tolist() + c.completion_ids.tolist()], device=DEVICE)
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits
        p = len(c.prompt_ids)
        ref = token_logprobs(logits[:, p - 1 : -1], ids[:, p:], TEMPERATURE)[0].cpu().numpy()
        big, mean = gaps(c.logprobs, ref)
        worst, means = max(worst, big), [*means, mean]
        if c.versions.tolist() != [1] * len(c.versions):
            raise AssertionError(f"versions {c.versions.tolist()}, expected all 1")
    mean = float(np.mean(means))
    detail = (f"engine ({ENGINE_DTYPE}) and trainer (float32) on {DEVICE}; "
              f"{int(np.sum([len(c.completion_ids) for c in completions]))} tokens, |engine - trainer| log-prob "
              f"max {worst:.1e}, mean {mean:.1e} (tolerance {LOGPROB_MAX}, {LOGPROB_MEAN})")
    if worst > LOGPROB_MAX or mean > LOGPROB_MEAN:
        raise AssertionError(detail)
    return detail


@check("hf-kill-resume", "base")
def _hf(ctx: Context) -> str:
    _need_cuda()
    path = build_model(ctx.out / "model-base")
    return kill_and_resume(ctx, "hf", [
        *SMALL_RUN, "engine.name=hf", f"engine.model_path={path}", "engine.max_new_tokens=4",
        f"engine.dtype={ENGINE_DTYPE}", "trainer.name=hf", f"trainer.model_path={path}", "trainer.lr=1e-3",
        "train.total_steps=12", *RESTORED_WEIGHTS_VISIBLE,
    ], timeout=150, after=check_restored_generation) + f" (engine and trainer on {DEVICE})"


class VLLMSession:
    """One vllm engine (bf16, as users run it; compared with float32 hf references) shared
    by the vllm engine checks, which run in order. Its start-up and every call are bounded
    (`STARTUP_S`, `CALL_S`, and the budget), so a hung vLLM fails a check, not the run."""

    def __init__(self, ctx: Context) -> None:
        import threading

        from rollkeep.engines.vllm import VLLMEngine

        self.ctx = ctx
        self.path = build_model(ctx.out / "model-vllm")
        self.ref = Reference(self.path)
        self.w0 = {k: v.detach().clone() for k, v in self.ref.model.state_dict().items()}
        self.w1 = other_weights(self.path, seed=1)
        self.inverted = inverted_weights(self.w1)
        self.free_before = _free_memory()
        built: dict = {}

        def start() -> None:
            try:
                built["engine"] = VLLMEngine(
                    model_path=str(self.path), temperature=TEMPERATURE, top_p=1.0, max_new_tokens=48,
                    gpu_memory_utilization=0.25, tensor_parallel_size=1, dtype=ENGINE_DTYPE)
            except BaseException as e:
                built["error"] = e

        starter = threading.Thread(target=start, name="gpu-check-vllm-start", daemon=True)
        starter.start()
        limit = ctx.left(STARTUP_S)
        starter.join(limit)
        if starter.is_alive():
            raise AssertionError(f"vLLM did not start within {limit:.0f} s")
        if "error" in built:
            raise built["error"]
        self.engine = built["engine"]
        self.loop = asyncio.new_event_loop()

    def run(self, coro):
        return self.loop.run_until_complete(asyncio.wait_for(coro, self.ctx.left(CALL_S)))

    def generate(self, text: str, seed: int, **kw):
        return self.run(self.engine.generate(request(text, seed), **kw))


_session: VLLMSession | None = None
_session_failed: str | None = None  # why the session did not start: later checks fail at once


def _vllm(ctx: Context) -> VLLMSession:
    global _session, _session_failed
    if _session is None:
        if _session_failed is not None:
            raise AssertionError(f"the vllm session did not start: {_session_failed}")
        _need_cuda()
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise Skip(f"vllm is not installed in {sys.executable} ({e})") from e
        try:
            _session = VLLMSession(ctx)
        except Exception as e:
            _session_failed = f"{type(e).__name__}: {e}"[:300]
            raise
    return _session


@check("vllm-logprobs", "vllm")
def _vllm_logprobs(ctx: Context) -> str:
    s = _vllm(ctx)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(s.path)
    worst, means, raw, raw_means, n = 0.0, [], 0.0, [], 0
    for i, text in enumerate(PROMPTS):
        c = s.generate(text, seed=100 + i)
        if c.prompt_ids.tolist() != tok.encode(text, add_special_tokens=True):
            raise AssertionError(f"vllm's prompt ids for {text!r} differ from the hf tokenizer's")
        ref = s.ref(c.prompt_ids, c.completion_ids)
        big, mean = gaps(c.logprobs, ref)
        worst, n = max(worst, big), n + len(ref)
        means.append(mean)
        raw_big, raw_mean = gaps(c.logprobs, s.ref(c.prompt_ids, c.completion_ids, 1.0))
        raw, raw_means = max(raw, raw_big), [*raw_means, raw_mean]
    mean = sum(means) / len(means)
    raw_mean = sum(raw_means) / len(raw_means)
    detail = (f"{n} tokens at T={TEMPERATURE}: max |vllm ({ENGINE_DTYPE}) - hf (float32)| {worst:.2e}, mean "
              f"{mean:.2e} (tolerance {LOGPROB_MAX}, {LOGPROB_MEAN}); against T=1 values: max {raw:.2f}, mean "
              f"{raw_mean:.3f}; vllm {s.engine.vllm_version}, weights via {s.engine.weight_loading}")
    if worst > LOGPROB_MAX or mean > LOGPROB_MEAN:
        raise AssertionError(detail)
    if raw < 2 * LOGPROB_MAX and raw_mean < 2 * LOGPROB_MEAN:  # T=1 values would have passed
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
        await s.engine.update_weights(s.inverted, 2)  # every token it samples is far off w1's
        return await asyncio.gather(*tasks)

    completions = s.run(body())
    # (versions, vllm's log-probs, the version-1 weights' log-probs all the way)
    return inflight_verdict([(c.versions.tolist(), c.logprobs, s.ref(c.prompt_ids, c.completion_ids))
                             for c in completions], old=1, new=2)


def inflight_verdict(completions: list, *, old: int, new: int) -> str:
    """Judge `vllm-inflight-versions` from (versions, engine log-probs, version-`old`
    reference log-probs) per completion; raises AssertionError, else returns the detail.

    Every token stamped `old` must match the reference. Under async scheduling the defect
    is the first token stamped `new` of each completion having been sampled under `old`
    (the step that returned it was already queued): its log-prob then matches the `old`
    reference although every later token is far from it. So in most completions that span
    the update (MOST, of at least MIN_SPANNING) that first token itself must be far off."""
    import numpy as np

    old_gap, spanning, first_far, new_gap = 0.0, 0, 0, 0.0
    for v, lp, ref in completions:
        if v != sorted(v) or not set(v) <= {old, new}:
            raise AssertionError(f"versions {v}: expected {old}s, then {new}s")
        olds = [i for i, x in enumerate(v) if x == old]
        news = [i for i, x in enumerate(v) if x == new]
        lp, ref = np.asarray(lp, np.float64), np.asarray(ref, np.float64)
        if olds:
            old_gap = max(old_gap, gaps(lp[olds], ref[olds])[0])
        if news:
            new_gap = max(new_gap, gaps(lp[news], ref[news])[0])
        if olds and news:
            spanning += 1
            first_far += bool(abs(lp[news[0]] - ref[news[0]]) >= FAR)
    detail = (f"{spanning} of {len(completions)} completions span the update; tokens stamped {old}: max "
              f"|vllm - version-{old} weights| {old_gap:.2e} (tolerance {LOGPROB_MAX}); the first token "
              f"stamped {new} is >= {FAR} nats off in {first_far} of {spanning}; tokens stamped {new}: max "
              f"{new_gap:.2f}")
    if spanning < MIN_SPANNING:
        raise AssertionError(f"inconclusive: fewer than {MIN_SPANNING} completions span the update; " + detail)
    if old_gap > LOGPROB_MAX:
        raise AssertionError(f"a token stamped {old} was not sampled by the version-{old} weights; " + detail)
    if first_far < MOST * spanning:
        raise AssertionError(f"the first token stamped {new} was sampled under version {old} (async "
                             "scheduling's mis-stamp); " + detail)
    return detail


@check("vllm-stale-cache-control", "vllm")
def _vllm_stale_cache_control(ctx: Context) -> str:
    """The stale-cache bug itself, with the per-version salt replaced by a constant: it
    must show, or `vllm-stale-cache` proved nothing."""
    s = _vllm(ctx)
    from rollkeep.engines import vllm as engine_module

    salted = engine_module.engine_input
    engine_module.engine_input = lambda p, x, v: {**salted(p, x, v), "cache_salt": "constant"}
    try:
        v = s.engine.version
        s.run(s.engine.update_weights(s.w0, v + 1))
        s.generate(LONG_PROMPT + " ", seed=4)  # its prompt blocks cached under w0
        s.run(s.engine.update_weights(s.w1, v + 2))
        after = s.generate(LONG_PROMPT + " ", seed=4)
    finally:
        engine_module.engine_input = salted
    s.ref.load(s.w1)
    return stale_control_verdict(gaps(after.logprobs, s.ref(after.prompt_ids, after.completion_ids))[0])


def stale_control_verdict(big: float) -> str:
    """Judge `vllm-stale-cache-control` from max |vllm - new weights| without the salt."""
    detail = f"without the version salt: max |vllm - new weights| {big:.2f}"
    if big <= STALE_SEEN:
        raise AssertionError(f"inconclusive: the prefix cache was never exercised ({detail} <= {STALE_SEEN}: no "
                             "stale reuse seen, so vllm-stale-cache proves nothing here)")
    return f"{detail}: vLLM reused KV blocks of the old weights, which the per-version salt prevents"


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
    # Eager: two vLLM start-ups (the run and its resume) without compiling or capturing
    # CUDA graphs; what this check is about does not depend on them.
    return kill_and_resume(ctx, "vllm", [
        *SMALL_RUN, "engine.name=vllm", f"engine.model_path={path}", "engine.max_new_tokens=4",
        "engine.gpu_memory_utilization=0.3", f"engine.dtype={ENGINE_DTYPE}", "engine.enforce_eager=true",
        "trainer.name=hf", f"trainer.model_path={path}", "trainer.lr=1e-3", "train.total_steps=12",
        *RESTORED_WEIGHTS_VISIBLE,
    ], timeout=240, after=check_restored_generation)


# --------------------------------------------------------------------------------- main


def run_checks(ctx: Context, names: list[str]) -> list[Result]:
    results = []
    for name in names:
        _, fn = CHECKS[name]
        t0 = time.monotonic()
        try:
            if time.time() >= ctx.deadline:
                raise AssertionError("not run: the time budget (--budget-s) is spent")
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
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds the whole check may take (600)")
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # for the vllm group
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
    ctx = Context(out, find_vllm_python(args.vllm_python),
                  args.deadline if args.deadline is not None else time.time() + args.budget_s)
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
            try:  # (its checks keep to the deadline; this bounds a vLLM that hangs its exit)
                code = subprocess.run([ctx.vllm_python, __file__, "--group", "vllm", "--out", str(out),
                                       "--only", ",".join(names), "--vllm-python", ctx.vllm_python,
                                       "--deadline", repr(ctx.deadline)],
                                      timeout=max(1.0, ctx.deadline - time.time()) + 60).returncode
            except subprocess.TimeoutExpired:
                code = "nothing (killed past the time budget)"
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

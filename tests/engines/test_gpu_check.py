"""scripts/gpu_check.py, run on the CPU: the kill/resume machinery for real, and every vllm
engine check against a fake vllm backed by the hf model, so the script that will first run
on a lent GPU has at least run its own logic and thresholds once.

The fake samples like Model Runner V2 (randomness keyed by seed and absolute position) from
the real model, in the engine's dtype (bf16), and stamps versions exactly. It keeps a
prefix cache as vLLM's: the full 16-token blocks of a prompt, keyed by the request's
cache salt and the tokens, remember the weights they were computed under, and a later
prompt that hits them attends to keys and values computed under those weights. So the
checks must PASS against it, the salt-less control included (it sees the stale reuse)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import fake_vllm
import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gpu_check(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DEVICE", "cpu")
    return module


BLOCK = 16  # vLLM's default KV block size


class ModelEngine(fake_vllm.FakeEngine):
    """The fake engine, sampling from the hf model in the model directory (see above).
    With `lag` set, a reload while requests run takes effect one step late, as under async
    scheduling (the next batch was already queued): the mis-stamp vllm-inflight-versions
    exists to catch."""

    lag = False

    def __init__(self, args: dict) -> None:
        import inspect

        from transformers import AutoTokenizer, GPT2LMHeadModel

        super().__init__(args)
        self.tok = AutoTokenizer.from_pretrained(args["model"])
        dtype = self.model_config.dtype
        self.hf = GPT2LMHeadModel.from_pretrained(args["model"], dtype=dtype).eval()
        self.old = GPT2LMHeadModel.from_pretrained(args["model"], dtype=dtype).eval()  # a cached block's weights
        self.model_config.max_model_len = self.hf.config.n_positions
        self.model_config.hf_text_config = self.hf.config  # tie_word_embeddings: True (GPT-2)
        self.cache_arg = "cache" if "cache" in inspect.signature(self.hf.forward).parameters else "past_key_values"
        self.snapshots = [{k: v.clone() for k, v in self.hf.state_dict().items()}]  # weights per reload
        self.old_holds: int | None = None
        self.blocks: dict[tuple, int] = {}  # (salt, prompt prefix of whole blocks) -> snapshot
        self.hits: dict[str, tuple[int, int]] = {}  # request -> (cached tokens, their snapshot)
        self.generated: dict[str, list[int]] = {}
        self.pending: dict | None = None  # a reload the lag holds back for one step

    def get_tokenizer(self):
        return self.tok

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpc.append((method, kwargs))
        weights = dict(kwargs["weights_iterator"])
        # a tied model: the head comes with the embedding's values (`tied_reload`)
        assert torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])
        self.hf.load_state_dict(weights, strict=True)
        self.snapshots.append({k: v.clone() for k, v in self.hf.state_dict().items()})
        if ModelEngine.lag and self.live:  # the step already queued still runs the old weights
            self.pending = self.snapshots.pop()
            self.hf.load_state_dict(self.snapshots[-1])
        return [None]

    def add_request(self, request_id, prompt, params):
        rid = super().add_request(request_id, prompt, params)
        ids, salt = prompt["prompt_token_ids"], prompt.get("cache_salt")
        whole = (len(ids) - 1) // BLOCK  # vLLM computes at least the last prompt token
        hit = next((k for k in range(whole, 0, -1) if (salt, tuple(ids[: k * BLOCK])) in self.blocks), 0)
        if hit:
            self.hits[rid] = (hit * BLOCK, self.blocks[(salt, tuple(ids[: hit * BLOCK]))])
        for k in range(1, whole + 1):  # blocks computed now are cached under the weights of now
            self.blocks.setdefault((salt, tuple(ids[: k * BLOCK])), len(self.snapshots) - 1)
        return rid

    def logits(self, rid, ids):
        n, snapshot = self.hits.get(rid, (0, len(self.snapshots) - 1))
        with torch.no_grad():
            if snapshot == len(self.snapshots) - 1:
                return self.hf(input_ids=torch.tensor([ids])).logits[:, -1, :].float()
            if self.old_holds != snapshot:
                self.old.load_state_dict(self.snapshots[snapshot])
                self.old_holds = snapshot
            stale = self.old(input_ids=torch.tensor([ids[:n]]), use_cache=True)[self.cache_arg]
            return self.hf(input_ids=torch.tensor([ids[n:]]), **{self.cache_arg: stale}).logits[:, -1, :].float()

    def step(self):
        from rollkeep.models.sampling import sample

        outs = []
        for rid, r in list(self.live.items()):
            done = self.generated.setdefault(rid, [])
            ids = list(r.prompt["prompt_token_ids"]) + done
            logits = self.logits(rid, ids)
            tok, lp = sample(logits, [r.params.seed], len(ids), temperature=r.params.temperature, top_p=1.0)
            tok, lp = int(tok[0]), float(lp[0])
            done.append(tok)
            r.sent += 1
            reason = "stop" if tok == self.tok.eos_token_id else "length" if r.sent >= r.params.max_tokens else None
            outs.append(fake_vllm.RequestOutput(rid, list(r.prompt["prompt_token_ids"]), [fake_vllm.CompletionOutput(
                0, self.tok.decode([tok]), [tok], [{tok: fake_vllm.Logprob(lp)}], reason)], reason is not None))
            if reason is not None:
                del self.live[rid]
        if self.pending is not None:  # the step the lag let through under the old weights is done
            self.hf.load_state_dict(self.pending)
            self.snapshots.append(self.pending)
            self.pending = None
        return outs


@pytest.mark.slow
def test_the_kill_resume_check_passes_with_the_toy_engine(gpu_check, tmp_path, capsys):
    assert gpu_check.main(["--only", "toy-kill-resume", "--out", str(tmp_path)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("PASS toy-kill-resume:") and "0 duplicates" in line


def test_the_cuda_check_fails_without_a_gpu(gpu_check, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--only", "cuda", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().out.startswith("FAIL cuda:")


@pytest.mark.slow
def test_the_hf_checks_pass_on_the_cpu(gpu_check, tmp_path, capsys):
    assert gpu_check.main(["--only", "hf-on-cuda", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("PASS hf-on-cuda: engine (bfloat16) and trainer (float32) on cpu")


@pytest.mark.slow
def test_the_hf_kill_resume_check_passes_on_the_cpu_and_checks_the_resumed_generation(gpu_check, tmp_path, capsys):
    """bf16 checkpoint, float32 master weights, a bf16 engine: SIGKILL, resume, and the rows
    sampled after the resume match the checkpoints' weights, not engine.model_path's."""
    assert gpu_check.main(["--only", "hf-kill-resume", "--out", str(tmp_path)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("PASS hf-kill-resume:") and "0 duplicates" in line
    assert "sampled after the resume under checkpointed versions" in line


@pytest.mark.slow
def test_the_vllm_engine_checks_pass_against_a_faithful_fake(gpu_check, tmp_path, monkeypatch, capsys):
    fake_vllm.install(monkeypatch)
    monkeypatch.setattr(sys.modules["vllm"], "LLMEngine", ModelEngine)
    names = ["vllm-logprobs", "vllm-continuation", "vllm-stale-cache", "vllm-inflight-versions",
             "vllm-stale-cache-control", "vllm-shutdown"]
    ctx = gpu_check.Context(tmp_path, sys.executable)
    try:
        results = gpu_check.run_checks(ctx, names)
    finally:
        gpu_check.close_session()
    status = {r.name: (r.status, r.detail) for r in results}
    for name in names:
        assert status[name][0] == "PASS", status[name]
    assert "vLLM reused KV blocks of the old weights" in status["vllm-stale-cache-control"][1]
    assert "identical; runner V2" in status["vllm-continuation"][1]


@pytest.mark.slow
def test_the_inflight_check_fails_on_the_async_scheduling_mis_stamp(gpu_check, tmp_path, monkeypatch):
    """With the reload taking effect a step late, the first token stamped with the new
    version was sampled under the old one: the check must FAIL, and say so."""
    fake_vllm.install(monkeypatch)
    monkeypatch.setattr(sys.modules["vllm"], "LLMEngine", ModelEngine)
    monkeypatch.setattr(ModelEngine, "lag", True)
    try:
        [result] = gpu_check.run_checks(gpu_check.Context(tmp_path, sys.executable), ["vllm-inflight-versions"])
    finally:
        gpu_check.close_session()
    assert result.status == "FAIL" and "sampled under version 1 (async scheduling's mis-stamp)" in result.detail


# ------------------------------------------------------------- the checks' verdicts, pinned


def spanning(n: int, *, first_stamp_wrong: bool, old_error: float = 0.01):
    """n completions of 6 tokens, 3 stamped 1 then 3 stamped 2, with the version-1 reference.
    Tokens stamped 2 are 4 nats off it, except the first one when `first_stamp_wrong` (then
    it was sampled under version 1: async scheduling's mis-stamp)."""
    import numpy as np

    out = []
    for _ in range(n):
        ref = np.full(6, -0.5)
        lp = ref + np.array([old_error, -old_error, 0.0, 4.0, 4.0, 4.0])
        if first_stamp_wrong:
            lp[3] = ref[3]
        out.append(([1, 1, 1, 2, 2, 2], lp, ref))
    return out


def test_inflight_regression_the_first_new_version_token_sampled_under_the_old_fails(gpu_check):
    """The old criterion (max over all tokens stamped 2) passed this; the new one does not."""
    assert "in 8 of 8" in gpu_check.inflight_verdict(spanning(8, first_stamp_wrong=False), old=1, new=2)
    with pytest.raises(AssertionError, match="sampled under version 1"):
        gpu_check.inflight_verdict(spanning(8, first_stamp_wrong=True), old=1, new=2)
    with pytest.raises(AssertionError, match="sampled under version 1"):  # most, not one, must be far off
        gpu_check.inflight_verdict(spanning(2, first_stamp_wrong=False) + spanning(6, first_stamp_wrong=True),
                                   old=1, new=2)


def test_inflight_verdict_refuses_old_tokens_off_and_too_few_spanning(gpu_check):
    with pytest.raises(AssertionError, match="not sampled by the version-1 weights"):
        gpu_check.inflight_verdict(spanning(8, first_stamp_wrong=False, old_error=1.0), old=1, new=2)
    with pytest.raises(AssertionError, match="inconclusive: fewer than 4"):
        gpu_check.inflight_verdict(spanning(3, first_stamp_wrong=False), old=1, new=2)
    with pytest.raises(AssertionError, match="versions"):
        gpu_check.inflight_verdict([([2, 1], [0, 0], [0, 0])], old=1, new=2)


def test_stale_control_without_stale_reuse_is_an_inconclusive_failure(gpu_check):
    with pytest.raises(AssertionError, match="inconclusive: the prefix cache was never exercised"):
        gpu_check.stale_control_verdict(0.05)
    assert "reused KV blocks of the old weights" in gpu_check.stale_control_verdict(9.0)


def test_restored_generation_verdict(gpu_check):
    assert "3 rows" in gpu_check.restored_generation_verdict((0.1, 0.002), 5.0, 3, 12)
    with pytest.raises(AssertionError, match="does not generate with the restored weights"):
        gpu_check.restored_generation_verdict((2.0, 0.5), 5.0, 3, 12)
    with pytest.raises(AssertionError, match="too close to engine.model_path's"):
        gpu_check.restored_generation_verdict((0.1, 0.002), 0.2, 3, 12)
    with pytest.raises(AssertionError, match="no row sampled wholly under a version"):
        gpu_check.restored_generation_verdict((0.0, 0.0), 0.0, 0, 0)


def test_a_check_past_the_budget_fails_without_running(gpu_check, tmp_path):
    ran = []
    gpu_check.CHECKS["probe"] = ("base", lambda ctx: ran.append(1) or "ran")
    try:
        results = gpu_check.run_checks(gpu_check.Context(tmp_path, None, deadline=0.0), ["probe"])
    finally:
        del gpu_check.CHECKS["probe"]
    assert ran == [] and results[0].status == "FAIL" and "budget" in results[0].detail

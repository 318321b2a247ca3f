"""scripts/gpu_check.py, run on the CPU: the kill/resume machinery for real, and every vllm
engine check against a fake vllm backed by the hf model, so the script that will first run
on a lent GPU has at least run its own logic and thresholds once.

The fake samples like Model Runner V2 (randomness keyed by seed and absolute position) from
the real model without a KV cache, so it has no stale cache and stamps versions exactly:
the checks must PASS against it (and the salt-less control must see no stale reuse)."""

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


class ModelEngine(fake_vllm.FakeEngine):
    """The fake engine, sampling from the hf model in the model directory."""

    def __init__(self, args: dict) -> None:
        from transformers import AutoTokenizer, GPT2LMHeadModel

        super().__init__(args)
        self.tok = AutoTokenizer.from_pretrained(args["model"])
        self.hf = GPT2LMHeadModel.from_pretrained(args["model"]).eval()
        self.model_config.max_model_len = self.hf.config.n_positions
        self.generated: dict[str, list[int]] = {}

    def get_tokenizer(self):
        return self.tok

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpc.append((method, kwargs))
        self.hf.load_state_dict(dict(kwargs["weights_iterator"]), strict=True)
        return [None]

    def step(self):
        from rollkeep.models.sampling import sample

        outs = []
        for rid, r in list(self.live.items()):
            done = self.generated.setdefault(rid, [])
            ids = list(r.prompt["prompt_token_ids"]) + done
            with torch.no_grad():
                logits = self.hf(input_ids=torch.tensor([ids])).logits[:, -1, :]
            tok, lp = sample(logits, [r.params.seed], len(ids), temperature=r.params.temperature, top_p=1.0)
            tok, lp = int(tok[0]), float(lp[0])
            done.append(tok)
            r.sent += 1
            reason = "stop" if tok == self.tok.eos_token_id else "length" if r.sent >= r.params.max_tokens else None
            outs.append(fake_vllm.RequestOutput(rid, list(r.prompt["prompt_token_ids"]), [fake_vllm.CompletionOutput(
                0, self.tok.decode([tok]), [tok], [{tok: fake_vllm.Logprob(lp)}], reason)], reason is not None))
            if reason is not None:
                del self.live[rid]
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
    assert capsys.readouterr().out.startswith("PASS hf-on-cuda: engine and trainer on cpu")


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
    for name in names[:4] + names[5:]:
        assert status[name][0] == "PASS", status[name]
    assert status["vllm-stale-cache-control"][0] == "INFO"
    assert "no stale reuse seen" in status["vllm-stale-cache-control"][1]
    assert "identical; runner V2" in status["vllm-continuation"][1]

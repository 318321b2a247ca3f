"""rollkeep's CPU AdamW: torch.optim.AdamW's arithmetic bit for bit, without importing
torch._dynamo (the ~1 s that every restart used to pay for it)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rollkeep.trainers.adamw import AdamW, make_adamw


def params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 5, generator=g).requires_grad_(),
            torch.randn(5, generator=g).requires_grad_(),
            torch.randn(3, 4, 2, generator=g).requires_grad_()]


def grads(ps: list[torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(ps):
        p.grad = None if (step + i) % 5 == 4 else torch.randn(p.shape, generator=g)  # some steps skip a param


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("lr", [1e-3, 3e-2])
def test_adamw_matches_torch_bit_for_bit(lr: float, weight_decay: float) -> None:
    ours_p, torch_p = params(0), params(0)
    ours = AdamW(ours_p, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    ref = torch.optim.AdamW(torch_p, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    for step in range(40):
        grads(ours_p, step)
        grads(torch_p, step)
        ours.step()
        ref.step()
        ours.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        for a, b in zip(ours_p, torch_p, strict=True):
            assert torch.equal(a, b), step
    sa, sb = ours.state_dict(), ref.state_dict()
    assert sa["param_groups"] == sb["param_groups"]  # the same recorded hyper-parameters
    assert sa["state"].keys() == sb["state"].keys()
    for i in sb["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k, v in sb["state"][i].items():
            assert v.dtype == sa["state"][i][k].dtype and torch.equal(v, sa["state"][i][k]), (i, k)


def test_adamw_state_loads_across_implementations() -> None:
    # A state written by torch's AdamW continues in ours (and back) with the same bits.
    a_p, b_p = params(1), params(1)
    ref = torch.optim.AdamW(a_p, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(5):
        grads(a_p, step)
        ref.step()
    with torch.no_grad():
        for a, b in zip(a_p, b_p, strict=True):
            b.copy_(a)
    ours = AdamW(b_p, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    ours.load_state_dict({"state": {i: {k: v.clone() for k, v in s.items()}
                                    for i, s in ref.state_dict()["state"].items()},
                          "param_groups": ref.state_dict()["param_groups"]})
    for step in range(5, 12):
        grads(a_p, step)
        grads(b_p, step)
        ref.step()
        ours.step()
    assert all(torch.equal(a, b) for a, b in zip(a_p, b_p, strict=True))
    back = torch.optim.AdamW(params(2), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    back.load_state_dict(ours.state_dict())
    assert torch.equal(back.state_dict()["state"][0]["exp_avg"], ours.state[b_p[0]]["exp_avg"])


def test_make_adamw_picks_ours_on_cpu() -> None:
    assert isinstance(make_adamw(params(0), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0), AdamW)
    with pytest.raises(ValueError, match="empty"):
        AdamW([], lr=1e-3)


def test_training_the_builtin_gpt_never_imports_dynamo() -> None:
    # Build, warm-start step, RL step, checkpoint round trip: torch._dynamo stays unloaded.
    code = """
import sys
from rollkeep.config import TorchModelConfig, TorchTrainerConfig
from rollkeep.models.gpt import GPT, GPTConfig
from rollkeep.models.tokenizer import CharTokenizer
from rollkeep.trainers.grpo import TorchTrainer
tok = CharTokenizer()
cfg = TorchTrainerConfig(model=TorchModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
m = cfg.model
model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32, block_size=16))
tr = TorchTrainer(cfg, model=model, tokenizer=tok, temperature=1.0, seed=0)
tr.sft_step([(tok.encode("1+2="), tok.encode("3", bos=False) + [tok.eos_id])], lr=1e-3)
import tempfile, pathlib
d = pathlib.Path(tempfile.mkdtemp())
tr.snapshot().save(d)
tr.load(d)
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

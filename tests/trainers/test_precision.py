"""Master weights (`trainer.dtype`, hf trainer) on a checkpoint saved in bfloat16, as Qwen and
Llama ship: float32 by default, so an update at a pretrained model's learning rate is kept
rather than rounded away; and a checkpoint of float32 master weights resumes byte-identical."""

from __future__ import annotations

import json

import pytest
import torch
from test_grpo import group, row

from rollkeep.trainers import Batch, make_trainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_fixture import make_tiny_hf_model
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_model(tmp_path_factory.mktemp("bf16") / "model")
    conf = json.loads((path / "config.json").read_text())
    conf.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    (path / "config.json").write_text(json.dumps(conf))
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def hf(path, **kw):
    from rollkeep.config import HFTrainerConfig

    cfg = HFTrainerConfig(model_path=str(path), micro_batch_size=4, **kw)
    return make_trainer(cfg, temperature=1.0, seed=0, max_completion_length=8)


def batch(step: int) -> Batch:
    return Batch(step, tuple(group(f"e{step}.{g}", [row([4, 5 + g], [6 + k, 7, 2], [-1.0, -2.0, -0.5], float(k % 2))
                                                    for k in range(3)], (1.0, -1.0, 0.5)) for g in range(2)))


def changed(trainer, before: dict) -> dict[str, tuple[int, int]]:
    """Per parameter, (elements the step changed, elements with a gradient), in the master dtype."""
    return {name: (int(((p.detach() != before[name]) & (p.grad != 0)).sum()), int((p.grad != 0).sum()))
            for name, p in trainer.model.named_parameters()}


def share(counts: dict[str, tuple[int, int]], names=None) -> float:
    names = counts if names is None else names
    return sum(counts[n][0] for n in names) / sum(counts[n][1] for n in names)


def test_float32_master_weights_keep_the_updates_bf16_ones_lose(bf16_checkpoint) -> None:
    """One AdamW step at the hf trainer's lr (1e-5) moves every weight with a gradient by
    about 1e-5: float32 master weights keep all of it; bf16 ones keep it only where that is at least half a bf16
    spacing (weights near 0), so none of the layer norms' weights (near 1, spacing 2^-7)
    move."""
    fp32, bf16 = hf(bf16_checkpoint), hf(bf16_checkpoint, dtype="bfloat16")
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}  # not transformers' "auto"
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    shares = []
    for trainer in (fp32, bf16):
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        trainer.train_step(batch(1))
        shares.append(changed(trainer, before))
    kept, lost = shares
    norms = [n for n in kept if ".ln_" in n and n.endswith("weight")]
    assert norms and share(kept, norms) > 0.99 and share(lost, norms) == 0.0
    assert share(kept) > 0.99 and share(lost) < 0.5


def test_float32_master_weights_resume_byte_identical(bf16_checkpoint, tmp_path) -> None:
    a = hf(bf16_checkpoint)
    a.train_step(batch(1))
    a.snapshot().save(tmp_path)
    b = hf(bf16_checkpoint)
    b.load(tmp_path, step=1)
    assert b.weights_sha256() == a.weights_sha256()
    a.train_step(batch(2))
    b.train_step(batch(2))
    assert b.weights_sha256() == a.weights_sha256()
    assert {p.dtype for p in b.model.parameters()} == {torch.float32}

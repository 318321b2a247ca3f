"""`engine.dtype` (rollkeep.engines.dtypes): how `auto` resolves, the hf engine holding its
weights in that dtype while the trainer's float32 weights are published to it, and the
cast before weights travel to a Ray replica."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from rollkeep.config import load_config
from rollkeep.engines import make_engine
from rollkeep.engines.dtypes import cast_weights, checkpoint_dtype, transfer_dtype

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """The tiny GPT-2, saved in bfloat16 (as Qwen and Llama ship)."""
    from hf_fixture import make_tiny_hf_model
    from transformers import GPT2LMHeadModel

    path = make_tiny_hf_model(tmp_path_factory.mktemp("bf16"))
    GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory):
    from hf_fixture import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("fp32"))


def request():
    from rollkeep.core.custody.keys import Key
    from rollkeep.core.rollout.source import Prompt
    from rollkeep.engines import GenRequest

    prompt = Prompt(key=Key(0, 0), group_id="g", idx=0, task="default", row={}, row_fingerprint=0, prompt="1+2=")
    return GenRequest(group_id="g", generation=0, attempt=0, prompt=prompt, seed=3, pinned_version=None)


def hf_section(path, *extra):
    return load_config(None, ["engine.name=hf", f"engine.model_path={path}", "trainer.name=hf",
                              f"trainer.model_path={path}", *extra]).engine


def test_checkpoint_dtype_reads_config_json(tmp_path, bf16_model, fp32_model):
    assert checkpoint_dtype(bf16_model) == "bfloat16" and checkpoint_dtype(fp32_model) == "float32"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))  # transformers 4's key
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "int8"}))
    assert checkpoint_dtype(tmp_path) is None
    assert checkpoint_dtype(tmp_path / "nowhere") is None


@pytest.mark.parametrize("extra, want", [((), torch.bfloat16), (("engine.dtype=float32",), torch.float32)])
def test_the_hf_engine_holds_its_weights_in_engine_dtype(bf16_model, extra, want):
    """`auto` is the checkpoint's dtype (bf16 here); float32 master weights published to a
    bf16 engine land rounded to bf16, and it generates from them."""
    from transformers import GPT2LMHeadModel

    eng = make_engine(hf_section(bf16_model, *extra))
    trainer = GPT2LMHeadModel.from_pretrained(bf16_model, dtype=torch.float32)
    with torch.no_grad():
        for p in trainer.parameters():  # (each once: the head is tied to the embedding)
            p.add_(1e-3 * torch.randn_like(p))  # not bf16-representable any more
    master = trainer.state_dict()

    async def body():
        await eng.update_weights(master, 1)
        return await eng.generate(request())

    try:
        c = asyncio.run(body())
    finally:
        asyncio.run(eng.close())
    assert {p.dtype for p in eng.model.parameters()} == {want}
    wte = eng.model.transformer.wte.weight
    assert torch.equal(wte.float().cpu(), master["transformer.wte.weight"].to(want).float())
    assert c.versions.tolist() == [1] * len(c.versions) and (c.logprobs <= 0).all()


def test_a_deterministic_run_samples_the_hf_engine_in_float64(fp32_model):
    """The run's context (`dtype: float64`) takes the place of `engine.dtype: auto`."""
    eng = make_engine(hf_section(fp32_model), dtype=torch.float64)
    asyncio.run(eng.close())
    assert {p.dtype for p in eng.model.parameters()} == {torch.float64}


def test_transfer_dtype_is_the_16_bit_dtype_known_before_the_engine_starts(bf16_model, fp32_model):
    assert transfer_dtype(hf_section(fp32_model, "engine.dtype=bfloat16"), {}) is torch.bfloat16
    assert transfer_dtype(hf_section(bf16_model), {}) is torch.bfloat16  # auto: the checkpoint's
    assert transfer_dtype(hf_section(fp32_model), {}) is None  # auto on a float32 checkpoint
    assert transfer_dtype(hf_section(fp32_model, "engine.dtype=float32"), {}) is None
    assert transfer_dtype(hf_section(bf16_model), {"dtype": torch.float64}) is None  # deterministic
    assert transfer_dtype(SimpleNamespace(name="toy"), {}) is None


def test_cast_weights_keeps_ties_and_leaves_the_rest():
    shared = torch.randn(3)
    out = cast_weights({"a": shared, "b": shared, "c": shared.clone(), "i": torch.arange(2), "f": 1.5},
                       torch.bfloat16)
    assert out["a"] is out["b"] and out["c"] is not out["a"] and torch.equal(out["c"], out["a"])
    assert out["i"].dtype == torch.int64 and out["f"] == 1.5
    weights = {"a": shared}
    assert cast_weights(weights, None) is weights and cast_weights("digest", torch.bfloat16) == "digest"

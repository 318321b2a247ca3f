"""The vllm engine: its guards run everywhere; the GPU smoke test needs vllm and CUDA."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import types

import pytest

from rollkeep.core.errors import UserInputError
from rollkeep.core.keys import Key
from rollkeep.core.source import Prompt
from rollkeep.engines import GenRequest
from rollkeep.engines.vllm import VLLMEngine

ARGS = dict(model_path="unused", temperature=1.0, top_p=1.0, max_new_tokens=8,
            gpu_memory_utilization=0.2, tensor_parallel_size=1)


def _vllm_on_cuda() -> bool:
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.fixture
def env(monkeypatch):
    # The engine sets VLLM_ENABLE_V1_MULTIPROCESSING unless set; undo that after each test.
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return monkeypatch


def test_without_vllm_construction_names_the_install_remedy(env):
    env.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(UserInputError, match=r"pip install 'rollkeep\[vllm\]' on a machine with a CUDA GPU"):
        VLLMEngine(**ARGS)


def test_without_cuda_construction_names_the_install_remedy(env):
    import torch

    env.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    env.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserInputError, match="needs a CUDA GPU") as e:
        VLLMEngine(**ARGS)
    assert "rollkeep[vllm]" in e.value.remedy


@pytest.mark.parametrize("overrides, message", [
    (dict(model_path="/no/such/model"), "/no/such/model"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size 1 only"),
])
def test_bad_settings_are_refused_before_vllm_starts(env, tmp_path, overrides, message):
    import torch

    env.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # has no LLMEngine: must not be reached
    env.setattr(torch.cuda, "is_available", lambda: True)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserInputError, match=message):
        VLLMEngine(**(ARGS | {"model_path": str(tmp_path)} | overrides))


@pytest.mark.gpu
@pytest.mark.skipif(not _vllm_on_cuda(), reason="needs vllm and a CUDA device")
def test_gpu_smoke_generate_and_update_weights(tmp_path):
    import torch
    from hf_fixture import make_tiny_hf_model
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir = make_tiny_hf_model(tmp_path / "model")
    eng = VLLMEngine(**(ARGS | {"model_path": str(model_dir)}))
    torch.manual_seed(1)
    new = GPT2LMHeadModel(GPT2Config.from_pretrained(model_dir)).state_dict()  # other random weights

    def request(seed):
        prompt = Prompt(key=Key(0, 0), group_id="g", idx=0, task="default", row={}, row_fingerprint=0,
                        prompt="12+34=")
        return GenRequest(group_id="g", generation=0, attempt=0, prompt=prompt, seed=seed, version=None)

    async def body():
        try:
            a = await eng.generate(request(7))
            b = await eng.generate(request(7))
            await eng.update_weights(new, 2)
            c = await eng.generate(request(7))
            return a, b, c
        finally:
            await eng.close()

    a, b, c = asyncio.run(body())
    assert 1 <= len(a.completion_ids) <= 8 and (a.logprobs <= 0).all()
    assert a.completion_ids.tolist() == b.completion_ids.tolist()
    assert a.versions.tolist() == [0] * len(a.versions)
    assert eng.version == 2 and c.versions.tolist() == [2] * len(c.versions)
    assert (c.completion_ids.tolist(), c.logprobs[0]) != (a.completion_ids.tolist(), a.logprobs[0])

"""Fixtures of the `rollkeep serve` tests, made once per session: model directories
(offline: the tiny GPT-2 with a long enough context for a generation that is still running
when a test aborts it, other weights of the same architecture with a WEIGHTS.json as the
controller writes it, directories a reload must refuse), and one server per flavor,
started side by side.

The vLLM server is stopped with SIGTERM at the end, while it streams, and must end the
stream with "abort" and exit 0; the SGLang one is started by an intermediate parent and
must stop by itself once that parent exits (--exit-with-parent)."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from hf_fixture import make_tiny_hf_model  # noqa: E402
from serve_harness import CONTEXT, Client, Orphanable, Started  # noqa: E402


def weights_json(d: Path, version: int) -> None:
    files = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(d.iterdir()) if p.is_file()}
    digest = hashlib.sha256("".join(f"{n}{f['sha256']}" for n, f in sorted(files.items())).encode()).hexdigest()
    (d / "WEIGHTS.json").write_text(json.dumps({"version": version, "files": files, "digest": digest}))


@pytest.fixture(scope="session")
def dirs(tmp_path_factory) -> dict[str, Path]:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("serve-models")
    base = make_tiny_hf_model(root / "base", n_positions=CONTEXT)
    other = shutil.copytree(base, root / "other")
    torch.manual_seed(1)  # the same architecture, other random weights
    GPT2LMHeadModel(AutoConfig.from_pretrained(base)).save_pretrained(other, safe_serialization=True)
    weights_json(other, 1)
    torn = shutil.copytree(other, root / "torn")  # a file that is not what WEIGHTS.json lists
    tensors = load_file(torn / "model.safetensors")
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 1
    save_file(tensors, torn / "model.safetensors", metadata={"format": "pt"})
    missing = shutil.copytree(other, root / "missing-tensor")
    (missing / "WEIGHTS.json").unlink()
    tensors = load_file(missing / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    wider = make_tiny_hf_model(root / "wider", n_embd=64, n_positions=CONTEXT)  # another shape
    empty = root / "empty"
    empty.mkdir()
    return {"base": base, "other": other, "torn": torn, "missing": missing, "wider": wider, "empty": empty,
            "absent": root / "no-such-dir"}


@pytest.fixture(scope="session")
def servers(dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("servers")
    started = {}
    try:
        started["vllm"] = Started(dirs["base"], "vllm", tmp)
        started["sglang"] = Orphanable(dirs["base"], "sglang", tmp)
        ready = {flavor: s.ready() for flavor, s in started.items()}
        yield ready
        # SIGTERM while a stream runs: it ends with "abort" and its tokens so far, then exit 0.
        client = Client(ready["vllm"])
        with client.stream_chunks([5, 6, 7], seed=1, max_tokens=CONTEXT - 8, temperature=1.0,
                                  ignore_eos=True) as chunks:
            assert next(chunks).finish is None
            started["vllm"].proc.send_signal(signal.SIGTERM)
            *_, last = chunks
        assert last.finish == "abort" and 0 < len(last.ids) < CONTEXT - 8
        client.close()
        started["vllm"].stop()
        started["sglang"].end_parent()
    finally:
        for s in started.values():
            s.kill()


@pytest.fixture(params=["vllm", "sglang"])
def srv(request, servers):
    return servers[request.param]

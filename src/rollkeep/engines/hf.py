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

Token in, token out (`submit_ids`, for `rollkeep serve`): the same queue, batches and
decode loop, for a request given as token ids with its own seed, budget, sampling settings
(a batch shares them) and a callback per new token; `load_weights(dir)` refits from an HF
model directory. For the same weights, ids, seed and positions it gives exactly the tokens
and log-probs `generate` gives.

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
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.errors import CustodyError, UserInputError
from ..models.chat import prompt_ids as chat_prompt_ids
from ..models.hf import load_pretrained, read_weights_dir
from .base import (
    Capabilities,
    Completion,
    CompletionLimit,
    DataError,
    EpisodeTokenizer,
    GenRequest,
    InfraError,
)
from .dtypes import checkpoint_dtype, torch_dtype
from .inbox import Inbox, Refit, settle, take_batch

#: Called on the worker thread with each new token of a `submit_ids` request, in order:
#: (token id, its log-prob, the weight version it was sampled under).
OnToken = Callable[[int, float, int], None]


@dataclass(frozen=True)
class TokenResult:
    """What `submit_ids` resolves to: the new tokens only (never the given ones)."""

    token_ids: list[int]
    logprobs: np.ndarray  # float32, one per new token
    finish_reason: str  # "stop" (EOS, included in token_ids) or "length"
    version: int  # the weight version every new token was sampled under


@dataclass(eq=False)
class _Job:
    req: GenRequest | None  # None: a token-in request (`submit_ids`), answered with a TokenResult
    prompt_ids: list[int]  # the context: the prompt's ids, then the prefix's (batches are by its length)
    future: Future  # of Completion (or TokenResult); cancelled when the awaiting task is
    prompt_len: int = 0  # of the prompt alone
    budget: int = 0  # the longest completion, prefix included
    seed: int = 0
    temperature: float = 1.0  # with top_p: a batch's jobs share them (`_batch_key`)
    top_p: float = 1.0
    eos: int | None = None  # ends the completion; None: it runs to its budget
    on_token: OnToken | None = None


def _batch_key(job: _Job) -> tuple[int, float, float]:
    return len(job.prompt_ids), job.temperature, job.top_p


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
        dtype: Any = "auto",
        device: Any = None,
        field: str = "engine.model_path",  # what errors about model_path call it
    ) -> None:
        import torch

        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.chat_template = chat_template
        self.max_batch_size = max_batch_size
        if dtype == "auto":  # `engine.dtype`: the checkpoint's, whatever transformers' default is
            dtype = checkpoint_dtype(model_path)
        self.tokenizer, model = load_pretrained(model_path, field=field, dtype=dtype if isinstance(dtype, str) else None)
        if chat_template and getattr(self.tokenizer, "chat_template", None) is None:
            raise UserInputError(
                f"engine.chat_template (or data.chat_template) is true but the tokenizer in {model_path} has "
                "no chat template",
                field="engine.chat_template",
                expected="a tokenizer with a chat template",
                found="none",
                remedy="set engine.chat_template=false and data.chat_template=false, or add a chat template "
                "to the tokenizer",
            )
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch_dtype(dtype)  # a name, a torch.dtype (deterministic runs: float64) or None (as loaded)
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
        if self.chat_template:  # the template writes its own special tokens (`models.chat`)
            ids = chat_prompt_ids(self.tokenizer, text)
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=True)
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
        job = _Job(req, ids_ctx, Future(), len(ids), budget, req.seed, self.temperature, self.top_p, self._eos)
        self._inbox.put(self._jobs, job)
        return await asyncio.wrap_future(job.future)

    def submit_ids(self, ids: list[int], *, seed: int, max_new_tokens: int, prompt_tokens: int | None = None,
                   temperature: float | None = None, top_p: float | None = None, ignore_eos: bool = False,
                   on_token: OnToken | None = None) -> Future:
        """Queue a token-in request; returns a Future of its TokenResult (any thread).

        `ids` is the context: its first `prompt_tokens` (default: all) are the prompt, the
        rest a prefix of the completion already generated, so the first new token is
        sampled at completion position len(ids) - prompt_tokens, as `generate` does for
        `req.prefix`. At most `max_new_tokens` new ones; a prefix ending in EOS gets none
        ("stop"). `temperature`/`top_p` default to the engine's. `on_token` is called on
        the worker thread with each new token before the future resolves (it must be
        quick and must not raise: an exception fails the whole batch). Cancel the
        future to abort: a queued request never runs, a running one stops being decoded.
        The caller validates its input: ids in the vocabulary, 1 <= prompt_tokens <=
        len(ids), len(ids) + max_new_tokens within the model's context (ValueError else)."""
        prompt_len = len(ids) if prompt_tokens is None else prompt_tokens
        room = self._context - len(ids) if self._context is not None else max_new_tokens
        if not 1 <= prompt_len <= len(ids) or not 0 <= max_new_tokens <= room:
            raise ValueError(f"hf engine: {len(ids)} ids ({prompt_len} of them the prompt) and "
                             f"{max_new_tokens} new tokens do not fit a context of {self._context}")
        eos = None if ignore_eos else self._eos
        future: Future = Future()
        if max_new_tokens == 0 or (prompt_len < len(ids) and eos is not None and ids[-1] == eos):  # it ends there
            future.set_result(TokenResult([], np.zeros(0, np.float32), "length" if max_new_tokens == 0 else "stop",
                                          self._version))
            return future
        job = _Job(None, [int(t) for t in ids], future, prompt_len, len(ids) - prompt_len + max_new_tokens,
                   seed, self.temperature if temperature is None else temperature,
                   self.top_p if top_p is None else top_p, eos, on_token)
        self._inbox.put(self._jobs, job)
        return future

    async def load_weights(self, path: str, version: int) -> None:
        """Refit from the HF model directory `path` (config.json, *.safetensors) of this
        model's architecture, between batches; then `version`. A directory that does not
        load or fit raises UserInputError and changes nothing."""
        weights = await asyncio.to_thread(read_weights_dir, path, self.model)
        await self.update_weights(weights, version)

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
        """Copy the state dict `weights` into the model between batches; then `version`.
        (`load_state_dict` copies each tensor into the model's own, so float32 master
        weights land in the engine's dtype, rounded to nearest.)"""
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
                    refit, batch = None, take_batch(self._jobs, self.max_batch_size, _batch_key)
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
                if job.req is not None and job.req.pinned_version is not None and job.req.pinned_version != version:
                    raise CustodyError(
                        f"hf engine: request {job.req.group_id}/{job.req.generation} is pinned to another weight version",
                        expected=f"version {job.req.pinned_version}",
                        found=f"engine at version {version}",
                        remedy="this is a bug in the controller's refit ordering",
                    )
            outputs = self._decode(batch, version)
        except Exception as e:
            for job in batch:
                failure = InfraError(f"hf engine: a batch of {len(batch)} failed: {type(e).__name__}: {e}")
                failure.__cause__ = e
                settle(job.future, exception=failure)
            return
        for job, (ids, lp, reason) in zip(batch, outputs, strict=True):
            if job.req is None:
                settle(job.future, TokenResult(ids, lp, reason, version))
            else:
                settle(job.future, self._completion(job.req, job.prompt_ids[: job.prompt_len], ids, lp, version, reason))

    def _decode(self, batch: list[_Job], version: int) -> list[tuple[list[int], np.ndarray, str]]:
        """Each job's new tokens, their log-probs and its finish reason."""
        import torch

        from ..models.sampling import sample

        # Pad to a multiple of 4 rows with copies of the first (discarded): CPU matmul
        # kernels round the last bit differently for 1, 2-3 and tail rows, and a completion
        # must not depend on how many others were generated with it (measured and
        # explained at `torch_gpt._ROW_QUANTUM`).
        rows = batch + batch[:1] * (-len(batch) % _ROW_QUANTUM)
        seeds = [j.seed for j in rows]
        temperature, top_p = batch[0].temperature, batch[0].top_p  # shared: `_batch_key`
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
                                 temperature=temperature, top_p=top_p)  # (B,), (B,)
                tokens.append(tok)
                logprobs.append(lp)
                for j, d, t, p in zip(batch, done, tok.tolist(), lp.tolist(), strict=False):
                    if j.on_token is not None and not d:
                        j.on_token(t, p, version)
                done = [d or (j.eos is not None and t == j.eos) or j.future.cancelled() or pos + 1 >= r
                        for d, t, j, r in zip(done, tok.tolist(), rows, room, strict=True)]
                if all(done):
                    break
                x = tok.unsqueeze(1).to(self.device)  # (B, 1)
        ids_rows = torch.stack(tokens, dim=1).tolist()  # (B, T)
        lp_rows = torch.stack(logprobs, dim=1).numpy()  # (B, T) float32
        outputs = []
        for i, job in enumerate(batch):
            ids = ids_rows[i][: room[i]]
            stop = job.eos is not None and job.eos in ids
            n = ids.index(job.eos) + 1 if stop else len(ids)
            outputs.append((ids[:n], lp_rows[i, :n], "stop" if stop else "length"))
        return outputs


_ROW_QUANTUM = 4


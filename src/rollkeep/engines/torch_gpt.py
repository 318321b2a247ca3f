"""The built-in engine: the tiny GPT sampling with a KV cache, batched, on CPU.

One worker thread does all model work (torch releases the GIL inside its ops, so it runs
beside the trainer's thread). The asyncio side only puts requests and weight updates into
the engine's `Inbox` and awaits their futures; the worker answers with `settle`
(engines/inbox.py, the handoff the hf and vllm engines use too).

    generate(req, progress)
                    tokenize → queue → await the future. Cancelling the awaiting task
                    cancels the future: a queued request is dropped, a running row leaves
                    the batch at the worker's next step. The engine streams (`streams`):
                    with `progress`, the worker hands every token it samples for the row to
                    the loop as a one-token Chunk (`loop.call_soon_threadsafe`), in order,
                    the last one before it settles the future, so the loop runs all of a
                    row's chunks before `generate` returns (both go through the loop's FIFO
                    queue); a chunk that reaches the loop after the request was cancelled or
                    answered is dropped. With `req.prefix` the row continues that prefix
                    (see "Continuing a prefix").
    worker          take the oldest pending request and up to `max_batch_size - 1` more
                    of the same prefill length (oldest first; no padding tokens), prefill
                    with a fresh cache, then one token per step for every live row.
                    A row leaves the batch when it stops (EOS or length) or is cancelled;
                    its future is completed at once. A batch that raises fails its
                    requests with InfraError; the worker lives on.
    update_weights  validated on the loop, and copied there at once while the worker is
                    idle; otherwise queued, and the worker loads it before it takes its
                    next batch or, with `update_weights_in_flight`, between decode steps.
                    A newer update queued meanwhile supersedes it.
    close()         fails what is still queued with InfraError (a running batch finishes)
                    and joins the worker.

Reproducibility (docs/design.md §2): a sampled token is a function of the weights, the prompt, the
request's seed and the token's position (models.sampling), so the same request gives the
same tokens, log-probabilities and versions whatever else shares its batch. That needs the
model's logits for one row to be bitwise independent of the other rows, which the matmul
kernels do not give for free; see `_ROW_QUANTUM` and `GPT.row_chunk`.

Continuing a prefix (`GenRequest.prefix`, k tokens an earlier attempt generated): the
prefix is fed as token ids after the prompt (never re-rendered text) and the row's first
new token is sampled at completion position k, so every row carries its own position. The
completion returned is the prefix's ids, log-probs and versions exactly as given, then the
new ones; its length (prefix included) is at most `max_new_tokens`, and prompt + completion
fit `block_size`. A prefix that already ends the completion (last token EOS: "stop"; that
length: "length") is returned at once, without the worker. How the prefix's keys and values
are rebuilt depends on the mode:
  - default (not pinned): one prefill of prompt + prefix (k + P tokens in one pass). Its
    logits can differ from those token-by-token decoding computed in the last bits (float32:
    at most 4.8e-7 in the continuation's log-probs over 60 continuations of the test model,
    tests/engines/test_torch_stream.py), so the continuation samples the same tokens unless
    a draw falls within that of a boundary, with log-probs equal to rounding.
  - pinned (deterministic mode, `pinned_version` set): the cache is rebuilt the way the
    uninterrupted run built it: a prefill of the prompt alone, then the prefix fed one
    decode step at a time (logits computed and discarded, no sampling), then decoding goes
    on; with the same padded batch rows (`_padded`) the continuation is bit-identical to
    the uninterrupted one. The cost: k extra sequential decode steps for a k-token prefix
    (each a full forward of the batch, shared with its other rows) instead of one wider
    prefill. Such a row joins a batch of its prompt length: rows of one batch then sit at
    different steps (a replaying row feeds its prefix token while the others feed what they
    sampled), which the per-row positions allow.
So a job's prefill (`_Job.prompt_ids`, the batching key of `inbox.take_batch`) is the
prompt, or prompt + prefix in default mode; the real prompt is kept for the Completion.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..core.errors import CustodyError, UserInputError
from ..models.gpt import GPT, ROW_CHUNK
from ..models.sampling import sample
from ..models.tokenizer import EOS
from .base import (
    Capabilities,
    Chunk,
    Completion,
    CompletionLimit,
    DataError,
    GenRequest,
    InfraError,
    Prefix,
    Progress,
)
from .inbox import Inbox, Refit, settle, take_batch, take_refits

# Batch rows are padded to a multiple of this (with duplicates of a live row, discarded).
# On CPU the BLAS picks kernels by row count, and the last bit of a row's result depends on
# which kernel computed it. Measured (MKL 2024.2, AVX2, 1/2/4 intra-op threads, float32 and
# float64): a matmul of 1 row takes a matrix-vector path; 2-3 rows take another kernel;
# float64 computes the remainder rows of a count that is not a multiple of 4 with a tail
# kernel; with several threads float32 splits small counts (5-11 rows) into tails as well.
# Row counts that are multiples of 4 gave every row the same bits as any other such count.
# On AVX-512 (Sapphire Rapids, same MKL) that is not enough: the kernel also changes with
# the count itself (below 11 or 16 rows, above 64..192 for wide layers), so the engine's
# model runs its linear layers in calls of fixed row counts (`GPT.row_chunk`,
# models/gpt.py), which makes each row's logits independent of the batch on both; the
# padding to 4 stays, so AVX2 runs the attention as it was measured.
# (With 8+ threads MKL may split the reduction of small float64 products; the controller
# runs the engine with one intra-op thread.)
_ROW_QUANTUM = 4


@dataclass(eq=False)
class _Job:
    """One queued request: what the worker needs, and how to answer."""

    req: GenRequest
    prompt_ids: list[int]  # what the prefill feeds (prompt, + prefix in default mode): the batching key
    future: Future  # of Completion; cancelled when the awaiting task is
    prompt: list[int]  # the real prompt, for the Completion
    prefix: Prefix | None
    replay: list[int]  # prefix tokens fed one decode step each before sampling starts (pinned)
    offset: int  # completion position of the token the prefill predicts (the prefix fed in it)
    budget: int  # most completion tokens, prefix included
    report: Callable[[Chunk], None] | None  # schedules a chunk on the loop; None: no progress


@dataclass(eq=False)
class _Row:
    """A live row of a running batch: its new tokens so far."""

    job: _Job
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class TorchEngine:
    name = "torch"
    streams = True  # generate(req, progress) reports every new token as it is sampled
    continues = True

    def __init__(
        self,
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        max_batch_size: int,
        update_weights_in_flight: bool,
        model: GPT,
        tokenizer: Any,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.max_batch_size = max_batch_size
        self.update_weights_in_flight = update_weights_in_flight
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.model = copy.deepcopy(model).to(dtype).eval()  # the engine's own copy
        self.model.row_chunk = ROW_CHUNK  # batch-invariant linear layers (see _ROW_QUANTUM)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._params = self.model.state_dict()  # name → tensor sharing the model's storage
        self._version = 0
        self._inbox = Inbox("torch engine")
        self._jobs: deque[_Job] = deque()
        self._refits: deque[Refit] = deque()
        self._thread = threading.Thread(target=self._work, name="rollkeep-torch-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        """The weight version loaded in the model now."""
        return self._version

    # ================================================================== asyncio side

    async def generate(self, req: GenRequest, progress: Progress | None = None) -> Completion:
        """One sibling; see the module docstring (streaming, continuing `req.prefix`)."""
        ids = self.tokenizer.encode(req.prompt.prompt)
        block = self.model.cfg.block_size
        if len(ids) >= block:
            raise DataError(
                f"torch engine: prompt of {len(ids)} tokens (with BOS) leaves no room to generate "
                f"in block_size {block} ({req.group_id}/{req.generation})"
            )
        budget = self.completion_limit(len(ids))  # prompt + completion fit
        if req.max_tokens is not None:  # a turn's cap
            budget = min(budget, req.max_tokens)
        prefix = req.prefix if req.prefix is not None and len(req.prefix) > 0 else None
        replay: list[int] = []
        context, offset = ids, 0
        if prefix is not None:
            pids = self._check_prefix(req, prefix)
            if pids[-1] == EOS or len(pids) >= budget:  # the prefix already ends the completion
                return self._completion(ids, prefix, [], [], [], "stop" if pids[-1] == EOS else "length")
            if req.pinned_version is not None:  # rebuild the cache as the uninterrupted run did
                replay = pids
            else:  # one prefill of prompt + prefix
                context, offset = ids + pids, len(pids)
        future: Future = Future()
        waiter = asyncio.wrap_future(future)
        report = None
        if progress is not None:
            loop = asyncio.get_running_loop()

            def deliver(chunk: Chunk) -> None:  # on the loop
                if not waiter.done():  # cancelled or answered: report nothing more
                    progress(chunk)

            def report(chunk: Chunk) -> None:  # on the worker
                loop.call_soon_threadsafe(deliver, chunk)

        job = _Job(req, context, future, ids, prefix, replay, offset, budget, report)
        self._inbox.put(self._jobs, job)
        return await waiter

    def _check_prefix(self, req: GenRequest, prefix: Prefix) -> list[int]:
        """The prefix's token ids, once its arrays are seen to fit together and the model."""
        ids = [int(t) for t in prefix.completion_ids]
        if not len(ids) == len(prefix.logprobs) == len(prefix.versions):
            raise ValueError(
                f"torch engine: the prefix of {req.group_id}/{req.generation} has {len(ids)} tokens, "
                f"{len(prefix.logprobs)} log-probs and {len(prefix.versions)} versions"
            )
        vocab = self.model.cfg.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(
                f"torch engine: the prefix of {req.group_id}/{req.generation} holds a token id "
                f"outside the vocabulary of {vocab}"
            )
        return ids

    @property
    def capabilities(self) -> Capabilities:
        """Streams, continues a prefix, runs episodes with its char tokenizer."""
        return Capabilities(streams=self.streams, continues=self.continues, episode_tokenizer=self.episode_tokenizer,
                            completion_limit=self.completion_limit)

    @property
    def episode_tokenizer(self) -> Any:
        return self.tokenizer  # the char tokenizer: encode(text, bos=False), decode(ids)

    @property
    def completion_limit(self) -> CompletionLimit:
        """The longest completion (prefix included) after a prompt of n tokens (BOS
        included), `(n)`: what `generate` stops at, and what a multi-turn trajectory must fit."""
        return CompletionLimit(self.max_new_tokens, self.model.cfg.block_size)

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a state_dict snapshot as `version`; returns once it is loaded.

        Validated here; copied here too while the worker is idle (`Inbox.run_if_idle`: no
        thread switch); otherwise queued, and the worker loads it before its next batch
        or, with `update_weights_in_flight`, at its next decode step. This call waits for
        that, so `version` is the new version when it returns (the controller
        dispatches pinned groups by reading `version` after a refit). A newer update queued
        meanwhile supersedes this one: both calls return when the newer is loaded. The
        snapshot is only read, and not referenced by the engine once copied."""
        self._check_weights(weights)
        refit = Refit(weights, version, Future())
        if self._inbox.run_if_idle(lambda: self._refit([refit])):
            refit.future.result()  # raises what loading raised
            return
        self._inbox.put(self._refits, refit)
        await asyncio.wrap_future(refit.future)

    async def close(self) -> None:
        """Fail queued requests and updates, let a running batch finish, join the worker."""
        for item in self._inbox.shut(self._jobs, self._refits):
            what = "loading pending weights" if isinstance(item, Refit) else "generating"
            settle(item.future, exception=InfraError(f"torch engine: closed before {what}"))
        await asyncio.to_thread(self._thread.join)

    # ================================================================== weights

    def _check_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Validate before anything is copied: an update loads whole or not at all."""
        own = self._params
        missing = sorted(set(own) - set(weights))
        unexpected = sorted(set(weights) - set(own))
        wrong = [
            f"{k} {tuple(weights[k].shape)} (engine {tuple(own[k].shape)})"
            for k in own
            if k in weights and tuple(weights[k].shape) != tuple(own[k].shape)
        ]
        if missing or unexpected or wrong:
            raise UserInputError(
                "torch engine: the weights do not fit the engine's model",
                expected="the state_dict of a GPT with the engine's model config",
                found=f"missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shapes {wrong[:5]}",
                remedy="build the trainer's model and the engine's model from the same model config",
            )

    def _refit(self, refits: list[Refit]) -> None:
        """Copy the newest of `refits` into the model (cast to the engine's dtype) and
        settle them all; the older ones are superseded by it. Runs on the worker, or on the
        loop while the worker is blocked in `Inbox.wait`."""
        newest = refits[-1]
        try:
            with torch.no_grad():
                for name, p in self._params.items():
                    p.copy_(newest.weights[name])
        except Exception as e:  # e.g. a tensor that cannot be cast: the callers hear of it
            for refit in refits:
                failure = InfraError(
                    f"torch engine: loading weights of version {newest.version} failed: {type(e).__name__}: {e}"
                )
                failure.__cause__ = e
                settle(refit.future, exception=failure)
            return
        self._version = newest.version
        for refit in refits:
            settle(refit.future)

    def _refit_in_flight(self) -> None:
        """Worker, between decode steps: load what is queued. The unlocked peek may miss an
        update put meanwhile; it is then loaded at the next step."""
        if not self._refits:
            return
        with self._inbox.cv:
            refits = take_refits(self._refits)
        if refits:
            self._refit(refits)

    # ================================================================== worker thread

    def _work(self) -> None:
        inbox = self._inbox
        while True:
            with inbox.cv:
                inbox.wait(lambda: self._jobs or self._refits)
                if self._refits:  # between batches: updates first
                    refits, batch = take_refits(self._refits), []
                elif self._jobs:
                    refits, batch = [], take_batch(self._jobs, self.max_batch_size)
                else:
                    return  # closing, and nothing is left
            if refits:
                self._refit(refits)
            elif batch:
                try:
                    self._run_batch(batch)
                except BaseException as e:  # the worker never dies: the batch's requests fail
                    for job in batch:  # `settle` skips those already answered
                        failure = InfraError(f"torch engine: generation failed: {type(e).__name__}: {e}")
                        failure.__cause__ = e
                        settle(job.future, exception=failure)

    def _run_batch(self, batch: list[_Job]) -> None:
        # Deterministic pinning: the controller dispatches a pinned request only while the
        # engine holds that version, and refits only after those requests are done.
        version = self._version
        rows = []
        for job in batch:
            if job.req.pinned_version is not None and job.req.pinned_version != version:
                settle(job.future, exception=CustodyError(
                    f"torch engine: request {job.req.group_id}/{job.req.generation} is pinned to "
                    f"weight version {job.req.pinned_version} but the engine holds version {version}",
                    expected=f"version {job.req.pinned_version} (deterministic mode pins generation)",
                    found=f"engine at version {version}",
                    remedy="this is a bug in the controller: it must dispatch pinned requests only "
                    "while the engine is at their version and refit only after they finish",
                ))
            else:
                rows.append(_Row(job))
        if not rows:
            return
        with torch.inference_mode():
            self._decode(rows)

    def _decode(self, rows: list[_Row]) -> None:
        """Prefill, then one token per step, until every row has stopped or left.

        Step s (s = 0: the prefill) predicts completion position `offset + s` of each row. A
        row still replaying its prefix (s < len(replay)) is not sampled: its next input is
        its prefix token s. Every row stops at its own budget, so every forward fits
        block_size."""
        live = list(range(len(rows)))  # rows[i] sits at batch position live.index(i)
        x = torch.tensor([rows[i].job.prompt_ids for i in _padded(live)], dtype=torch.long)  # (B, C)
        cache = self.model.new_cache()
        start = 0
        pinned = any(r.job.req.pinned_version is not None for r in rows)
        for step in itertools.count():
            # In-flight update, between decode steps: later tokens carry the new version,
            # while the keys and values cached for earlier tokens stay those computed by the
            # old weights (the usual in-flight update: no recomputation). Never inside a
            # batch holding pinned (deterministic) requests.
            if step > 0 and self.update_weights_in_flight and not pinned:
                self._refit_in_flight()
            version = self._version
            logits = self.model(x, cache, start)[: len(live), -1, :]  # (live, V), duplicates dropped
            drawn = [p for p, i in enumerate(live) if step >= len(rows[i].job.replay)]  # batch positions
            sampled: dict[int, tuple[int, float]] = {}  # batch position → (token, log-prob)
            if drawn:
                if len(drawn) < len(live):  # sampling is per row: the subset changes no row's draw
                    logits = logits.index_select(0, torch.tensor(drawn, dtype=torch.long))
                seeds = [rows[live[p]].job.req.seed for p in drawn]
                positions = [rows[live[p]].job.offset + step for p in drawn]
                tokens, logprobs = sample(logits, seeds, positions, temperature=self.temperature, top_p=self.top_p)
                sampled = dict(zip(drawn, zip(tokens.tolist(), logprobs.tolist(), strict=True), strict=True))
            keep = []  # batch positions of rows that go on
            feed = []  # and the token each feeds next
            for pos, i in enumerate(live):
                row = rows[i]
                job = row.job
                if job.future.cancelled():
                    continue
                if pos not in sampled:  # replaying the prefix: its token is the next input
                    keep.append(pos)
                    feed.append(job.replay[step])
                    continue
                tok, lp = sampled[pos]
                row.tokens.append(tok)
                row.logprobs.append(lp)
                row.versions.append(version)
                if job.report is not None:  # before `_finish` settles: the loop sees it first
                    self._report(job, tok, lp, version)
                if tok == EOS or job.offset + step + 1 == job.budget:
                    self._finish(row, "stop" if tok == EOS else "length")
                else:
                    keep.append(pos)
                    feed.append(tok)
            if not keep:
                return
            if len(keep) != len(live):  # rows left: shrink the cache (O(cache), once per exit)
                sel = torch.tensor(_padded(keep), dtype=torch.long)  # batch positions of the next step
                cache = [(k.index_select(0, sel), v.index_select(0, sel)) for k, v in cache]
                live = [live[p] for p in keep]
            start += x.size(1)
            x = torch.tensor(_padded(feed), dtype=torch.long).unsqueeze(1)  # (B, 1)

    def _report(self, job: _Job, tok: int, lp: float, version: int) -> None:
        chunk = Chunk(
            completion_ids=np.asarray([tok], dtype=np.int32),
            logprobs=np.asarray([lp], dtype=np.float32),
            versions=np.asarray([version], dtype=np.int32),
        )
        try:
            job.report(chunk)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            job.report = None

    def _finish(self, row: _Row, reason: str) -> None:
        job = row.job
        settle(job.future, self._completion(job.prompt, job.prefix, row.tokens, row.logprobs, row.versions, reason))

    def _completion(
        self,
        prompt: list[int],
        prefix: Prefix | None,
        tokens: list[int],
        logprobs: list[float],
        versions: list[int],
        reason: str,
    ) -> Completion:
        """The prefix as given (if any), then the new tokens."""
        ids = np.asarray(tokens, dtype=np.int32)
        lps = np.asarray(logprobs, dtype=np.float32)
        vs = np.asarray(versions, dtype=np.int32)
        if prefix is not None:
            ids = np.concatenate([np.asarray(prefix.completion_ids, dtype=np.int32), ids])
            lps = np.concatenate([np.asarray(prefix.logprobs, dtype=np.float32), lps])
            vs = np.concatenate([np.asarray(prefix.versions, dtype=np.int32), vs])
        return Completion(
            prompt_ids=np.asarray(prompt, dtype=np.int32),
            completion_ids=ids,  # EOS included when it stopped the row: the trainer learns to stop
            logprobs=lps,
            versions=vs,
            finish_reason=reason,
            text=self.tokenizer.decode(ids),  # decode ends at EOS
        )


def _padded(positions: list[int]) -> list[int]:
    """Batch positions padded to a multiple of `_ROW_QUANTUM` with copies of the first."""
    pad = -len(positions) % _ROW_QUANTUM
    return positions + positions[:1] * pad

"""The built-in engine: the tiny GPT sampling with a KV cache, batched, on CPU.

One worker thread does all model work (torch releases the GIL inside its ops, so it runs
beside the trainer's thread). The asyncio side only queues requests and awaits futures
that the worker completes with `loop.call_soon_threadsafe`.

    generate(req)   tokenize → queue → await the future. Cancelling the awaiting task
                    marks the request aborted; the worker drops it at its next step.
    worker          take the oldest pending request and up to `max_batch_size - 1` more
                    of the same prompt length (oldest first; no padding tokens), prefill
                    with a fresh cache, then one token per step for every live row.
                    A row leaves the batch when it stops (EOS or length) or is aborted;
                    its future is completed at once.
    update_weights  copied into the model at once when the worker is idle; otherwise kept
                    as pending and applied by the worker between decode steps
                    (`update_weights_in_flight`) or at the end of the running batch.

Reproducibility (docs/design.md §2): a sampled token is a function of the weights, the prompt, the
request's seed and the token's position (models.sampling), so the same request gives the
same tokens, log-probabilities and versions whatever else shares its batch. That needs the
model's logits for one row to be bitwise independent of the other rows, which the matmul
kernels do not give for free; see `_ROW_QUANTUM`.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..core.errors import CustodyError, UserInputError
from ..models.gpt import GPT
from ..models.sampling import sample
from ..models.tokenizer import EOS
from .base import Completion, DataError, GenRequest, InfraError

# Rows of every matmul the model runs are padded to a multiple of this (with duplicates
# of a live row, discarded). On CPU the BLAS picks kernels by row count, and the last bit
# of a row's result depends on which kernel computed it. Measured (MKL 2024.2, AVX2,
# 1/2/4 intra-op threads, float32 and float64): a matmul of 1 row takes a matrix-vector
# path; 2-3 rows take another kernel; float64 computes the remainder rows of a count that
# is not a multiple of 4 with a tail kernel; with several threads float32 splits small
# counts (5-11 rows) into tails as well. Row counts that are multiples of 4 gave every row
# the same bits as any other such count. A batch of one therefore runs as 4 identical rows.
# (With 8+ threads MKL may split the reduction of small float64 products; the controller
# runs the engine with one intra-op thread.) Prefill multiplies batch by prompt length, so
# a batch padded to a multiple of 4 keeps that product a multiple of 4 too.
_ROW_QUANTUM = 4


@dataclass(eq=False)
class _Item:
    """One queued request: what the worker needs, and how to answer."""

    req: GenRequest
    prompt_ids: list[int]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    aborted: bool = False  # set from the loop thread when the awaiting task is cancelled


@dataclass(eq=False)
class _Row:
    """A live row of a running batch: its tokens so far."""

    item: _Item
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def _answer(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Complete `fut` on its loop from any thread; a future already done (cancelled) or a
    loop already closed is left alone."""

    def settle() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


class TorchEngine:
    name = "torch"

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
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._params = self.model.state_dict()  # name → tensor sharing the model's storage
        self._version = 0
        # One condition guards: the queue, `_busy`, the pending update, `_closed`, and
        # every copy into the model's weights.
        self._cv = threading.Condition()
        self._queue: list[_Item] = []
        self._busy = False  # the worker is running a batch
        self._pending: tuple[Mapping[str, torch.Tensor], int] | None = None
        self._pending_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="rollkeep-torch-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        """The weight version loaded in the model now."""
        return self._version

    # ================================================================== asyncio side

    async def generate(self, req: GenRequest) -> Completion:
        ids = self.tokenizer.encode(req.prompt.prompt)
        if len(ids) >= self.model.cfg.block_size:
            raise DataError(
                f"torch engine: prompt of {len(ids)} tokens (with BOS) leaves no room to generate "
                f"in block_size {self.model.cfg.block_size} ({req.group_id}/{req.generation})"
            )
        loop = asyncio.get_running_loop()
        item = _Item(req, ids, loop, loop.create_future())
        with self._cv:
            if self._closed:
                raise InfraError("torch engine: closed")
            self._queue.append(item)
            self._cv.notify_all()
        try:
            return await item.future
        except asyncio.CancelledError:
            item.aborted = True  # the worker drops the row at its next step
            raise

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a state_dict snapshot as `version`; returns once it is loaded.

        Idle worker: copied right here. Running batch: kept as pending and loaded by the
        worker at its next decode step (`update_weights_in_flight`) or when the batch ends;
        this call waits for that, so `version` is the new version when it returns (the
        controller dispatches pinned groups by reading `version` after a refit). A newer
        update that arrives meanwhile replaces a pending one; both calls return when the
        newer is loaded. The snapshot is only read, and not referenced once copied."""
        self._check_weights(weights)
        with self._cv:
            if self._closed:
                raise InfraError("torch engine: closed")
            if not self._busy:
                self._load(weights, version)
                return
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            self._pending = (weights, version)
            self._pending_waiters.append((loop, fut))
        await fut

    async def close(self) -> None:
        """Stop the worker and join it; queued requests and pending updates fail."""
        with self._cv:
            self._closed = True
            queued, self._queue = self._queue, []
            waiters, self._pending_waiters = self._pending_waiters, []
            self._pending = None
            self._cv.notify_all()
        for item in queued:
            _answer(item.loop, item.future, None, InfraError("torch engine: closed before generating"))
        for loop, fut in waiters:
            _answer(loop, fut, None, InfraError("torch engine: closed before loading pending weights"))
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

    def _load(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy into the model (caller holds `_cv`), cast to the engine's dtype."""
        with torch.no_grad():
            for name, p in self._params.items():
                p.copy_(weights[name])
        self._version = version

    def _apply_pending(self, *, idle: bool = False) -> None:
        """Worker side: load the pending update, if any, and wake its waiters. With `idle`,
        also mark the worker idle in the same critical section, so an update cannot be
        left pending by a worker that goes to sleep."""
        with self._cv:
            if idle:
                self._busy = False
            if self._pending is None:
                return
            weights, version = self._pending
            self._pending = None
            waiters, self._pending_waiters = self._pending_waiters, []
            try:
                self._load(weights, version)
                error = None
            except Exception as e:  # e.g. a tensor that cannot be cast: the caller hears of it
                error = InfraError(f"torch engine: loading weights of version {version} failed: {type(e).__name__}: {e}")
            del weights
        for loop, fut in waiters:
            _answer(loop, fut, None, error)

    # ================================================================== worker thread

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._queue:
                    self._cv.wait()
                if self._closed:
                    return
                batch = self._take_batch()
                self._busy = True
                version = self._version
            try:
                if batch:
                    self._run_batch(batch, version)
            except BaseException as e:  # the worker never dies: the batch's requests fail
                error = InfraError(f"torch engine: generation failed: {type(e).__name__}: {e}")
                error.__cause__ = e
                for item in batch:
                    _answer(item.loop, item.future, None, error)
            finally:
                self._apply_pending(idle=True)  # between batches

    def _take_batch(self) -> list[_Item]:
        """Oldest request first, then the oldest others of its prompt length (caller holds
        `_cv`). Aborted requests are dropped here."""
        self._queue = [it for it in self._queue if not it.aborted]
        if not self._queue:
            return []
        length = len(self._queue[0].prompt_ids)
        batch, rest = [], []
        for it in self._queue:
            if len(it.prompt_ids) == length and len(batch) < self.max_batch_size:
                batch.append(it)
            else:
                rest.append(it)
        self._queue = rest
        return batch

    def _run_batch(self, batch: list[_Item], version: int) -> None:
        # Deterministic pinning: the controller dispatches a pinned request only while the
        # engine holds that version, and refits only after those requests are done.
        rows = []
        for item in batch:
            if item.req.pinned_version is not None and item.req.pinned_version != version:
                _answer(item.loop, item.future, None, CustodyError(
                    f"torch engine: request {item.req.group_id}/{item.req.generation} is pinned to "
                    f"weight version {item.req.pinned_version} but the engine holds version {version}",
                    expected=f"version {item.req.pinned_version} (deterministic mode pins generation)",
                    found=f"engine at version {version}",
                    remedy="this is a bug in the controller: it must dispatch pinned requests only "
                    "while the engine is at their version and refit only after they finish",
                ))
            else:
                rows.append(_Row(item))
        if not rows:
            return
        with torch.inference_mode():
            self._decode(rows)

    def _decode(self, rows: list[_Row]) -> None:
        """Prefill, then one token per step, until every row has stopped or left."""
        P = len(rows[0].item.prompt_ids)
        n_new = min(self.max_new_tokens, self.model.cfg.block_size - P)  # prompt + completion fit
        live = list(range(len(rows)))  # rows[i] sits at batch position live.index(i)
        x = torch.tensor([rows[i].item.prompt_ids for i in _padded(live)], dtype=torch.long)  # (B, P)
        cache = self.model.new_cache()
        start = 0
        pinned = any(r.item.req.pinned_version is not None for r in rows)
        for position in range(n_new):
            # In-flight update, between decode steps: later tokens carry the new version,
            # while the keys and values cached for earlier tokens stay those computed by the
            # old weights (the usual in-flight update: no recomputation). Never inside a
            # batch holding pinned (deterministic) requests.
            if position > 0 and self.update_weights_in_flight and not pinned:
                self._apply_pending()
            version = self._version
            logits = self.model(x, cache, start)[: len(live), -1, :]  # (live, V), duplicates dropped
            seeds = [rows[i].item.req.seed for i in live]
            tokens, logprobs = sample(logits, seeds, position, temperature=self.temperature, top_p=self.top_p)
            keep = []  # batch positions of rows that go on
            last = position + 1 == n_new
            for pos, (i, tok, lp) in enumerate(zip(live, tokens.tolist(), logprobs.tolist(), strict=True)):
                row = rows[i]
                if row.item.aborted:
                    continue
                row.tokens.append(tok)
                row.logprobs.append(lp)
                row.versions.append(version)
                if tok == EOS or last:
                    self._finish(row, "stop" if tok == EOS else "length")
                else:
                    keep.append(pos)
            if not keep:
                return
            sel = torch.tensor(_padded(keep), dtype=torch.long)  # batch positions of the next step
            if len(keep) != len(live):  # rows left: shrink the cache (O(cache), once per exit)
                cache = [(k.index_select(0, sel), v.index_select(0, sel)) for k, v in cache]
                live = [live[p] for p in keep]
            start += x.size(1)
            x = tokens.index_select(0, sel).unsqueeze(1)  # (B, 1)

    def _finish(self, row: _Row, reason: str) -> None:
        item = row.item
        ids = np.asarray(row.tokens, dtype=np.int32)
        completion = Completion(
            prompt_ids=np.asarray(item.prompt_ids, dtype=np.int32),
            completion_ids=ids,  # EOS included when it stopped the row: the trainer learns to stop
            logprobs=np.asarray(row.logprobs, dtype=np.float32),
            versions=np.asarray(row.versions, dtype=np.int32),
            finish_reason=reason,
            text=self.tokenizer.decode(ids),  # decode ends at EOS
        )
        _answer(item.loop, item.future, completion, None)


def _padded(positions: list[int]) -> list[int]:
    """Batch positions padded to a multiple of `_ROW_QUANTUM` with copies of the first."""
    pad = -len(positions) % _ROW_QUANTUM
    return positions + positions[:1] * pad

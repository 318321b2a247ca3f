"""The toy engine: deterministic fake generation for testing and benchmarking the
control plane. Completions, latencies and injected failures are pure functions of the
request's seed, so kills land while many groups are in every state and a regenerated
rollout reproduces the lost one exactly."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import xxhash

from .base import Chunk, Completion, DataError, GenRequest, InfraError, Progress

VOCAB = 10  # digits: a completion's text is its token ids, so rewards can parse numbers


def _unit(*parts: object) -> float:
    """A uniform number in [0, 1) from the parts, stable across processes."""
    return xxhash.xxh3_64_intdigest("/".join(map(str, parts)).encode()) / 2.0**64


def _sample(seed: int, max_tokens: int) -> tuple[int, np.ndarray, np.ndarray]:
    """A completion as a pure function of the seed: length, digit tokens, log-probs.
    (xxhash rather than a numpy Generator: seeding one costs more than the whole sample.)"""
    need = 1 + 2 * max_tokens
    raw = b"".join(xxhash.xxh3_128_digest(f"{seed}/{i}".encode()) for i in range(-(-need // 16)))
    n = 1 + raw[0] % max_tokens
    ids = (np.frombuffer(raw, np.uint8, n, 1) % VOCAB).astype(np.int32)
    logprobs = (np.frombuffer(raw, np.uint8, n, 1 + max_tokens) / -256.0).astype(np.float32)
    return n, ids, logprobs


class ToyEngine:
    name = "toy"
    streams = True  # one chunk per token, each `token_ms` after the previous (none if token_ms is 0)

    def __init__(
        self,
        *,
        latency_ms: float = 0.0,
        latency_jitter_ms: float = 0.0,
        infra_fail_rate: float = 0.0,
        data_fail_rate: float = 0.0,
        completion_tokens: int = 8,
        hang_rate: float = 0.0,
        token_ms: float = 0.0,
    ) -> None:
        self.latency_ms = latency_ms
        self.latency_jitter_ms = latency_jitter_ms
        self.infra_fail_rate = infra_fail_rate
        self.data_fail_rate = data_fail_rate
        self.completion_tokens = completion_tokens
        self.hang_rate = hang_rate
        self.token_ms = token_ms
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, req: GenRequest, progress: Progress | None = None) -> Completion:
        # (Each draw is made only when its rate can matter: the control-plane benchmark runs
        # this engine at zero latency and without failures.)
        delay = self.latency_ms
        if self.latency_jitter_ms:
            delay += self.latency_jitter_ms * _unit(req.seed, "latency", req.attempt)
        if delay > 0:
            await asyncio.sleep(delay / 1000.0)
        # Infra failures and hangs are keyed by the sibling's infra-retry count, not the
        # attempt number (restarts add attempts), so the same ones happen in every lineage.
        if self.hang_rate and _unit(req.seed, "hang", req.infra_retries) < self.hang_rate:
            await asyncio.Event().wait()  # never returns; the caller's deadline cancels it
        if self.infra_fail_rate and _unit(req.seed, "infra", req.infra_retries) < self.infra_fail_rate:
            raise InfraError(f"toy engine: injected infra failure ({req.group_id}/{req.generation})")
        if self.data_fail_rate and _unit(req.seed, "data") < self.data_fail_rate:
            raise DataError(f"toy engine: injected data failure ({req.group_id}/{req.generation})")
        # The completion is a function of the seed alone: a prefix (an earlier attempt's first k
        # tokens, as given) is continued with tokens k..n-1 of the same sample.
        n, ids, logprobs = _sample(req.seed, self.completion_tokens)
        prefix = req.prefix
        k = 0 if prefix is None else min(len(prefix), n)
        versions = np.full(n, self._version if req.pinned_version is None else req.pinned_version, np.int32)
        if k:
            ids, logprobs, versions = (np.concatenate([p[:k], a[k:]]) for p, a in (
                (prefix.completion_ids, ids), (prefix.logprobs, logprobs), (prefix.versions, versions)))
        # Tokens take time only with `token_ms`; without it a generation is instant and has no
        # partial state to report (the control-plane benchmark runs it so).
        if self.token_ms > 0:
            for i in range(k, n):
                await asyncio.sleep(self.token_ms / 1000.0)
                if progress is not None:
                    progress(Chunk(ids[i : i + 1], logprobs[i : i + 1], versions[i : i + 1]))
        prompt_ids = np.frombuffer(req.prompt.prompt.encode(), dtype=np.uint8).astype(np.int32)
        return Completion(
            prompt_ids=prompt_ids,
            completion_ids=ids,
            logprobs=logprobs,
            versions=versions,
            finish_reason="stop" if n < self.completion_tokens else "length",
            text="".join(map(str, ids.tolist())),
        )

    async def update_weights(self, weights: Any, version: int) -> None:
        self._version = version

    async def close(self) -> None:
        pass

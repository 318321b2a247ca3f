"""What both flavors' routes share: running one generation for a route (answered whole, or
streamed as server-sent events), aborting it when the client goes away, incremental text,
and JSON error bodies in each flavor's shape."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engines.base import InfraError
from .body import GenParams, Limits
from .service import Arrival, Live, Outcome, Service

#: A stream chunk's JSON from an arrival of tokens (the last one carries the outcome).
Chunk = Callable[[Arrival], dict[str, Any]]


@dataclass(frozen=True)
class Served:
    """What the routes say about the served model."""

    name: str  # --served-model-name (default: MODEL_DIR as given)
    model_dir: str
    tokenizer: Any
    limits: Limits
    eos: int | None
    max_batch_size: int


def vllm_error(status: int, message: str) -> JSONResponse:
    kind = "BadRequestError" if status == 400 else "NotFoundError" if status == 404 else "Error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}},
                        status_code=status)


def sglang_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def answer(request: Request, service: Service, params: GenParams) -> Outcome:
    """Run `params` to its outcome; the client hanging up aborts it (as vLLM's
    `with_cancellation` does). Raises InfraError if the engine failed it."""
    live = service.open(params)
    watch = asyncio.create_task(_abort_on_disconnect(request, service, live))
    try:
        return await service.outcome(live)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        service.close(live)


async def _abort_on_disconnect(request: Request, service: Service, live: Live) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    service.abort(live)


def stream(service: Service, params: GenParams, chunk: Chunk) -> StreamingResponse:
    """SSE: `data: <chunk>` per arrival of tokens, the last with the outcome, then
    `data: [DONE]`. Starlette cancels the stream when the client hangs up; `close` then
    aborts the request. A failure of the engine mid-stream ends it with an error event."""

    async def events() -> AsyncIterator[bytes]:
        live = service.open(params)  # here, not before: a stream never started holds nothing
        try:
            async with contextlib.aclosing(service.tokens(live)) as arrivals:
                async for arrival in arrivals:
                    if arrival.token_ids or arrival.outcome is not None:
                        yield sse(chunk(arrival))
        except InfraError as e:
            yield sse({"error": {"message": str(e), "type": "InternalServerError", "code": 500}})
        finally:
            service.close(live)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def finished_metrics(service: Service) -> str:
    """rollkeep-only: finished requests by how they ended (stop, length, abort, error)."""
    return "".join(f'rollkeep:requests_finished_total{{finished_reason="{k}"}} {n}\n'
                   for k, n in service.finished.items())


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Text:
    """Incremental detokenization: the text of the ids so far, and what each new batch of
    ids adds to it (special tokens are skipped, as in the servers' `text`)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def add(self, ids: list[int]) -> str:
        if not ids:
            return ""
        self.ids.extend(ids)
        full = self._tok.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):  # an incomplete character: wait for its other bytes
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta

    def pieces(self, ids: list[int]) -> list[str]:
        """Each token's own text (special tokens included), for vLLM's `logprobs.tokens`."""
        return [self._tok.decode([t]) for t in ids]

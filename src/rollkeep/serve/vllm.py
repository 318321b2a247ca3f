"""The vLLM flavor: vLLM's routes and field names (docs/server-mode.md; the control routes
are those a real vLLM has with VLLM_SERVER_DEV_MODE=1). rollkeep-only: `weight_version` in
responses, the `rollkeep` request field, and `/version` naming rollkeep serve."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from ..core.errors import UserInputError
from ..version import rollkeep_version
from . import body
from .body import BadRequest, GenParams
from .http import Served, Text, answer, finished_metrics, stream, vllm_error
from .service import Arrival, Outcome, Service


def add_routes(app: FastAPI, service: Service, served: Served) -> None:
    tok = served.tokenizer

    def logprobs(text: Text, ids: list[int], lps: list[float], start: int) -> dict:
        pieces = text.pieces(ids)
        offsets, at = [], start
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {"tokens": pieces, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}

    def usage(p: GenParams, n: int) -> dict:
        return {"prompt_tokens": len(p.ids), "completion_tokens": n, "total_tokens": len(p.ids) + n}

    # ------------------------------------------------------------ data plane

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        p = body.vllm_completions(await body.read_json(request), served.limits)
        head = {"id": f"cmpl-{p.request_id}", "object": "text_completion", "created": int(time.time()),
                "model": served.name}
        if p.stream:
            text, first = Text(tok), [True]

            def chunk(a: Arrival) -> dict:
                start = len(text.text)
                choice = {"index": 0, "text": text.add(a.token_ids),
                          "token_ids": a.token_ids if p.token_ids else None,
                          "logprobs": logprobs(text, a.token_ids, a.logprobs, start) if p.logprobs else None,
                          "finish_reason": a.outcome.finish_reason if a.outcome else None, "stop_reason": None}
                if first and p.token_ids:
                    choice["prompt_token_ids"] = p.ids
                first.clear()
                return head | {"weight_version": a.weight_version, "choices": [choice]}

            return stream(service, p, chunk)
        out = await answer(request, service, p)
        text = Text(tok)
        choice = {"index": 0, "text": text.add(out.token_ids),
                  "token_ids": out.token_ids if p.token_ids else None,
                  "prompt_token_ids": p.ids if p.token_ids else None,
                  "logprobs": logprobs(text, out.token_ids, out.logprobs, 0) if p.logprobs else None,
                  "finish_reason": out.finish_reason, "stop_reason": None}
        return JSONResponse(head | {"weight_version": out.weight_version, "choices": [choice],
                                    "usage": usage(p, len(out.token_ids))})

    def tokens_choice(ids: list[int], lps: list[float], finish: str | None, p: GenParams) -> dict:
        content = [{"token_id": t, "logprob": lp} for t, lp in zip(ids, lps, strict=True)]
        return {"index": 0, "finish_reason": finish, "token_ids": ids,
                "logprobs": {"content": content} if p.logprobs else None}

    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        p = body.vllm_generate(await body.read_json(request), served.limits)
        if p.stream:
            def chunk(a: Arrival) -> dict:
                finish = a.outcome.finish_reason if a.outcome else None
                return {"request_id": p.request_id, "weight_version": a.weight_version,
                        "choices": [tokens_choice(a.token_ids, a.logprobs, finish, p)]}

            return stream(service, p, chunk)
        out: Outcome = await answer(request, service, p)
        return JSONResponse({"request_id": p.request_id, "weight_version": out.weight_version,
                             "choices": [tokens_choice(out.token_ids, out.logprobs, out.finish_reason, p)],
                             "prompt_logprobs": None, "usage": usage(p, len(out.token_ids))})

    # ------------------------------------------------------------ identity

    @app.get("/version")
    async def version() -> dict:
        return {"version": f"rollkeep-serve {rollkeep_version()}"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "owned_by": "rollkeep",
                                            "root": served.model_dir, "max_model_len": served.limits.context}]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        running, waiting = service.counts()
        label = f'{{model_name="{served.name}"}}'
        return PlainTextResponse(f"vllm:num_requests_running{label} {running}\n"
                                 f"vllm:num_requests_waiting{label} {waiting}\n" + finished_metrics(service))

    # ------------------------------------------------------------ control plane

    @app.post("/pause")
    async def pause(mode: str = "abort") -> dict:
        if mode not in ("abort", "wait", "keep"):
            raise BadRequest(f"mode must be abort, wait or keep, got {mode!r}")
        service.pause()
        if mode == "abort":
            service.abort_where(None)
        else:  # keep: rollkeep serve cannot freeze a batch, so it lets it finish, as wait does
            await service.until_no_running()
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict:
        service.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict:
        return {"is_paused": service.paused}

    @app.post("/abort_requests")
    async def abort_requests(request: Request) -> dict:
        b = await body.read_json(request, empty_ok=True)
        ids = b.get("request_ids")
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)):
            raise BadRequest("request_ids must be a list of strings (or absent: abort all)")
        return {"status": "aborted", "aborted": service.abort_where(None if ids is None else set(ids))}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> dict:
        b = await body.read_json(request)
        method, kwargs = b.get("method"), b.get("kwargs") or {}
        if method != "reload_weights":
            raise BadRequest(f"collective_rpc method {method!r} is not supported by rollkeep serve "
                             "(only reload_weights)")
        if not isinstance(kwargs, dict) or not isinstance(kwargs.get("weights_path"), str) or b.get("args"):
            raise BadRequest('reload_weights takes kwargs {"weights_path": DIR, "is_checkpoint_format": true}')
        try:
            await service.reloaded(kwargs["weights_path"])
        except UserInputError as e:
            raise BadRequest(f"reload_weights: {e}") from None
        return {"results": [None]}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict:
        new = (await body.read_json(request)).get("new_version")
        if not isinstance(new, str) or not new:
            raise BadRequest("new_version must be a non-empty string")
        service.set_label(new)
        return {"success": True, "new_version": new}

    @app.get("/weight_info")
    async def weight_info() -> dict:
        return {"weight_version": service.label()}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        return Response(status_code=200)  # no prefix cache: nothing to drop


error = vllm_error

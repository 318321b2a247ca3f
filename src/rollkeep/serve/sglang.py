"""The SGLang flavor: SGLang's routes and field names (docs/server-mode.md). Streams are
cumulative, as SGLang's are: every chunk holds all output tokens so far. rollkeep-only:
the `rollkeep` request field, and the `version` of `/get_server_info` naming rollkeep serve."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from ..core.errors import UserInputError
from ..engines.base import InfraError
from ..version import rollkeep_version
from . import body
from .body import BadRequest, GenParams
from .http import Served, Text, answer, finished_metrics, sglang_error, stream
from .service import Arrival, Service


def add_routes(app: FastAPI, service: Service, served: Served) -> None:
    tok = served.tokenizer

    def finish(p: GenParams, reason: str, ids: list[int]) -> dict:
        if reason == "stop":
            return {"type": "stop", "matched": ids[-1] if ids else served.eos}
        if reason == "length":
            return {"type": "length", "length": p.max_tokens}
        return {"type": "abort", "message": "Abort request"}

    def response(p: GenParams, text: str, ids: list[int], lps: list[float], reason: str | None,
                 label: str, started: float) -> dict:
        meta = {"id": p.request_id, "finish_reason": None if reason is None else finish(p, reason, ids),
                "prompt_tokens": len(p.ids), "completion_tokens": len(ids), "cached_tokens": 0,
                "weight_version": label, "e2e_latency": time.monotonic() - started}
        if p.logprobs:
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, lps, strict=True)]
        return {"text": text, "output_ids": ids, "meta_info": meta}

    # ------------------------------------------------------------ data plane

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        p = body.sglang_generate(await body.read_json(request), served.limits)
        started = time.monotonic()
        if p.stream:
            text, ids, lps = Text(tok), [], []

            def chunk(a: Arrival) -> dict:  # cumulative
                text.add(a.token_ids)
                ids.extend(a.token_ids)
                lps.extend(a.logprobs)
                reason = a.outcome.finish_reason if a.outcome else None
                return response(p, text.text, list(ids), list(lps), reason, a.weight_version, started)

            return stream(service, p, chunk)
        out = await answer(request, service, p)
        text = Text(tok)
        text.add(out.token_ids)
        return JSONResponse(response(p, text.text, out.token_ids, out.logprobs, out.finish_reason,
                                     out.weight_version, started))

    # ------------------------------------------------------------ identity

    def model_info() -> dict:
        return {"model_path": served.model_dir, "tokenizer_path": served.model_dir, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": service.label(),
                "context_length": served.limits.context}

    def server_info() -> dict:
        running, waiting = service.counts()
        return {"version": f"rollkeep-serve {rollkeep_version()}", "model_path": served.model_dir,
                "served_model_name": served.name, "context_length": served.limits.context,
                "tp_size": 1, "pp_size": 1, "dp_size": 1, "disaggregation_mode": "null",
                "max_running_requests": served.max_batch_size, "weight_version": service.label(),
                "internal_states": [{"num_running_reqs": running, "num_queue_reqs": waiting,
                                     "paused": service.paused}]}

    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, model_info, methods=["GET"])
    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, server_info, methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        try:
            await service.generated_one()
        except InfraError as e:
            return sglang_error(503, str(e))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        running, waiting = service.counts()
        label = f'{{model_name="{served.name}"}}'
        return PlainTextResponse(f"sglang:num_running_reqs{label} {running}\n"
                                 f"sglang:num_queue_reqs{label} {waiting}\n" + finished_metrics(service))

    # ------------------------------------------------------------ control plane

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict:
        b = await body.read_json(request)
        if b.get("abort_all") is True:
            service.abort_where(None)
        elif isinstance(b.get("rid"), str):
            service.abort_where({b["rid"]})
        else:
            raise BadRequest('abort_request takes {"rid": str} or {"abort_all": true}')
        return {}

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict:
        mode = (await body.read_json(request, empty_ok=True)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode must be abort, retract or in_place, got {mode!r}")
        service.pause()
        if mode == "abort":
            service.abort_where(None)
        else:  # rollkeep serve cannot hold a batch mid-way: it lets the running ones finish
            await service.until_no_running()
        return {"message": "Generation paused successfully.", "status": 200}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict:
        await body.read_json(request, empty_ok=True)
        service.resume()
        return {"message": "Generation continued successfully.", "status": 200}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict:
        return {"weight_version": service.label()}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict:
        b = await body.read_json(request)
        new = b.get("new_version")
        if not isinstance(new, str) or not new:
            raise BadRequest("new_version must be a non-empty string")
        if b.get("abort_all_requests", True) is not False:  # SGLang's default is true
            service.abort_where(None)
        service.set_label(new)
        return {"success": True, "message": f"Weight version updated to {new}.", "new_version": new}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        b = await body.read_json(request)
        path, label = b.get("model_path"), b.get("weight_version")
        if not isinstance(path, str) or (label is not None and not isinstance(label, str)):
            return JSONResponse({"success": False, "message": "model_path must be a string (and weight_version "
                                 "a string or absent)"}, status_code=400)
        if b.get("abort_all_requests") is True:
            service.abort_where(None)
        try:
            await service.reloaded(path, label)
        except UserInputError as e:
            return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400)
        return JSONResponse({"success": True, "message": "Succeeded to update model weights.",
                             "num_paused_requests": 0})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return PlainTextResponse("Cache flushed.\n")  # no prefix cache: nothing to drop


error = sglang_error

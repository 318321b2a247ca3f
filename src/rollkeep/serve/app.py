"""The FastAPI app of one flavor: its routes, and errors as JSON in its shape (a refused
request is 4xx and changes nothing; an unexpected failure is a 500, never a dead server)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..engines.base import InfraError
from . import sglang, vllm
from .body import BadRequest
from .http import Served
from .service import Service

FLAVORS = {"vllm": vllm, "sglang": sglang}


def build_app(service: Service, flavor: str, served: Served) -> FastAPI:
    module = FLAVORS[flavor]
    app = FastAPI(title=f"rollkeep serve ({flavor} flavor)", docs_url=None, redoc_url=None)
    error = module.error

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return error(exc.status, exc.message)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(InfraError)
    async def engine_failed(request: Request, exc: InfraError) -> JSONResponse:
        return error(500, str(exc))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:  # uvicorn logs the traceback
        return error(500, f"internal error: {type(exc).__name__}: {exc}")

    module.add_routes(app, service, served)
    return app

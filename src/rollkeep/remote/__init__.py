"""Server mode (`engine.name: remote`, docs/server-mode.md): generation on a fleet of vLLM or
SGLang servers (or `rollkeep serve`) over HTTP, driven by the same engine pool as Ray
replicas, so a server's loss and return are the pool's (`cluster.replicas`).

    wire.py       the two flavors' routes, bodies and checks, without IO
    server.py     one server: the fence, refit from a weight directory, streamed generation
    tokenizer.py  the servers' tokenizer, local

Weights go to the servers through the run directory (`cluster.weightdirs`:
RUN_DIR/weights/v<N>/, written atomically with a sha256 manifest): the trainer's weights of
each version are written once, every server reloads them and reports the label
`rollkeep:<N>:<digest>`, and a restarted controller reloads nothing on a server that still
holds the restored version.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from ..cluster.pool import EnginePool, ReplicaEvents
from ..cluster.replicas import ReplicaInfo
from ..core.custody.trace_schema import RunEvent, ServerBack, ServerLost
from ..core.errors import UserInputError

__all__ = ["ServerEvents", "remote_pool"]

KEEP_VERSIONS = 2  # weight directories kept: the current one and the one before it


class ServerEvents(ReplicaEvents):
    """The pool's events, named for servers: `server_lost`, `server_back` (each server's
    fence is traced by its handle: `server_fenced`)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls

    def started(self, i: int, info: ReplicaInfo, restarts: int, down: float | None) -> RunEvent | None:
        return ServerBack(server=self.urls[i], down_seconds=down) if restarts else None

    def died(self, i: int, reason: str, attempts_failed: int, gone: bool) -> RunEvent:
        return ServerLost(server=self.urls[i], reason=reason, attempts_failed=attempts_failed)

    def unavailable(self, timeout: float, alive: bool) -> str:
        return f"no server of engine.servers answered for engine.unavailable_timeout_s={timeout:g} s"

    not_started = unavailable


def remote_pool(section: Any, *, run_dir: Path, source_dir: str) -> EnginePool:
    """The run's engine in server mode: one handle per `engine.servers` URL behind a pool.
    `source_dir`: the trainer's model directory (its config, tokenizer and tensor names
    are what every weight directory holds)."""
    from ..cluster import weightdirs
    from .server import ServerHandle
    from .tokenizer import RemoteTokenizer

    headers = {}
    if section.api_key_env is not None:
        token = os.environ.get(section.api_key_env)
        if not token:
            raise UserInputError(
                f"engine.api_key_env names the environment variable {section.api_key_env}, which is not set",
                field="engine.api_key_env", expected="the variable set to the servers' bearer token",
                found="unset or empty", remedy=f"export {section.api_key_env}=... before the run, or unset engine.api_key_env")
        headers["authorization"] = f"Bearer {token}"
    tok = RemoteTokenizer(section.tokenizer_path, chat_template=section.chat_template)
    pool: EnginePool | None = None

    def emit(ev: RunEvent) -> None:
        pool._trace(ev)  # type: ignore[union-attr]  # (held until the run's trace is attached)

    handles = [ServerHandle(i, url, section, tok, headers=headers, emit=emit) for i, url in enumerate(section.servers)]

    async def publish(weights: Any, version: int) -> Any:
        def write() -> Any:
            published = weightdirs.publish(run_dir, version, weights, source_dir=source_dir)
            weightdirs.retain(run_dir, set(range(max(0, version - KEEP_VERSIONS + 1), version + 1)))
            return published

        return await asyncio.to_thread(write)

    pool = EnginePool(handles, publish=publish, max_restarts=2**62, replica_timeout_s=section.unavailable_timeout_s,
                      events=ServerEvents(list(section.servers)))
    pool.servers = tuple(section.servers)
    return pool

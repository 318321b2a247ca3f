"""The sandbox server: the state of `rollkeep.envs.sandbox` episodes, outside the run.

    python -m rollkeep.envs.sandbox_server [--port 0] [--idle-timeout-s 600]

It listens on 127.0.0.1 only (port 0: a free one), prints one line `{"port": N}` on stdout
once it serves, and stops by itself when no request came for `--idle-timeout-s` seconds,
when its parent process exits (start it from the shell or the launcher that runs the
training), or on SIGINT/SIGTERM. Needs fastapi and uvicorn (the `serve` extra).

    POST /open {seed, prompt}   -> {"session": id}    a new session (no code yet)
    POST /run {session, code}   -> {"stdout", "ok", "error"}
                                   runs the session's code so far, then `code`, in a fresh
                                   `python -I` process; `code` joins the session's code only
                                   if it ran (exit status 0 within the limits). Only the new
                                   code's stdout is returned (the earlier code's went to
                                   /dev/null: it was returned when it ran); `error` is the
                                   tail of stderr, or why the run was stopped, "" if ok
    GET /stats                  -> {"calls": {key: n}, "executions": {key: n}, "sessions": n}
                                   requests received and runs actually executed, by
                                   Idempotency-Key ("" for requests without one)

De-duplication: a POST with an `Idempotency-Key` header is answered once per (route, key,
body): a repeat gets the stored answer without running anything (a repeat that arrives
while the first is still running waits for its answer). The body is part of the match
because rollkeep's keys name a place in an episode, not a request: a resumed attempt that
asks something else at the same place (a turn regenerated after a kill) must be run, not
answered with the old turn's output. Without the header every request is its own.

Limits of one run (the options): `--run-timeout-s` wall-clock seconds (a CPU-time limit a
second above it is the backstop), `--memory-mib` of address space, `--max-output-bytes` of
stdout and of stderr each (past it the run is stopped: ok false). `random` is seeded with
the session's seed before the session's code runs, so a run is a function of (seed, code)
unless the code reads the clock or the outside. This bounds time, memory and output and isolates Python's paths;
it is not a security boundary (the code runs as this user, in a scratch directory of the
server's): run untrusted code inside a container or VM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Header
from fastapi.responses import JSONResponse
from pydantic import BaseModel

HOST = "127.0.0.1"
STDERR_TAIL = 2000  # characters of stderr in `error`: the traceback's end says what went wrong

# The program a run executes (`python -I -c RUNNER MEMORY CPU_S`, the request on stdin as
# JSON {seed, blocks}). The limits are set hard as well as soft, so the code cannot raise them.
RUNNER = """\
import json, os, random, resource, sys
memory, cpu_s = int(sys.argv[1]), int(sys.argv[2])
job = json.loads(sys.stdin.read())
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
random.seed(job["seed"])
scope = {"__name__": "__main__", "__builtins__": __builtins__}
real, sys.stdout = sys.stdout, open(os.devnull, "w")
for i, block in enumerate(job["blocks"]):
    if i == len(job["blocks"]) - 1:
        sys.stdout = real
    exec(compile(block, f"<cell {i}>", "exec"), scope)
"""


@dataclass(frozen=True)
class Limits:
    run_timeout_s: float = 5.0
    memory_bytes: int = 512 << 20
    max_output_bytes: int = 16 << 10
    max_code_bytes: int = 64 << 10  # of one /run's code
    max_session_bytes: int = 1 << 20  # of a session's code, all its runs together
    max_sessions: int = 10_000


@dataclass
class Session:
    seed: int
    prompt: str
    blocks: list[str] = field(default_factory=list)  # the code that ran, in order
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one run at a time: each builds on the last

    def size(self) -> int:
        return sum(len(b.encode()) for b in self.blocks)


class OpenBody(BaseModel):
    seed: int
    prompt: str


class RunBody(BaseModel):
    session: str
    code: str


class Refused(Exception):
    """A request the server does not run (answered with `status` and {"error": message})."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Sandbox:
    """The sessions, the answers by key, and the counts /stats reports. Used from the
    server's event loop only."""

    def __init__(self, limits: Limits, workdir: str) -> None:
        self.limits, self.workdir = limits, workdir
        self.sessions: dict[str, Session] = {}
        self._answers: dict[tuple[str, str], tuple[str, asyncio.Future[dict[str, Any]]]] = {}
        self.calls: Counter[str] = Counter()
        self.executions: Counter[str] = Counter()
        self.last_request = time.monotonic()

    async def once(self, route: str, key: str | None, body: BaseModel,
                   work: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """`work()`'s answer, or the stored answer of the request first made with this key
        and body. A refusal (`Refused`) is not stored: a repeat is tried again."""
        self.last_request = time.monotonic()
        self.calls[key or ""] += 1
        if key is None:
            return await work()
        digest = hashlib.sha256(body.model_dump_json().encode()).hexdigest()
        stored = self._answers.get((route, key))
        if stored is not None and stored[0] == digest:
            return await asyncio.shield(stored[1])
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._answers[(route, key)] = (digest, answer)
        try:
            answer.set_result(await work())
        except BaseException as e:
            if self._answers.get((route, key), (None, None))[1] is answer:
                del self._answers[(route, key)]
            if isinstance(e, asyncio.CancelledError):
                answer.cancel()
            else:
                answer.set_exception(e)
                answer.exception()  # retrieved: a refusal nobody else waited for is no asyncio warning
            raise
        return answer.result()

    def open(self, key: str | None, body: OpenBody) -> dict[str, Any]:
        if len(self.sessions) >= self.limits.max_sessions:
            raise Refused(503, f"the server holds {len(self.sessions)} sessions, its most (restart it to free them)")
        sid = secrets.token_hex(8)
        self.sessions[sid] = Session(body.seed, body.prompt)
        self.executions[key or ""] += 1
        return {"session": sid}

    async def run(self, key: str | None, body: RunBody) -> dict[str, Any]:
        session = self.sessions.get(body.session)
        if session is None:
            raise Refused(404, f"no session {body.session!r} (sessions do not outlive the server)")
        if len(body.code.encode()) > self.limits.max_code_bytes:
            raise Refused(413, f"the code is over {self.limits.max_code_bytes} bytes")
        async with session.lock:
            if session.size() + len(body.code.encode()) > self.limits.max_session_bytes:
                return {"stdout": "", "ok": False, "error": f"the session's code would be over "
                        f"{self.limits.max_session_bytes} bytes: open a new session"}
            self.executions[key or ""] += 1
            answer = await execute([*session.blocks, body.code], session.seed, self.limits, self.workdir)
            if answer["ok"]:
                session.blocks.append(body.code)
            return answer

    def stats(self) -> dict[str, Any]:
        self.last_request = time.monotonic()
        return {"calls": dict(self.calls), "executions": dict(self.executions), "sessions": len(self.sessions)}


async def execute(blocks: list[str], seed: int, limits: Limits, workdir: str) -> dict[str, Any]:
    """Run `blocks` (the last one's stdout returned) in a fresh `python -I` process within
    `limits`; see the module docstring."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-c", RUNNER, str(limits.memory_bytes), str(math.ceil(limits.run_timeout_s) + 1),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=workdir, env={}, start_new_session=True)  # its own process group: a kill takes its children too
    stopped: list[str] = []

    def stop(why: str) -> None:
        stopped.append(why)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    async def read(stream: asyncio.StreamReader, name: str) -> bytes:
        data = bytearray()
        while chunk := await stream.read(1 << 16):
            data += chunk
            if len(data) > limits.max_output_bytes:
                stop(f"{name} over {limits.max_output_bytes} bytes")
                return bytes(data[: limits.max_output_bytes])
        return bytes(data)

    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        async with asyncio.timeout(limits.run_timeout_s):
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it died before reading
                proc.stdin.write(json.dumps({"seed": seed, "blocks": blocks}).encode())
                await proc.stdin.drain()
                proc.stdin.close()
            out, err = await asyncio.gather(read(proc.stdout, "stdout"), read(proc.stderr, "stderr"))
            status = await proc.wait()
    except TimeoutError:
        stop(f"timed out after {limits.run_timeout_s:g} s")
        out, err, status = b"", b"", None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything it left behind in its group
        await proc.wait()
    ok = not stopped and status == 0
    if stopped:
        error = stopped[0]
    elif status is not None and status < 0:  # a signal: the CPU limit (SIGXCPU), the kernel, the code itself
        error = f"killed by {signal.Signals(-status).name}"
    elif status != 0:
        error = err.decode("utf-8", "replace")[-STDERR_TAIL:] or f"exit status {status}"
    else:
        error = ""
    return {"stdout": out.decode("utf-8", "replace"), "ok": ok, "error": error}


def build_app(sandbox: Sandbox) -> FastAPI:
    app = FastAPI(title="sandbox server (rollkeep.envs)", docs_url=None, redoc_url=None, openapi_url=None)

    async def answer(route: str, key: str | None, body: BaseModel,
                     work: Callable[[], Awaitable[dict[str, Any]]]) -> Any:
        try:
            return await sandbox.once(route, key, body, work)
        except Refused as e:
            return JSONResponse({"error": str(e)}, status_code=e.status)

    @app.post("/open")
    async def open_session(body: OpenBody, idempotency_key: str | None = Header(None)) -> Any:
        async def work() -> dict[str, Any]:
            return sandbox.open(idempotency_key, body)
        return await answer("open", idempotency_key, body, work)

    @app.post("/run")
    async def run(body: RunBody, idempotency_key: str | None = Header(None)) -> Any:
        return await answer("run", idempotency_key, body, lambda: sandbox.run(idempotency_key, body))

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return sandbox.stats()

    return app


class _Server(uvicorn.Server):
    """uvicorn, announcing its port once it serves, and stopping when idle or orphaned."""

    def __init__(self, app: FastAPI, sandbox: Sandbox, *, port: int, idle_timeout_s: float, parent: int) -> None:
        super().__init__(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=2))
        self._sandbox, self._port, self._idle_timeout_s, self._parent = sandbox, port, idle_timeout_s, parent
        self.stopped_by = "a signal"

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            print(json.dumps({"port": self._port}), flush=True)

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit:
            if os.getppid() != self._parent:
                self.stopped_by, self.should_exit = "the parent process exited", True
            elif time.monotonic() - self._sandbox.last_request > self._idle_timeout_s:
                self.stopped_by, self.should_exit = f"idle for {self._idle_timeout_s:g} s", True
        return await super().on_tick(counter)


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)  # the runs must not hold the port
    return sock


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rollkeep.envs.sandbox_server", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example: python -m rollkeep.envs.sandbox_server --port 8765 &")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default 0: a free one)")
    p.add_argument("--idle-timeout-s", type=float, default=600.0, help="stop after this long without a request")
    p.add_argument("--run-timeout-s", type=float, default=Limits.run_timeout_s, help="wall-clock limit of one run")
    p.add_argument("--memory-mib", type=int, default=Limits.memory_bytes >> 20, help="address space of one run")
    p.add_argument("--max-output-bytes", type=int, default=Limits.max_output_bytes,
                   help="stdout (and stderr) of one run; past it the run is stopped")
    a = p.parse_args(argv)
    if not 0 <= a.port <= 65535:
        p.error(f"--port {a.port} is out of range: 0 to 65535 (0: a free port)")
    for name in ("idle_timeout_s", "run_timeout_s", "memory_mib", "max_output_bytes"):
        if not getattr(a, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    limits = Limits(run_timeout_s=a.run_timeout_s, memory_bytes=a.memory_mib << 20, max_output_bytes=a.max_output_bytes)
    parent = os.getppid()
    try:
        sock = _listen(a.port)
    except OSError as e:
        print(f"sandbox server: cannot listen on {HOST}:{a.port}: {e} (pick another --port, or 0)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rollkeep-sandbox-") as workdir:
        sandbox = Sandbox(limits, workdir)
        server = _Server(build_app(sandbox), sandbox, port=sock.getsockname()[1], idle_timeout_s=a.idle_timeout_s,
                         parent=parent)
        asyncio.run(server.serve(sockets=[sock]))
    print(f"sandbox server: stopped ({server.stopped_by})", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Servers for the effect examples' tests (named `effect_servers`, not `servers`: the test
helpers are imported by module name, and tests/remote has a `servers`).

    FakeJudge        an OpenAI-compatible judge (POST /v1/completions) on a loopback port, in
                     a thread of the test process, that can be told to misbehave (`MODES`)
    SandboxServer    `python -m rollkeep.envs.sandbox_server` as a subprocess, waited for on
                     the `{"port": N}` line it prints (never a fixed sleep), killed at stop
    RecordingScope   a stand-in for the runner's effect scope (`rollkeep.effects.Scope`):
                     keys, a record, and replay from it, without a run

The fake judge's rule, read from `rollkeep.tasks.judge.PROMPT`: the verdict is "1" when the
"Reference answer:" line's value occurs as a whole word in what follows "Answer to grade:",
else "0" (and "0" when the prompt has no reference answer). Every request is counted by its
`Idempotency-Key` header ("" for none): GET /stats -> {"calls": {key: n}}.

Run as a script (`python tests/effects/effect_servers.py [--mode M]`) it serves a fake judge
in the foreground and prints `{"port": N}`, like the sandbox server.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[2]

# ok: answers by the rule above; hang: never answers (until stop); garbage: a body that is
# not JSON; not_object: JSON, a list; no_choices: {"choices": []}; huge: 2 MiB of JSON with
# its Content-Length; huge_stream: the same without one (read until the connection closes);
# error500: HTTP 500.
MODES = ("ok", "hang", "garbage", "not_object", "no_choices", "huge", "huge_stream", "error500")
HUGE_BYTES = 2 << 20

_REFERENCE = re.compile(r"^Reference answer: (.*)$", re.MULTILINE)
_GRADED = re.compile(r"Answer to grade: (.*)\n\nVerdict", re.DOTALL)


def fake_verdict(prompt: str) -> str:
    """The fake judge's text for `prompt` (the rule in the module docstring)."""
    ref, graded = _REFERENCE.search(prompt), _GRADED.search(prompt)
    if ref is None or graded is None or not ref.group(1).strip():
        return "0"
    answer = re.escape(ref.group(1).strip())
    return "1" if re.search(rf"(?<!\w){answer}(?!\w)", graded.group(1)) else "0"


class FakeJudge:
    """The fake judge on 127.0.0.1 (a free port), serving from daemon threads; `mode` may
    be changed while it runs. Use as a context manager, or `start()` and `stop()`."""

    def __init__(self, mode: str = "ok") -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        self.mode = mode
        self.calls: Counter[str] = Counter()
        self.bodies: list[dict[str, Any]] = []
        self._stopping = threading.Event()  # releases the requests that `hang`
        self._lock = threading.Lock()
        self._httpd = _Quiet(("127.0.0.1", 0), _handler(self))
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="fake-judge", daemon=True)  # `stop` waits for a poll

    def start(self) -> FakeJudge:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def __enter__(self) -> FakeJudge:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def answer(self, path: str, key: str, body: bytes) -> tuple[int, dict[str, str], bytes] | None:
        """(status, headers, body) for a request; None: never answer (`hang`)."""
        if path == "/stats":
            with self._lock:
                return 200, {}, json.dumps({"calls": dict(self.calls)}).encode()
        if path != "/v1/completions":
            return 404, {}, b'{"error": "not found"}'
        with self._lock:
            self.calls[key] += 1
        mode = self.mode
        if mode == "hang":
            self._stopping.wait()
            return None
        if mode == "error500":
            return 500, {}, b'{"error": "internal error"}'
        if mode == "garbage":
            return 200, {}, b"<html>not json{"
        if mode == "not_object":
            return 200, {}, b'["1"]'
        if mode == "no_choices":
            return 200, {}, b'{"choices": []}'
        if mode in ("huge", "huge_stream"):
            pad = json.dumps({"choices": [{"text": "1"}], "pad": "x" * HUGE_BYTES}).encode()
            return 200, ({"connection": "close"} if mode == "huge_stream" else {}), pad
        request = json.loads(body)
        with self._lock:
            self.bodies.append(request)
        text = fake_verdict(request["prompt"])
        return 200, {}, json.dumps({"id": "cmpl-fake", "object": "text_completion", "model": request["model"],
                                    "choices": [{"index": 0, "text": text, "finish_reason": "stop"}]}).encode()


class _Quiet(ThreadingHTTPServer):
    """Handler threads that do not hold up the exit, and no traceback on stderr when a
    client hangs up first (the bound and timeout tests do that on purpose)."""

    daemon_threads = True
    request_queue_size = 1024  # a run asks many at once (socketserver's default of 5 resets them)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _handler(judge: FakeJudge) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._serve(b"")

        def do_POST(self) -> None:
            self._serve(self.rfile.read(int(self.headers.get("content-length") or 0)))

        def _serve(self, body: bytes) -> None:
            out = judge.answer(self.path, self.headers.get("idempotency-key") or "", body)
            if out is None:
                self.close_connection = True
                return
            status, headers, data = out
            self.send_response(status)
            self.send_header("content-type", "application/json")
            if headers.get("connection") == "close":  # the body ends when the connection does
                self.send_header("connection", "close")
                self.close_connection = True
            else:
                self.send_header("content-length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a bound on its side)
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
            pass

    return Handler


class SandboxServer:
    """`python -m rollkeep.envs.sandbox_server` on a free loopback port, in a session of its
    own (`stop` kills the group). Its stderr goes to `log`."""

    def __init__(self, workdir: Path, *args: str, startup_s: float = 30.0) -> None:
        self.log_path = workdir / f"sandbox-{time.monotonic_ns()}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "rollkeep.envs.sandbox_server", "--port", "0", *args],
                                         stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        try:
            self.port = read_port(self.proc, startup_s, self.output)
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> SandboxServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_port(proc: subprocess.Popen, timeout_s: float, output: Callable[[], str]) -> int:
    """The port of the `{"port": N}` line `proc` prints first on stdout, waited for up to
    `timeout_s` (an exit or a silence past it is an error showing its stderr)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else b""
    if not line:
        status = proc.poll()
        why = f"exited {status}" if status is not None else f"printed nothing within {timeout_s:g} s"
        raise RuntimeError(f"the server {why}: {output()}")
    return int(json.loads(line)["port"])


class RecordingScope:
    """The runner's part of `rollkeep.effects`, reduced to what the examples rely on: the
    n-th call of an attempt gets the key f"{prefix}-{n}" (made on a worker thread if `fn` is
    synchronous, as the runner does), its result is recorded by (n, kind, request), and
    after `replay()` the same calls are answered from the record without calling `fn`.
    `loop` is the loop the calls run on (`call_sync` submits to it from other threads)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prefix: str = "k") -> None:
        self.loop, self.prefix = loop, prefix
        self.record: dict[tuple[int, str, bytes], bytes] = {}
        self.made = self.answered = 0
        self._next = 0

    def replay(self) -> None:
        """The next calls are a restored attempt's: from the first call again."""
        self._next = 0

    async def call(self, kind: str, request: Any, body: bytes, fn: Callable[..., Any], policy: str) -> Any:
        n, self._next = self._next, self._next + 1
        place = (n, kind, body)
        if place in self.record:
            self.answered += 1
        else:
            key = f"{self.prefix}-{n}"
            if inspect.iscoroutinefunction(fn):
                value = await fn(request, key)
            else:
                value = await asyncio.to_thread(fn, request, key)
            self.made += 1
            self.record[place] = msgspec.json.encode(value)
        return msgspec.json.decode(self.record[place])


def main() -> int:
    p = argparse.ArgumentParser(description="a fake OpenAI-compatible judge on 127.0.0.1")
    p.add_argument("--mode", choices=MODES, default="ok")
    judge = FakeJudge(p.parse_args().mode)
    print(json.dumps({"port": judge.port}), flush=True)
    try:
        judge._httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

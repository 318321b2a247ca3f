"""Helpers of the `rollkeep serve` tests: a real server process (waited on through its port
file, stopped in `finally`), and a client that speaks either flavor and returns what a
generation gave in one shape."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import rollkeep

SRC = str(Path(rollkeep.__file__).resolve().parents[1])
CONTEXT = 4096  # of the test model: room for a generation still running when a test aborts it
START_DEADLINE = 180.0  # s: torch's import alone takes seconds on a loaded machine


def until(condition: Callable[[], Any], what: str, deadline: float = 30.0) -> Any:
    """Poll `condition` until it is truthy (its value is returned) or the deadline passes."""
    end = time.monotonic() + deadline
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@dataclass
class Server:
    url: str
    flavor: str
    log: Path
    pid: int

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": SRC + (os.pathsep + path if path else "")}


def command(model_dir: Path, flavor: str, port_file: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rollkeep", "serve", str(model_dir), "--flavor", flavor, "--port", "0",
            "--port-file", str(port_file), "--exit-with-parent", *extra]


def _wait_for_port(port_file: Path, alive: Callable[[], bool], log: Path) -> int:
    def ready() -> int | None:
        if port_file.exists():
            return int(port_file.read_text())
        if not alive():
            raise AssertionError(f"rollkeep serve exited before listening:\n{log.read_text(errors='replace')}")
        return None

    return until(ready, "the server's port file", START_DEADLINE)


class Started:
    """A `rollkeep serve` child process, started at once and waited on by `ready()`, so
    several servers start side by side. `stop()` sends SIGTERM: it must stop by itself,
    cleanly (exit 0). `kill()` (in `finally`) ends whatever is still running."""

    def __init__(self, model_dir: Path, flavor: str, tmp: Path, *extra: str) -> None:
        self.port_file, self.log = tmp / f"{flavor}.port", tmp / f"{flavor}.log"
        self.flavor = flavor
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(command(model_dir, flavor, self.port_file, *extra), stdout=out,
                                         stderr=subprocess.STDOUT, env=_env())

    def ready(self) -> Server:
        port = _wait_for_port(self.port_file, lambda: self.proc.poll() is None, self.log)
        return Server(f"http://127.0.0.1:{port}", self.flavor, self.log, self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=30)
        assert rc == 0 and "stopped (SIGTERM)" in self.log.read_text(), self.log.read_text()
        assert not self.port_file.exists()  # a stopped server leaves no port to connect to

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Orphanable:
    """A server started by an intermediate parent process: `end_parent()` ends that
    parent, after which the server (--exit-with-parent) must stop by itself."""

    def __init__(self, model_dir: Path, flavor: str, tmp: Path) -> None:
        self.port_file, self.log = tmp / f"{flavor}.port", tmp / f"{flavor}.log"
        self.flavor = flavor
        code = ("import subprocess, sys\n"
                "out = open(sys.argv[1], 'wb')\n"
                "p = subprocess.Popen(sys.argv[2:], stdout=out, stderr=subprocess.STDOUT)\n"
                "print(p.pid, flush=True)\n"
                "sys.stdin.read()\n")
        self.parent = subprocess.Popen([sys.executable, "-c", code, str(self.log),
                                        *command(model_dir, flavor, self.port_file)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env())
        self.pid = int(self.parent.stdout.readline())

    def ready(self) -> Server:
        port = _wait_for_port(self.port_file, lambda: _alive(self.pid), self.log)
        return Server(f"http://127.0.0.1:{port}", self.flavor, self.log, self.pid)

    def end_parent(self) -> None:
        self.parent.stdin.close()
        self.parent.wait(timeout=30)
        until(lambda: not _alive(self.pid), "the server to stop after its parent", 30)
        assert "stopped (the parent process exited)" in self.log.read_text(), self.log.read_text()

    def kill(self) -> None:
        if self.parent.poll() is None:
            self.parent.kill()
            self.parent.wait()
        if _alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not reaped by its new parent, does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


# ---------------------------------------------------------------- one client, two flavors

@dataclass
class Gen:
    """A generation as a client sees it (the tokens, whole or accumulated from a stream)."""

    ids: list[int]
    logprobs: list[float]
    finish: str | None
    version: str | None
    chunks: int = 0


class Client:
    """Generation and control in either flavor; vLLM's data plane by `route`
    ("completions" or "generate")."""

    def __init__(self, srv: Server, route: str = "completions") -> None:
        self.srv, self.flavor, self.route = srv, srv.flavor, route
        self.http = httpx.Client(base_url=srv.url, timeout=60)

    def close(self) -> None:
        self.http.close()

    # -- data plane

    def request(self, ids: list[int], *, seed: int, max_tokens: int, temperature: float, top_p: float = 1.0,
                prompt_tokens: int | None = None, stream: bool = False, ignore_eos: bool = False,
                rid: str | None = None) -> tuple[str, dict]:
        ext = {"rollkeep": {"prompt_tokens": prompt_tokens}} if prompt_tokens is not None else {}
        if self.flavor == "sglang":
            sp = {"max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "sampling_seed": seed,
                  "ignore_eos": ignore_eos}
            return "/generate", {"input_ids": ids, "sampling_params": sp, "return_logprob": True, "stream": stream,
                                 **({"rid": rid} if rid else {}), **ext}
        if self.route == "generate":
            sp = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed, "logprobs": 0,
                  "ignore_eos": ignore_eos}
            return "/inference/v1/generate", {"token_ids": ids, "sampling_params": sp, "stream": stream,
                                              **({"request_id": rid} if rid else {}), **ext}
        return "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": temperature,
                                   "top_p": top_p, "seed": seed, "logprobs": 0, "return_token_ids": True,
                                   "add_special_tokens": False, "stream": stream, "ignore_eos": ignore_eos,
                                   **({"request_id": rid} if rid else {}), **ext}

    def generate(self, ids: list[int], **kw: Any) -> Gen:
        path, body = self.request(ids, **kw)
        if body.get("stream"):
            with self.stream_chunks(ids, **kw) as chunks:
                for g in chunks:
                    if g.finish is not None:
                        return g
            raise AssertionError("the stream ended without a finish reason")
        r = self.http.post(path, json=body)
        assert r.status_code == 200, r.text
        return self.parse(r.json())

    @contextlib.contextmanager
    def stream_chunks(self, ids: list[int], **kw: Any) -> Iterator[Iterator[Gen]]:
        """The stream's progress after each chunk, cumulative (deltas are joined here);
        checks the SSE framing and the [DONE] after the last chunk."""
        path, body = self.request(ids, **{**kw, "stream": True})
        with self.http.stream("POST", path, json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")

            def chunks() -> Iterator[Gen]:
                acc = Gen([], [], None, None)
                done = False
                for line in r.iter_lines():
                    if not line:
                        continue
                    assert line.startswith("data: ") and not done, line
                    if line == "data: [DONE]":
                        done = True
                        continue
                    assert acc.finish is None, "a chunk after the one with the finish reason"
                    g = self.parse(json.loads(line[6:]))
                    if self.flavor == "sglang":  # cumulative chunks
                        assert g.ids[: len(acc.ids)] == acc.ids
                        acc = Gen(g.ids, g.logprobs, g.finish, g.version, acc.chunks + 1)
                    else:
                        acc = Gen(acc.ids + g.ids, acc.logprobs + g.logprobs, g.finish, g.version, acc.chunks + 1)
                    yield acc
                assert done, "the stream did not end with data: [DONE]"

            yield chunks()

    def parse(self, j: dict) -> Gen:
        if self.flavor == "sglang":
            meta = j["meta_info"]
            assert [t for _, t, _ in meta["output_token_logprobs"]] == j["output_ids"]
            finish = meta["finish_reason"]["type"] if meta["finish_reason"] else None
            return Gen(j["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]], finish,
                       meta["weight_version"])
        choice = j["choices"][0]
        if self.route == "generate":
            content = choice["logprobs"]["content"]
            assert [c["token_id"] for c in content] == choice["token_ids"]
            return Gen(choice["token_ids"], [c["logprob"] for c in content], choice["finish_reason"],
                       j["weight_version"])
        return Gen(choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["finish_reason"],
                   j["weight_version"])

    # -- control plane

    def abort(self, rid: str | None = None) -> None:
        if self.flavor == "sglang":
            r = self.http.post("/abort_request", json={"rid": rid} if rid else {"abort_all": True})
        else:
            r = self.http.post("/abort_requests", json={"request_ids": [rid]} if rid else {})
            assert r.json()["status"] == "aborted"
        assert r.status_code == 200, r.text

    def pause_abort(self) -> None:
        if self.flavor == "sglang":
            r = self.http.post("/pause_generation", json={"mode": "abort"})
        else:
            r = self.http.post("/pause", params={"mode": "abort"})
            assert r.json() == {"status": "paused"}
        assert r.status_code == 200, r.text

    def resume(self) -> None:
        r = self.http.post("/continue_generation" if self.flavor == "sglang" else "/resume", json={})
        assert r.status_code == 200, r.text

    def metrics(self) -> dict[str, int]:
        """/metrics by name (a finished count by `finished_total:<reason>`)."""
        values = {}
        for line in self.http.get("/metrics").text.splitlines():
            name, _, value = line.partition(" ")
            base, _, labels = name.partition("{")
            if base == "rollkeep:requests_finished_total":
                base = "finished_total:" + labels.split('"')[1]
            values[base] = int(float(value))
        return values

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        names = (("sglang:num_running_reqs", "sglang:num_queue_reqs") if self.flavor == "sglang"
                 else ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        values = self.metrics()
        return values[names[0]], values[names[1]]

    def version(self) -> str:
        return self.http.get("/get_weight_version" if self.flavor == "sglang" else "/weight_info").json()[
            "weight_version"]

    def set_version(self, label: str) -> None:
        body = {"new_version": label} | ({"abort_all_requests": False} if self.flavor == "sglang" else {})
        r = self.http.post("/update_weight_version", json=body)
        assert r.status_code == 200 and r.json()["success"] is True, r.text

    def reload(self, path: Path | str, label: str | None = None) -> httpx.Response:
        if self.flavor == "sglang":
            return self.http.post("/update_weights_from_disk", json={
                "model_path": str(path), "abort_all_requests": False, "flush_cache": True,
                **({"weight_version": label} if label else {})})
        r = self.http.post("/collective_rpc", json={
            "method": "reload_weights", "kwargs": {"weights_path": str(path), "is_checkpoint_format": True}})
        if r.status_code == 200 and label:
            self.set_version(label)
        return r


class InThread:
    """A call on its own thread (a request that blocks), joined with a deadline."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as e:  # re-raised by join
            self.error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout: float = 60) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the call did not return"
        if self.error is not None:
            raise self.error
        return self.result

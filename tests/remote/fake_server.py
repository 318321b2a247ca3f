"""A fake inference server of either flavor as an httpx transport (no sockets): it speaks
the routes and fields of docs/server-mode.md, generates tokens that are a function of the
ids, the seed and the weights it holds, and can be told to misbehave in every way the
remote engine must refuse (`hostile`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

VOCAB = 40


def token(weights: str, ids: list[int], seed: int, i: int) -> int:
    return (sum(ids) * 31 + seed * 7 + i * 13 + len(weights)) % (VOCAB - 4) + 4  # never a special id


@dataclass
class FakeServer:
    flavor: str = "vllm"
    label: str = "default"
    weights: str = "initial"  # what a generation depends on: the directory it reloaded last
    paused: bool = False
    hostile: str | None = None  # see `_hostile`
    down: bool = False  # every request is refused (connection error)
    calls: list[tuple[str, str]] = field(default_factory=list)
    running: dict[str, asyncio.Event] = field(default_factory=dict)  # rid -> set to abort it
    hold: asyncio.Event | None = None  # if set, streams wait on it after their first token
    aborted_total: int = 0
    scale_out: bool = False  # it serves /inference/v1/generate (vLLM started with --enable-scale-out)
    eos: int = 5  # the id that ends a generation ("stop"); -1: none does

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, req: httpx.Request) -> httpx.Response:
        path = req.url.path
        self.calls.append((req.method, path))
        if self.down:
            raise httpx.ConnectError("connection refused", request=req)
        body = json.loads(req.content) if req.content else {}
        v = self.flavor == "vllm"
        routes = {
            "/version": lambda: {"version": "0.32.0"},
            "/get_server_info": lambda: {"version": "0.5.9"},
            "/abort_requests": lambda: self._abort(body.get("request_ids")),
            "/abort_request": lambda: self._abort(None if body.get("abort_all") else [body.get("rid")]),
            "/pause": lambda: self._pause(),
            "/pause_generation": lambda: self._pause(),
            "/resume": lambda: self._resume(),
            "/continue_generation": lambda: self._resume(),
            "/weight_info": lambda: {"weight_version": self.label},
            "/get_weight_version": lambda: {"weight_version": self.label},
            "/update_weight_version": lambda: self._set_label(body["new_version"]),
            "/collective_rpc": lambda: self._reload(body["kwargs"]["weights_path"], None),
            "/update_weights_from_disk": lambda: self._reload(body["model_path"], body["weight_version"]),
            "/reset_prefix_cache": lambda: {},
            "/v1/models": lambda: {"object": "list", "data": [{"id": "/models/tiny", "max_model_len": 64}]},
        }
        if path in routes:
            return httpx.Response(200, json=routes[path]())
        if path == "/inference/v1/generate" and self.scale_out:
            return await self._generate(body, v, tokens_route=True)
        if path in ("/v1/completions", "/generate"):
            return await self._generate(body, v)
        return httpx.Response(404, json={"error": "not found"})

    # -- control -------------------------------------------------------------------------

    def _abort(self, rids: list[str] | None) -> dict:
        hit = [r for r in self.running if rids is None or r in rids]
        for r in hit:
            self.running[r].set()
        self.aborted_total += len(hit)
        return {"status": "aborted", "aborted": len(hit)}

    def _pause(self) -> dict:
        self.paused = True
        self._abort(None)
        return {"status": "paused"}

    def _resume(self) -> dict:
        self.paused = False
        return {"status": "resumed"}

    def _set_label(self, label: str) -> dict:
        self.label = label
        return {"success": True, "new_version": label}

    def _reload(self, path: str, label: str | None) -> dict:
        if self.hostile == "reload_fails":
            return {"success": False, "message": "cannot load"}
        self.weights = path
        if label is not None:
            self.label = label
        return {"success": True, "results": [None]}

    # -- data plane ----------------------------------------------------------------------

    async def _generate(self, body: dict, v: bool, tokens_route: bool = False) -> httpx.Response:
        if self.hostile == "status_500":
            return httpx.Response(500, text="internal error")
        if self.hostile == "redirect":
            return httpx.Response(307, headers={"location": "http://elsewhere/"})
        if tokens_route:
            sp = body["sampling_params"]
            ids, n, seed, rid = body["token_ids"], sp["max_tokens"], sp["seed"], body["request_id"]
        elif v:
            ids, n, seed, rid = body["prompt"], body["max_tokens"], body["seed"], body["request_id"]
        else:
            sp = body["sampling_params"]
            ids, n, seed, rid = body["input_ids"], sp["max_new_tokens"], sp["sampling_seed"], body["rid"]
        ext = body.get("rollkeep")
        start = len(ids) - ext["prompt_tokens"] if ext else 0  # sampling position of the first new token
        prompt = ids[: ext["prompt_tokens"]] if ext else ids
        abort = self.running[rid] = asyncio.Event()
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              stream=_Stream(self._events(prompt, start, n, seed, rid, abort, v, tokens_route)))

    async def _events(self, prompt: list[int], start: int, n: int, seed: int, rid: str, abort: asyncio.Event,
                      v: bool, tokens_route: bool = False) -> AsyncIterator[bytes]:
        try:
            out: list[tuple[int, float]] = []
            for i in range(n):
                if abort.is_set():
                    yield self._chunk(v, out, [], "abort", tokens_route)
                    break
                t = token(self.weights, prompt, seed, start + i)
                new = [(t, -0.5)]
                if self.hostile == "hang":
                    await asyncio.Event().wait()
                new = self._hostile(new) if self.hostile else new
                out += new
                finish = None if i + 1 < n and t != self.eos else ("stop" if t == self.eos else "length")
                if self.hostile == "no_finish":  # the stream just ends
                    finish = None
                yield self._chunk(v, out, new, finish, tokens_route)
                if self.hold is not None and i == 0:
                    await asyncio.wait([asyncio.ensure_future(self.hold.wait()), asyncio.ensure_future(abort.wait())],
                                       return_when=asyncio.FIRST_COMPLETED)
                if finish is not None:
                    break
            if self.hostile == "no_finish":
                return
            if self.hostile == "garbage":
                yield b"data: {not json\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            self.running.pop(rid, None)

    def _chunk(self, v: bool, out: list[tuple[int, float]], new: list[tuple[int, float]], finish: str | None,
               tokens_route: bool = False) -> bytes:
        label = "someone-else" if self.hostile == "wrong_version" else self.label
        if tokens_route:
            obj = {"request_id": "generate-tokens-x", "choices": [{"index": 0, "token_ids": [t for t, _ in new],
                   "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in new]},
                   "finish_reason": finish}]}
        elif v:
            obj = {"id": "cmpl-x", "weight_version": label,
                   "choices": [{"index": 0, "text": "", "token_ids": [t for t, _ in new],
                                "logprobs": {"tokens": [], "token_logprobs": [lp for _, lp in new]},
                                "finish_reason": finish}]}
        else:
            obj = {"text": "", "meta_info": {"id": "r", "completion_tokens": len(out),
                                             "output_token_logprobs": [[lp, t, None] for t, lp in out],
                                             "finish_reason": None if finish is None else {"type": finish},
                                             "weight_version": label}}
        if self.hostile == "huge":
            obj["pad"] = "x" * 100_000
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def _hostile(self, new: list[tuple[int, float]]) -> list:
        t, lp = new[0]
        return {"bad_id": [(10**6, lp)], "negative_id": [(-1, lp)], "positive_lp": [(t, 0.5)],
                "nan_lp": [(t, float("nan"))], "bool_id": [(True, lp)], "str_id": [("7", lp)],
                "too_many": [(t, lp)] * 50}.get(self.hostile, new)


class _Stream(httpx.AsyncByteStream):
    def __init__(self, gen: AsyncIterator[bytes]) -> None:
        self.gen = gen

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.gen:
            yield chunk

    async def aclose(self) -> None:
        await self.gen.aclose()

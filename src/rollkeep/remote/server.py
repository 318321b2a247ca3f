"""One inference server as the engine pool drives it (a `cluster.replicas.ReplicaHandle`,
docs/server-mode.md). The decisions (which server, when it is lost, when it is back) are the
pool's `ReplicaSet`; the wire is `wire`'s; this module only makes the calls and waits.

    start    the fence's first half, retried until the server answers: abort everything it
             runs, pause, read the weight version it holds, resume, and prove it generates
             (one token; `/health` alone is not liveness)
    refit    the fence's second half and every steady-state refit: if the server does not
             already hold the version (its label names the weights' digest), pause (aborting
             what runs: those attempts continue from their tokens under the new weights),
             reload from the weight directory, check the label it reports, resume
    generate one attempt, streamed: every token is checked, reported as a chunk, and stamped
             with the version it was generated under; a new request id per request, so a
             late answer to an old one can settle nothing

A refused or reset connection, or no answer within `request_timeout_s`, is `ReplicaLost`:
the pool fails the server's attempts as infra failures and brings it back through the fence.
A 5xx, a redirect, malformed JSON, a body past `max_response_bytes` or any value the checks
refuse fails the attempt alone (`InfraError`), never accepted as data.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from ..cluster.replicas import ReplicaInfo, ReplicaLost
from ..core.custody.trace_schema import RunEvent, ServerFenced
from ..core.rollout.generation import Chunk, Completion, GenRequest, InfraError
from ..engines.base import CompletionLimit
from . import wire
from .tokenizer import RemoteTokenizer

_LOST = (httpx.TransportError, TimeoutError)  # refused, reset, closed mid-answer, no answer in time
_PROBE_DELAYS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)  # between probes of a server that is not up


class _Refused(Exception):
    """An answer that is not a success (status, or a body saying so)."""


class _Status(InfraError):
    """A generation answered with an HTTP status other than 200."""

    def __init__(self, msg: str, status: int) -> None:
        super().__init__(msg)
        self.status = status


class ServerHandle:
    def __init__(self, index: int, url: str, section: Any, tokenizer: RemoteTokenizer, *,
                 headers: dict[str, str], emit: Callable[[RunEvent], None],
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.index, self.url, self.cfg, self.tok = index, url, section, tokenizer
        self._emit = emit
        self._control = wire.Control(section.flavor)
        limits = httpx.Limits(max_connections=section.max_concurrent + 4,
                              max_keepalive_connections=section.max_concurrent + 4)
        timeout = httpx.Timeout(section.request_timeout_s, connect=min(10.0, section.request_timeout_s))
        self._http = httpx.AsyncClient(base_url=url, headers={"accept-encoding": "identity", **headers}, limits=limits, timeout=timeout,
                                       follow_redirects=False, trust_env=False, transport=transport)
        self._slots = asyncio.Semaphore(section.max_concurrent)
        # vLLM: token in / token out where the server has it (it needs --enable-scale-out),
        # else the OpenAI completions route with token ids (the fence finds out)
        self._route = wire.SGLANG_GENERATE if section.flavor == "sglang" else wire.VLLM_GENERATE
        self._model: str | None = section.model
        self._rollkeep = False  # the server said it is `rollkeep serve` (it takes the position extension)
        self._label: str | None = None  # the weight version label it holds
        self._version: int | None = None  # the trainer version that label is of
        self._ready = asyncio.Event()  # cleared while a refit runs: requests wait for it
        self._ready.set()
        self._epoch = 0  # refits so far: a request aborted by one continues under the new weights
        self._fence: tuple[float, str, int] | None = None  # (probe start, found, aborted) until refit
        self.limit = CompletionLimit(section.max_new_tokens, tokenizer.context)
        self.bytes_read = 0  # of generation answers, cumulative (`rollkeep bench --suite remote`)

    # ------------------------------------------------------------------ fence

    async def start(self) -> ReplicaInfo:
        t0, delays = time.monotonic(), iter(_PROBE_DELAYS)
        while True:
            try:
                found, aborted = await self._first_half()
                break
            except (*_LOST, wire.Malformed, _Refused, ReplicaLost, InfraError):
                await asyncio.sleep(next(delays, _PROBE_DELAYS[-1]))
        self._label, self._version = found, None
        self._fence = (t0, found, aborted)
        return ReplicaInfo(pid=0, node=self.url, streams=True, continues=True,
                           episode_tokenizer=self.tok.episode, completion_limit=self.limit)

    async def _first_half(self) -> tuple[str, int]:
        ident = await self._call(self._control.identity(), check=False)
        self._rollkeep = wire.Control.is_rollkeep(ident)
        models = self._control.models()
        if self._model is None and models is not None:  # (vLLM wants the served name)
            self._model = wire.Control.first_model(await self._call(models))
        answer = await self._call(self._control.abort_all())
        aborted = answer.get("aborted", 0) if isinstance(answer, dict) else 0
        await self._call(self._control.pause())
        found = wire.Control.version_of(await self._call(self._control.get_version()))
        await self._call(self._control.resume())
        try:
            await self._probe(found)
        except _Status as e:
            if self._route != wire.VLLM_GENERATE or e.status not in (403, 404, 405):
                raise _Refused(str(e)) from None
            self._route = wire.VLLM_COMPLETIONS
            await self._probe(found)
        return found, aborted if isinstance(aborted, int) and not isinstance(aborted, bool) else 0

    async def _probe(self, label: str) -> None:
        """One generated token under `label`: the server's workers are alive."""
        parser = wire.StreamParser(self.cfg.flavor, self._route, vocab=self.tok.vocab, max_tokens=1,
                                   version_label=label)
        body = wire.generate_request(self.cfg.flavor, self._route, [self.tok.probe_id], wire.Sampling(1, 1.0, 1.0, 0),
                                     request_id=f"rk-probe-{secrets.token_hex(6)}", salt=label, model=self._model,
                                     prompt_tokens=1 if self._rollkeep else None)
        try:
            await self._stream(body, parser, lambda ids, lps: None)
        except _Status:
            raise
        except InfraError as e:
            raise _Refused(str(e)) from None

    async def refit(self, published: Any, version: int) -> None:
        """Hold `published` (a `cluster.weightdirs.WeightsDir`) as `version`."""
        try:
            if self._label != published.label:
                self._ready.clear()
                self._epoch += 1
                try:
                    await self._call(self._control.pause())  # running requests end now ("abort")
                    for call in self._control.reload(str(published.path), published.label):
                        await self._call(call)
                    reported = wire.Control.version_of(await self._call(self._control.get_version()))
                    if reported != published.label:
                        raise _Refused(f"after the reload it reports weight version {reported[:80]!r}, "
                                       f"not {published.label!r}")
                finally:
                    with contextlib.suppress(*_LOST, wire.Malformed, _Refused):
                        await self._call(self._control.resume())
            self._label, self._version = published.label, version
        except (*_LOST, wire.Malformed, _Refused) as e:
            self._label = None
            raise ReplicaLost(f"server {self.url}: refit to version {version} failed: {_text(e)}") from None
        finally:
            self._ready.set()
        if self._fence is not None:
            t0, found, aborted = self._fence
            self._fence = None
            self._emit(ServerFenced(server=self.url, found=found, set=published.label, aborted=aborted,
                                    seconds=time.monotonic() - t0))

    # ------------------------------------------------------------------ generate

    async def generate(self, req: GenRequest, progress: Any = None) -> Completion:
        ids = self.tok.encode_prompt(req)
        budget = self.limit(len(ids))
        if req.max_tokens is not None:  # a turn's cap
            budget = min(budget, req.max_tokens)
        p = req.prefix if req.prefix is not None and len(req.prefix) else None
        got_ids = [] if p is None else [int(t) for t in p.completion_ids]
        got_lps = [] if p is None else [float(x) for x in p.logprobs]
        got_ver = [] if p is None else [int(v) for v in p.versions]
        finish = None
        if got_ids and (got_ids[-1] == self.tok.eos or len(got_ids) >= budget):  # the prefix ends it
            finish = "stop" if got_ids[-1] == self.tok.eos else "length"
        while finish is None:
            await self._ready.wait()
            epoch, version, label = self._epoch, self._version, self._label
            if version is None or label is None:
                raise ReplicaLost(f"server {self.url} holds no weights of the run")  # (it is being fenced)
            if req.pinned_version is not None and version != req.pinned_version:
                raise InfraError(f"server {self.url} holds version {version}, the attempt is pinned to "
                                 f"{req.pinned_version}")
            n = budget - len(got_ids)
            parser = wire.StreamParser(self.cfg.flavor, self._route, vocab=self.tok.vocab, max_tokens=n,
                                       version_label=label)

            def tokens(new_ids: list[int], new_lps: list[float], version: int = version) -> None:
                got_ids.extend(new_ids)
                got_lps.extend(new_lps)
                got_ver.extend([version] * len(new_ids))
                if progress is not None and new_ids:
                    progress(Chunk(np.asarray(new_ids, np.int32), np.asarray(new_lps, np.float32),
                                   np.full(len(new_ids), version, np.int32)))

            body = wire.generate_request(
                self.cfg.flavor, self._route, ids + got_ids,
                # (vLLM and SGLang take an int64 seed; rollkeep serve samples from the whole one)
                wire.Sampling(n, self.cfg.temperature, self.cfg.top_p, req.seed if self._rollkeep else req.seed % 2**63),
                request_id=f"rk-{req.group_id}-{req.generation}-{req.attempt}-{secrets.token_hex(4)}",
                salt=label, model=self._model, prompt_tokens=len(ids) if self._rollkeep else None)
            async with self._slots:
                reason = await self._generation(body, parser, tokens)
            if reason != "abort":
                finish = reason
            elif self._epoch == epoch:  # not our refit: someone else aborted it
                raise InfraError(f"server {self.url} aborted the request")
            elif req.pinned_version is not None:
                raise InfraError(f"server {self.url} was refit under an attempt pinned to {req.pinned_version}")
            # (else a refit aborted it: continue from its tokens under the new weights)
        return Completion(
            prompt_ids=np.asarray(ids, np.int32), completion_ids=np.asarray(got_ids, np.int32),
            logprobs=np.asarray(got_lps, np.float32), versions=np.asarray(got_ver, np.int32), finish_reason=finish,
            text=self.tok.decode(got_ids))

    async def _generation(self, body: dict[str, Any], parser: wire.StreamParser,
                          tokens: Callable[[list[int], list[float]], None]) -> str:
        try:
            return await self._stream(body, parser, tokens)
        except asyncio.CancelledError:  # the attempt was abandoned: the server stops it too
            asyncio.get_running_loop().create_task(self._abort_quietly(body))
            raise

    async def _abort_quietly(self, body: dict[str, Any]) -> None:
        rid = body.get("rid") or body.get("request_id")
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5.0):
                await self._call(self._control.abort(str(rid), self._route))

    async def _stream(self, body: dict[str, Any], parser: wire.StreamParser,
                      tokens: Callable[[list[int], list[float]], None]) -> str:
        """POST one streamed generation; feed its checked tokens to `tokens`; the finish reason."""
        limit, read = self.cfg.max_response_bytes, 0
        decoder, whole = wire.SSEDecoder(), bytearray()
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                async with self._http.stream("POST", self._route, json=body) as resp:
                    if resp.status_code != 200:
                        raise _Status(f"server {self.url}: {await self._status_text(resp)}", resp.status_code)
                    # (a server may answer in one JSON body, as without `stream`)
                    streamed = resp.headers.get("content-type", "").startswith("text/event-stream")
                    async for data in resp.aiter_bytes():
                        read += len(data)
                        self.bytes_read += len(data)
                        if read > limit:
                            raise InfraError(f"server {self.url}: the answer passed engine.max_response_bytes={limit}")
                        if not streamed:
                            whole += data
                            continue
                        for payload in decoder.feed(data):
                            tokens(*parser.feed(payload))
                        if parser.done:
                            break
                    if not streamed:
                        tokens(*parser.feed(whole.decode("utf-8", "replace")))
            return parser.end()
        except wire.Malformed as e:
            raise InfraError(f"server {self.url}: {e}") from None
        except _LOST as e:
            raise ReplicaLost(f"server {self.url}: {_text(e)}") from None

    async def _status_text(self, resp: httpx.Response) -> str:
        if 300 <= resp.status_code < 400:
            return f"HTTP {resp.status_code} redirect (not followed)"
        body = b""
        try:
            async for data in resp.aiter_bytes():
                body += data
                if len(body) > 2000:
                    break
        except httpx.StreamConsumed:  # (a transport that read it already)
            body = resp.content
        return f"HTTP {resp.status_code}: {body[:300].decode('utf-8', 'replace')}"

    # ------------------------------------------------------------------ control calls

    async def _call(self, call: wire.Call, *, check: bool = True) -> Any:
        """One control request; its JSON answer (None for an empty one). Raises _Refused for
        a status other than 200 or a `success: false` answer (with `check`), Malformed for
        a body that is not JSON, and the transport's errors as they are."""
        async with asyncio.timeout(self.cfg.request_timeout_s):
            resp = await self._http.request(call.method, call.path, json=call.body)
            if resp.status_code != 200:
                if not check:
                    return None
                raise _Refused(f"{call.method} {call.path}: HTTP {resp.status_code}: {resp.text[:300]}")
            if len(resp.content) > self.cfg.max_response_bytes:
                raise wire.Malformed(f"{call.path}: an answer past engine.max_response_bytes")
            if not resp.content.strip():
                return None
            try:
                answer = json.loads(resp.content)
            except ValueError:
                raise wire.Malformed(f"{call.path}: an answer that is not JSON") from None
            if check and isinstance(answer, dict) and answer.get("success") is False:
                raise _Refused(f"{call.path}: {str(answer.get('message'))[:300]}")
            return answer

    async def close(self) -> None:
        await self._http.aclose()


def _text(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "no answer within engine.request_timeout_s"
    return f"{type(e).__name__}: {e}"[:300] if str(e) else type(e).__name__

"""The two wire protocols of server mode, without any IO (docs/server-mode.md).

    generate_request   the route and JSON body of one generation (vLLM `/v1/completions` or
                       `/inference/v1/generate`, SGLang `/generate`), always streamed
    SSEDecoder         bytes of a `text/event-stream` -> the JSON of each `data:` event
    StreamParser       those events -> checked tokens, log-probs, the finish reason and the
                       weight version the server reported
    control routes     the fence and refit requests of each flavor (`Control`)

Every value a server sends is checked before it is accepted (`Malformed` otherwise: an infra
failure of the attempt, never data): ids are ints inside the vocabulary, log-probs finite and
<= 0, one log-prob per id, no more tokens than asked for, a known finish reason, and a weight
version equal to the one the request was sent under when the server reports one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

Flavor = Literal["vllm", "sglang"]
VLLM_COMPLETIONS = "/v1/completions"
VLLM_GENERATE = "/inference/v1/generate"
SGLANG_GENERATE = "/generate"
FINISH_REASONS = ("stop", "length", "abort")


class Malformed(Exception):
    """A response that is not one an honest server of the flavor sends."""


@dataclass(frozen=True)
class Sampling:
    max_tokens: int  # new tokens at most
    temperature: float
    top_p: float
    seed: int


def generate_request(flavor: Flavor, route: str, ids: list[int], s: Sampling, *, request_id: str, salt: str,
                     model: str | None, prompt_tokens: int | None) -> dict[str, Any]:
    """The JSON body for `route` (`prompt_tokens`: the rollkeep-serve extension, sent only to
    a server that said it is rollkeep serve: where the prompt ends in `ids`, so sampling
    positions continue a prefix exactly)."""
    ext = {} if prompt_tokens is None else {"rollkeep": {"prompt_tokens": prompt_tokens}}
    if flavor == "sglang":
        return {"input_ids": ids, "rid": request_id, "stream": True, "return_logprob": True, "extra_key": salt,
                "sampling_params": {"max_new_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                                    "sampling_seed": s.seed}, **ext}
    params = {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed,
              "logprobs": 0}
    named = {} if model is None else {"model": model}
    if route == VLLM_GENERATE:
        return {"token_ids": ids, "sampling_params": params, "request_id": request_id, "stream": True,
                "cache_salt": salt, **named, **ext}
    return {"prompt": ids, **params, "return_token_ids": True, "add_special_tokens": False, "stream": True,
            "request_id": request_id, "cache_salt": salt, **named, **ext}


class SSEDecoder:
    """Incremental `text/event-stream` decoding: `feed(bytes)` returns the `data` payload of
    each complete event (multi-line data joined by newlines); comments and other fields are
    skipped. Bounded by the caller (it counts the bytes it feeds)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        out = []
        while True:
            end, size = _event_end(self._buf)
            if end < 0:
                return out
            block, self._buf = self._buf[:end], self._buf[end + size:]
            lines = [ln[5:].removeprefix(b" ") for ln in block.replace(b"\r\n", b"\n").split(b"\n")
                     if ln.startswith(b"data:")]
            if lines:
                try:
                    out.append(b"\n".join(lines).decode())
                except UnicodeDecodeError:
                    raise Malformed("an event that is not UTF-8") from None

    @property
    def pending(self) -> int:
        return len(self._buf)


def _event_end(buf: bytes) -> tuple[int, int]:
    ends = [(i, n) for i, n in ((buf.find(b"\n\n"), 2), (buf.find(b"\r\n\r\n"), 4)) if i >= 0]
    return min(ends) if ends else (-1, 0)


class StreamParser:
    """One streamed generation's events, checked as they come. `new` are the tokens of the
    last event fed; `finish` is set by the last one."""

    def __init__(self, flavor: Flavor, route: str, *, vocab: int, max_tokens: int, version_label: str | None) -> None:
        self.flavor, self.route = flavor, route
        self.vocab, self.max_tokens, self.label = vocab, max_tokens, version_label
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None
        self.done = False  # `[DONE]` seen

    def feed(self, payload: str) -> tuple[list[int], list[float]]:
        if self.done:
            raise Malformed("an event after [DONE]")
        if payload.strip() == "[DONE]":
            self.done = True
            return [], []
        if self.finish is not None:
            raise Malformed("an event after the finish reason")
        try:
            obj = json.loads(payload)
        except ValueError:
            raise Malformed(f"an event that is not JSON: {payload[:80]!r}") from None
        if not isinstance(obj, dict):
            raise Malformed("an event that is not a JSON object")
        if "error" in obj:
            raise Malformed(f"the server reported an error: {str(obj['error'])[:200]}")
        ids, lps, finish, version = (_sglang if self.flavor == "sglang" else _vllm)(obj, self)
        if ids and version is not None and self.label is not None and version != self.label:  # (of its tokens)
            raise Malformed(f"the server reports weight version {str(version)[:80]!r}; the request was sent "
                            f"under {self.label!r}")
        if len(ids) != len(lps):
            raise Malformed(f"{len(ids)} token ids with {len(lps)} log-probs")
        for t in ids:
            if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab):
                raise Malformed(f"token id {t!r} outside the tokenizer's vocabulary of {self.vocab}")
        for lp in lps:
            if not (isinstance(lp, int | float) and not isinstance(lp, bool) and math.isfinite(lp) and lp <= 0.0):
                raise Malformed(f"log-prob {lp!r} (finite and <= 0 expected)")
        if len(self.ids) + len(ids) > self.max_tokens:
            raise Malformed(f"{len(self.ids) + len(ids)} tokens for a request of at most {self.max_tokens}")
        if finish is not None and finish not in FINISH_REASONS:
            raise Malformed(f"finish reason {str(finish)[:40]!r} (one of {', '.join(FINISH_REASONS)} expected)")
        self.ids += ids
        self.logprobs += [float(x) for x in lps]
        self.finish = finish
        return ids, [float(x) for x in lps]

    def end(self) -> str:
        """The finish reason of a stream that ended; Malformed if it ended early."""
        if self.finish is None:
            raise Malformed(f"the stream ended after {len(self.ids)} tokens without a finish reason")
        return self.finish


def _choice(obj: dict[str, Any]) -> dict[str, Any]:
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise Malformed("`choices` is not a list of one object")
    return choices[0]


def _vllm(obj: dict[str, Any], p: StreamParser) -> tuple[list, list, str | None, Any]:
    c = _choice(obj)
    ids = c.get("token_ids") or []
    lp = c.get("logprobs") or {}
    if not isinstance(ids, list) or not isinstance(lp, dict):
        raise Malformed("`token_ids` is not a list or `logprobs` not an object")
    if p.route == VLLM_GENERATE:
        content = lp.get("content") or []
        if not isinstance(content, list) or not all(isinstance(x, dict) for x in content):
            raise Malformed("`logprobs.content` is not a list of objects")
        lps = [x.get("logprob") for x in content]
    else:
        lps = lp.get("token_logprobs") or []
        if not isinstance(lps, list):
            raise Malformed("`logprobs.token_logprobs` is not a list")
    return ids, lps, c.get("finish_reason"), obj.get("weight_version")


def _sglang(obj: dict[str, Any], p: StreamParser) -> tuple[list, list, str | None, Any]:
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        raise Malformed("`meta_info` is not an object")
    pairs = meta.get("output_token_logprobs") or []
    n = meta.get("completion_tokens")
    if not isinstance(pairs, list) or not all(isinstance(x, list | tuple) and len(x) >= 2 for x in pairs):
        raise Malformed("`meta_info.output_token_logprobs` is not a list of [logprob, token_id, ...]")
    if not isinstance(n, int) or isinstance(n, bool):
        raise Malformed("`meta_info.completion_tokens` is not an int")
    have = len(p.ids)
    if len(pairs) == n and n >= have:  # cumulative, as SGLang streams
        pairs = pairs[have:]
    elif len(pairs) != n - have:  # (an incremental stream: only the new ones)
        raise Malformed(f"{len(pairs)} output log-probs in an event reporting {n} tokens after {have}")
    finish = meta.get("finish_reason")
    if finish is not None:
        if not isinstance(finish, dict) or "type" not in finish:
            raise Malformed("`meta_info.finish_reason` is not an object with a `type`")
        finish = finish["type"]
    return [x[1] for x in pairs], [x[0] for x in pairs], finish, meta.get("weight_version")


# ---------------------------------------------------------------------------- control plane


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: dict[str, Any] | None = None


class Control:
    """The fence's and refit's requests of one flavor (docs/server-mode.md has the table)."""

    def __init__(self, flavor: Flavor) -> None:
        self.flavor = flavor

    def identity(self) -> Call:
        return Call("GET", "/get_server_info" if self.flavor == "sglang" else "/version")

    def abort_all(self) -> Call:
        if self.flavor == "sglang":
            return Call("POST", "/abort_request", {"abort_all": True})
        return Call("POST", "/abort_requests", {})

    def abort(self, request_id: str, route: str) -> Call:
        if self.flavor == "sglang":
            return Call("POST", "/abort_request", {"rid": request_id})
        # vLLM aborts by its engine's id, which it derives from ours (a bare id aborts
        # nothing and is still counted); rollkeep serve takes ours
        engine_id = f"generate-tokens-{request_id}" if route == VLLM_GENERATE else f"cmpl-{request_id}-0"
        return Call("POST", "/abort_requests", {"request_ids": [request_id, engine_id]})

    def models(self) -> Call | None:
        return None if self.flavor == "sglang" else Call("GET", "/v1/models")

    @staticmethod
    def first_model(obj: Any) -> str:
        data = obj.get("data") if isinstance(obj, dict) else None
        if not (isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str)):
            raise Malformed("/v1/models lists no model")
        return data[0]["id"]

    def pause(self) -> Call:
        if self.flavor == "sglang":
            return Call("POST", "/pause_generation", {"mode": "abort"})
        return Call("POST", "/pause?mode=abort")

    def resume(self) -> Call:
        if self.flavor == "sglang":
            return Call("POST", "/continue_generation", {})
        return Call("POST", "/resume")

    def get_version(self) -> Call:
        return Call("GET", "/get_weight_version" if self.flavor == "sglang" else "/weight_info")

    def reload(self, path: str, label: str) -> list[Call]:
        """Load the weight directory `path` and label it `label`."""
        if self.flavor == "sglang":
            return [Call("POST", "/update_weights_from_disk", {"model_path": path, "weight_version": label,
                                                               "abort_all_requests": False, "flush_cache": True})]
        return [Call("POST", "/collective_rpc", {"method": "reload_weights",
                                                 "kwargs": {"weights_path": path, "is_checkpoint_format": True}}),
                Call("POST", "/update_weight_version", {"new_version": label}),
                Call("POST", "/reset_prefix_cache")]

    @staticmethod
    def version_of(obj: Any) -> str:
        v = obj.get("weight_version") if isinstance(obj, dict) else None
        if not isinstance(v, str):
            raise Malformed("no weight version in the answer")
        return v

    @staticmethod
    def is_rollkeep(obj: Any) -> bool:
        v = obj.get("version") if isinstance(obj, dict) else None
        return isinstance(v, str) and v.startswith("rollkeep-serve")

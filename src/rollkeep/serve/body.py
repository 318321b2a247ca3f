"""Request bodies: read with a size bound, parsed once into a typed `GenParams`.

Everything a client sends is untrusted. `read_json` refuses a body over `MAX_BODY` bytes
(413), one that is not JSON or not an object (400); the parsers below refuse a field of the
wrong type or out of range (400), naming the field, before anything is queued. The three
data-plane routes (vLLM `/v1/completions` and `/inference/v1/generate`, SGLang `/generate`)
name their fields differently and mean the same request: one `GenParams`.

Unknown fields are ignored. Known fields rollkeep serve does not implement (top-k, min-p,
stop strings, penalties, n > 1, top log-probs, prompt log-probs) are refused when set to
anything but their neutral value: a request is never sampled otherwise than it asked, nor
answered without what it asked for.
"""

from __future__ import annotations

import json
import math
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

MAX_BODY = 8 << 20  # bytes; a prompt at the longest context is far below it
_SEED_RANGE = (-(1 << 63), 1 << 64)
_MIN_TEMPERATURE = 1e-3  # below it logits / temperature overflow float64: no greedy via 0
_MAX_TEMPERATURE = 1e3


class BadRequest(Exception):
    """A request refused before it ran: 4xx with `message`."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(frozen=True)
class Limits:
    """What a request must fit: ids are < `vocab`; ids + new tokens <= `context`."""

    vocab: int
    context: int | None


@dataclass(frozen=True)
class GenParams:
    """One generation request, whichever route it came by."""

    ids: list[int]  # the context: prompt, then (ext) a prefix of the completion
    prompt_tokens: int  # how many of `ids` are the prompt (ext `rollkeep.prompt_tokens`; default all)
    max_tokens: int  # new tokens at most
    temperature: float
    top_p: float
    seed: int  # a random one when the request gives none, as vLLM and SGLang do
    ignore_eos: bool
    request_id: str
    stream: bool
    logprobs: bool  # the response carries the sampled tokens' log-probs
    token_ids: bool  # (vLLM /v1/completions `return_token_ids`) the response carries ids


async def read_json(request: Any, *, empty_ok: bool = False) -> dict[str, Any]:
    """The body of a Starlette request as a JSON object; `{}` for no body if `empty_ok`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest("the Content-Length header is not a number")
        if int(declared) > MAX_BODY:
            raise BadRequest(f"the body is over {MAX_BODY} bytes", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise BadRequest(f"the body is over {MAX_BODY} bytes", status=413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        if empty_ok:
            return {}
        raise BadRequest("the body is empty: expected a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise BadRequest(f"the body is not JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body is a JSON {type(body).__name__}, expected an object")
    return body


# ---------------------------------------------------------------- fields

_ABSENT = object()


def _value(body: dict, key: str) -> Any:
    v = body.get(key, _ABSENT)
    return _ABSENT if v is None else v  # JSON null: unset, as OpenAI clients send it


def _integer(body: dict, key: str, default: Any, *, lo: int | None = None, hi: int | None = None,
             where: str = "") -> Any:
    v = _value(body, key)
    if v is _ABSENT:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise BadRequest(f"{where}{key} must be an integer, got {_show(v)}")
    if (lo is not None and v < lo) or (hi is not None and v >= hi):
        raise BadRequest(f"{where}{key} must be in [{lo}, {hi}), got {v}" if hi is not None
                         else f"{where}{key} must be >= {lo}, got {v}")
    return v


def _number(body: dict, key: str, default: float, where: str = "") -> float:
    v = _value(body, key)
    if v is _ABSENT:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise BadRequest(f"{where}{key} must be a finite number, got {_show(v)}")
    return float(v)


def _boolean(body: dict, key: str, default: bool, where: str = "") -> bool:
    v = _value(body, key)
    if v is _ABSENT:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{where}{key} must be true or false, got {_show(v)}")
    return v


def _string(body: dict, key: str, where: str = "") -> str | None:
    v = _value(body, key)
    if v is _ABSENT:
        return None
    if not isinstance(v, str) or not 1 <= len(v) <= 1024:
        raise BadRequest(f"{where}{key} must be a string of 1 to 1024 characters, got {_show(v)}")
    return v


def _object(body: dict, key: str) -> dict:
    v = _value(body, key)
    if v is _ABSENT:
        return {}
    if not isinstance(v, dict):
        raise BadRequest(f"{key} must be an object, got {_show(v)}")
    return v


def _ids(body: dict, key: str, limits: Limits) -> list[int]:
    v = _value(body, key)
    if v is _ABSENT:
        raise BadRequest(f"{key} is required: a list of token ids")
    if not isinstance(v, list) or (v and isinstance(v[0], list)):
        raise BadRequest(f"{key} must be one list of token ids (rollkeep serve takes token ids, one "
                         f"prompt per request), got {_show(v)}")
    if not v:
        raise BadRequest(f"{key} is empty: a prompt needs at least one token id")
    for i, t in enumerate(v):
        if not isinstance(t, int) or isinstance(t, bool):
            raise BadRequest(f"{key}[{i}] must be an integer token id, got {_show(t)}")
        if not 0 <= t < limits.vocab:
            raise BadRequest(f"{key}[{i}] = {t} is out of vocabulary: token ids are in [0, {limits.vocab})")
    return list(v)


def _neutral(body: dict, where: str, **neutral: tuple) -> None:
    """Refuse a known sampling field set to other than one of its neutral values."""
    for key, ok in neutral.items():
        v = body.get(key)
        if v is not None and not any(type(v) is type(o) and v == o for o in ok):
            raise BadRequest(f"{where}{key}={_show(v)} is not supported by rollkeep serve "
                             f"(it samples with temperature and top_p only)")


def _show(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, str | int | float | bool | type(None)) else type(v).__name__
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------- one request

#: Known sampling fields and their neutral values (int and float spellings both accepted).
_SAMPLING: dict[str, tuple] = {
    "top_k": (-1, 0), "min_p": (0, 0.0), "stop": ([], ""), "stop_token_ids": ([],),
    "repetition_penalty": (1, 1.0), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
}

def _params(*, ids: list[int], ext: dict, max_tokens: int, sampling: dict, seed_key: str, where: str,
            request_id: str | None, stream: bool, logprobs: bool, token_ids: bool, limits: Limits) -> GenParams:
    prompt_tokens = _integer(ext, "prompt_tokens", len(ids), lo=1, hi=len(ids) + 1, where="rollkeep.")
    temperature = _number(sampling, "temperature", 1.0, where)
    if not _MIN_TEMPERATURE <= temperature <= _MAX_TEMPERATURE:
        raise BadRequest(f"{where}temperature must be in [{_MIN_TEMPERATURE}, {_MAX_TEMPERATURE}], got "
                         f"{temperature} (rollkeep serve always samples; it has no greedy mode)")
    top_p = _number(sampling, "top_p", 1.0, where)
    if not 0 < top_p <= 1:
        raise BadRequest(f"{where}top_p must be in (0, 1], got {top_p}")
    seed = _integer(sampling, seed_key, None, lo=_SEED_RANGE[0], hi=_SEED_RANGE[1], where=where)
    if limits.context is not None and len(ids) + max_tokens > limits.context:
        raise BadRequest(f"This model's maximum context length is {limits.context} tokens. However, you "
                         f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the input, {max_tokens} "
                         f"for the completion). Please reduce the length of the input or the completion.")
    return GenParams(
        ids=ids, prompt_tokens=prompt_tokens, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        seed=secrets.randbits(63) if seed is None else seed,
        ignore_eos=_boolean(sampling, "ignore_eos", False, where),
        request_id=request_id or uuid.uuid4().hex, stream=stream, logprobs=logprobs, token_ids=token_ids,
    )


def vllm_completions(body: dict, limits: Limits) -> GenParams:
    """vLLM `POST /v1/completions` with token ids as the prompt."""
    _neutral(body, "", n=(1,), best_of=(1,), echo=(False,), **_SAMPLING, min_tokens=(0,), prompt_logprobs=())
    logprobs = _integer(body, "logprobs", None, lo=0)
    if logprobs is not None and logprobs > 0:
        raise BadRequest(f"logprobs={logprobs} is not supported by rollkeep serve: only 0 (the sampled token's)")
    return _params(ids=_ids(body, "prompt", limits), ext=_object(body, "rollkeep"),
                   max_tokens=_integer(body, "max_tokens", 16, lo=0), sampling=body, seed_key="seed", where="",
                   request_id=_string(body, "request_id"), stream=_boolean(body, "stream", False),
                   logprobs=logprobs is not None, token_ids=_boolean(body, "return_token_ids", False), limits=limits)


def vllm_generate(body: dict, limits: Limits) -> GenParams:
    """vLLM `POST /inference/v1/generate` (token in, token out)."""
    sp = _object(body, "sampling_params")
    where = "sampling_params."
    _neutral(sp, where, n=(1,), **_SAMPLING, min_tokens=(0,), prompt_logprobs=())
    logprobs = _integer(sp, "logprobs", None, lo=0, where=where)
    if logprobs is not None and logprobs > 0:
        raise BadRequest(f"{where}logprobs={logprobs} is not supported by rollkeep serve: only 0")
    return _params(ids=_ids(body, "token_ids", limits), ext=_object(body, "rollkeep"),
                   max_tokens=_integer(sp, "max_tokens", 16, lo=0, where=where), sampling=sp, seed_key="seed",
                   where=where, request_id=_string(body, "request_id"), stream=_boolean(body, "stream", False),
                   logprobs=logprobs is not None, token_ids=True, limits=limits)


def sglang_generate(body: dict, limits: Limits) -> GenParams:
    """SGLang `POST /generate` with `input_ids`."""
    if body.get("text") is not None or body.get("input_embeds") is not None:
        raise BadRequest("rollkeep serve takes input_ids only (no text, no input_embeds)")
    sp = _object(body, "sampling_params")
    where = "sampling_params."
    _neutral(sp, where, n=(1,), **_SAMPLING, min_new_tokens=(0,))
    _neutral(body, "", top_logprobs_num=(0,), logprob_start_len=(-1,))
    return _params(ids=_ids(body, "input_ids", limits), ext=_object(body, "rollkeep"),
                   max_tokens=_integer(sp, "max_new_tokens", 128, lo=0, where=where), sampling=sp,
                   seed_key="sampling_seed", where=where, request_id=_string(body, "rid"),
                   stream=_boolean(body, "stream", False), logprobs=_boolean(body, "return_logprob", False),
                   token_ids=True, limits=limits)

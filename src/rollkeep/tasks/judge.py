"""An LLM judge as a reward function: `reward.fn: rollkeep.tasks.judge:score`.

    score(completion, row)        async: asks the judge whether `completion` answers
                                  row["prompt"] (against row["answer"] when the row has
                                  one) and returns 1.0 or 0.0
    score_sync(completion, row)   the same for runs whose reward functions are synchronous
    prompt(completion, row)       the judge prompt (`PROMPT`)
    verdict(text)                 the judge's text read as a score

The judge is any OpenAI-compatible completions server (`rollkeep serve`, vLLM, SGLang):

    ROLLKEEP_JUDGE_URL        its base URL (default http://127.0.0.1:8000); the call is
                              POST {url}/v1/completions
    ROLLKEEP_JUDGE_MODEL      the model name it serves (default "judge")
    ROLLKEEP_JUDGE_TIMEOUT_S  deadline of one call, in seconds (default 30; keep it under
                              `reward.timeout_s`, which bounds the whole reward call)

Each question is one exactly-once effect (`rollkeep.effects.call`, kind "judge",
on_unknown "retry"): its request is {url, model, prompt, max_tokens, temperature: 0},
recorded in the run's journal with the judge's answer, so a resumed run is answered from
the record and the judge is not asked again. The request carries the effect's key as the
`Idempotency-Key` header, so a judge (or a proxy in front of it) that de-duplicates by key
answers a retried call once. Outside a run (key "unrecorded") no key is sent: each such
call is its own.

The judge's text is read by its first word (`verdict`): "1", "yes" or "correct" scores 1.0;
"0", "no" or "incorrect" 0.0; anything else 0.0 as well. So a judge that does not follow
the instruction (a tiny random model, as in the toy configs) scores every completion 0:
the run goes on, it learns nothing from the judge.

What fails the attempt (as data: the run loop turns any exception of a reward function
into a data failure of that attempt, within `rollout.max_data_attempts`): an HTTP status
other than 200 (RuntimeError), a body that is not JSON, not an object, or without
`choices[0].text` (ValueError), a body over `MAX_BODY_BYTES` (ValueError), no answer
within the deadline (TimeoutError), no connection (ConnectionError). Inside a run such a
failure is recorded too: the resumed call raises `rollkeep.effects.EffectFailed`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx

from .. import effects

__all__ = ["KIND", "MAX_BODY_BYTES", "PROMPT", "Settings", "prompt", "score", "score_sync", "settings", "verdict"]

KIND = "judge"
URL_VAR, MODEL_VAR, TIMEOUT_VAR = "ROLLKEEP_JUDGE_URL", "ROLLKEEP_JUDGE_MODEL", "ROLLKEEP_JUDGE_TIMEOUT_S"
DEFAULT_URL, DEFAULT_MODEL, DEFAULT_TIMEOUT_S = "http://127.0.0.1:8000", "judge", 30.0
MAX_TOKENS = 8  # a verdict is one word
MAX_BODY_BYTES = 1 << 20  # an answer of a few tokens is far below it; more is a broken judge
MAX_TEXT_CHARS = 1024  # of the judge's text, recorded: the verdict is its first word
MAX_COMPLETION_CHARS = 16_000  # the completion as the judge sees it: the request is recorded in the journal

# The judge prompt. Its two last fields are what `tests/effects/effect_servers.py`'s fake
# judge reads; keep the labels if you change the wording.
PROMPT = (
    "You are grading an answer to a problem. Reply with 1 if the answer is correct and 0 if "
    "it is not, and nothing else.\n\n"
    "Problem: {problem}\n"
    "{reference}"
    "Answer to grade: {completion}\n\n"
    "Verdict (1 or 0):"
)
REFERENCE = "Reference answer: {answer}\n"

_YES, _NO = frozenset({"1", "yes", "correct"}), frozenset({"0", "no", "incorrect"})
_FIRST_WORD = re.compile(r"\s*(\w+)")


@dataclass(frozen=True)
class Settings:
    """Where the judge is, read from the environment variables (`settings()`)."""

    url: str
    model: str
    timeout_s: float


def settings() -> Settings:
    """The judge's settings from ROLLKEEP_JUDGE_URL, _MODEL and _TIMEOUT_S (read at each
    call, so a test or a launcher can set them after import)."""
    url = os.environ.get(URL_VAR, DEFAULT_URL).rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{URL_VAR}={url!r} is not an http(s) URL: set it to the judge's base URL, "
                         f"e.g. {DEFAULT_URL}")
    raw = os.environ.get(TIMEOUT_VAR, str(DEFAULT_TIMEOUT_S))
    try:
        timeout_s = float(raw)
    except ValueError:
        timeout_s = math.nan
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"{TIMEOUT_VAR}={raw!r} is not a positive number of seconds (default {DEFAULT_TIMEOUT_S:g})")
    return Settings(url=url, model=os.environ.get(MODEL_VAR, DEFAULT_MODEL), timeout_s=timeout_s)


def prompt(completion: str, row: Mapping[str, Any]) -> str:
    """The judge prompt for `completion` as an answer to `row` (its `prompt`, and its
    `answer` as the reference when it has one)."""
    if "prompt" not in row:
        raise ValueError(f"judge: row {dict(row)!r} has no `prompt` to judge the completion against")
    answer = row.get("answer")
    reference = "" if answer is None else REFERENCE.format(answer=answer)
    return PROMPT.format(problem=row["prompt"], reference=reference, completion=completion[:MAX_COMPLETION_CHARS])


def verdict(text: str) -> float:
    """1.0 if the judge's text starts (after whitespace, case aside) with the word "1", "yes"
    or "correct"; otherwise 0.0 ("0", "no", "incorrect", and anything unreadable: a judge
    that does not answer the question gives no reward). Word by word, so "10" or
    "correctly" are not verdicts."""
    m = _FIRST_WORD.match(text)
    return 1.0 if m is not None and m.group(1).lower() in _YES else 0.0


async def score(completion: str, row: Mapping[str, Any]) -> float:
    """The judge's verdict on `completion` for `row` (see the module docstring)."""
    s = settings()
    result = await effects.call(KIND, _request(s, completion, row), partial(_post, timeout_s=s.timeout_s),
                                on_unknown=effects.RETRY)
    return verdict(_text_of(result))


def score_sync(completion: str, row: Mapping[str, Any]) -> float:
    """`score` for synchronous code (rollkeep's worker threads; `effects.call_sync`)."""
    s = settings()
    result = effects.call_sync(KIND, _request(s, completion, row), partial(_post_sync, timeout_s=s.timeout_s),
                               on_unknown=effects.RETRY)
    return verdict(_text_of(result))


def _request(s: Settings, completion: str, row: Mapping[str, Any]) -> dict[str, Any]:
    # What is recorded and compared on resume: everything the answer depends on, nothing else
    # (not the timeout: a longer deadline does not change what the judge says).
    return {"url": s.url, "model": s.model, "prompt": prompt(completion, row), "max_tokens": MAX_TOKENS,
            "temperature": 0}


def _body(request: Mapping[str, Any]) -> dict[str, Any]:
    return {k: request[k] for k in ("model", "prompt", "max_tokens", "temperature")}


def _headers(key: str) -> dict[str, str]:
    return {} if key == effects.UNRECORDED else {"Idempotency-Key": key}


async def _post(request: Mapping[str, Any], key: str, *, timeout_s: float) -> dict[str, str]:
    url = f"{request['url']}/v1/completions"
    try:
        async with asyncio.timeout(timeout_s):
            async with httpx.AsyncClient(timeout=timeout_s, trust_env=False, follow_redirects=False) as client:
                async with client.stream("POST", url, json=_body(request), headers=_headers(key)) as resp:
                    _check_length(resp, url)
                    data = bytearray()
                    async for chunk in resp.aiter_bytes():
                        data += chunk
                        _check_size(len(data), url)
                    return _parse(resp.status_code, bytes(data), url)
    except (TimeoutError, httpx.TimeoutException):
        raise TimeoutError(f"judge {url}: no answer within {timeout_s:g} s ({TIMEOUT_VAR})") from None
    except httpx.TransportError as e:
        raise ConnectionError(f"judge {url}: {type(e).__name__}: {e}") from None


def _post_sync(request: Mapping[str, Any], key: str, *, timeout_s: float) -> dict[str, str]:
    url = f"{request['url']}/v1/completions"
    deadline = time.monotonic() + timeout_s  # httpx's timeout is per read; this bounds the whole body
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, follow_redirects=False) as client:
            with client.stream("POST", url, json=_body(request), headers=_headers(key)) as resp:
                _check_length(resp, url)
                data = bytearray()
                for chunk in resp.iter_bytes():
                    data += chunk
                    _check_size(len(data), url)
                    if time.monotonic() > deadline:
                        raise TimeoutError
                return _parse(resp.status_code, bytes(data), url)
    except (TimeoutError, httpx.TimeoutException):
        raise TimeoutError(f"judge {url}: no answer within {timeout_s:g} s ({TIMEOUT_VAR})") from None
    except httpx.TransportError as e:
        raise ConnectionError(f"judge {url}: {type(e).__name__}: {e}") from None


def _check_length(resp: httpx.Response, url: str) -> None:
    declared = resp.headers.get("content-length")
    if declared is not None and declared.isdigit():
        _check_size(int(declared), url)


def _check_size(n: int, url: str) -> None:
    if n > MAX_BODY_BYTES:
        raise ValueError(f"judge {url}: the response is over {MAX_BODY_BYTES} bytes (read {n}): not a verdict")


def _parse(status: int, body: bytes, url: str) -> dict[str, str]:
    shown = body[:200].decode("utf-8", "replace")
    if status != 200:
        raise RuntimeError(f"judge {url}: HTTP {status} (expected 200): {shown!r}")
    try:
        obj = json.loads(body)
    except ValueError:
        raise ValueError(f"judge {url}: the response is not JSON: {shown!r}") from None
    choices = obj.get("choices") if isinstance(obj, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(first, dict) or not isinstance(first.get("text"), str):
        raise ValueError(f"judge {url}: expected a completions response {{\"choices\": [{{\"text\": ...}}]}}, "
                         f"found {json.dumps(obj)[:200]}")
    return {"text": first["text"][:MAX_TEXT_CHARS]}


def _text_of(result: Any) -> str:
    """The text of a result `_post` returned, or the record of one (the journal holds what
    it returned; anything else is not a judge's answer)."""
    if not isinstance(result, dict) or not isinstance(result.get("text"), str):
        raise ValueError(f"judge: expected a result {{\"text\": ...}}, found {json.dumps(result)[:200]}")
    return result["text"]

"""A code-execution tool environment: `env.factory: rollkeep.envs.sandbox:SandboxEnv`.

Each model turn is Python code (the text inside its first ```python ... ``` block, or the
whole turn if it has none, cut to `max_code_chars`); the sandbox server
(`rollkeep.envs.sandbox_server`, started beside the run) runs it after the episode's code so
far, and the environment answers with its stdout (cut to `max_output_chars`; a run that
failed adds its error's last line). The episode ends with reward 1.0 on the turn whose
stdout or text holds the row's `answer` (as a whole word: "185" does not hold "85"), or
with 0.0 after `max_turns` turns.

    env:
      factory: rollkeep.envs.sandbox:SandboxEnv
      kwargs: {url: http://127.0.0.1:8765}    # python -m rollkeep.envs.sandbox_server --port 8765

Every call to the server is an exactly-once effect (`rollkeep.effects.call_sync`):

    reset   "sandbox.open" {url, seed, prompt}        -> {"session": id}
    step    "sandbox.run"  {url, session, code}       -> {"stdout", "ok", "error"}

each with the effect's key as `Idempotency-Key` (the server de-duplicates on it), and each
recorded with its answer in the run's journal. So `recovery = "replay"` holds though the
state lives outside the process: a replay after a restart resets a fresh environment and
steps it through the recorded turns, and each call is answered from the record (the same
session id, the same stdout) without reaching the server; the environment is a function of
(row, seed, recorded answers). The server's session still holds the code that ran, so the
episode's next, new turn runs on top of it. (Sessions do not outlive the server: restart it
and the resumed episodes' new turns fail, as data, with "no session".)

An HTTP status other than 200, a body that is not the expected JSON or is over
`MAX_BODY_BYTES`, or no answer within `request_timeout_s` raises, which fails the attempt
as data (and inside a run is recorded: the replayed call raises `EffectFailed`).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import httpx

from .. import effects
from .base import REPLAY, Step

__all__ = ["MAX_BODY_BYTES", "SandboxEnv", "contains_answer", "extract_code"]

MAX_BODY_BYTES = 1 << 20  # of one server answer; the server bounds stdout far below it
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str, *, max_chars: int) -> str:
    """The code in a model turn: its first ```python (or ```py, or bare ```) block's body,
    else the whole turn; at most `max_chars` characters."""
    m = _FENCE.search(text)
    return (m.group(1) if m is not None else text)[:max_chars]


def contains_answer(haystack: str, answer: str) -> bool:
    """Whether `answer` occurs in `haystack` as a whole word (not inside a longer number or
    name). An empty answer occurs nowhere."""
    if not answer:
        return False
    return re.search(rf"(?<![0-9A-Za-z_]){re.escape(answer)}(?![0-9A-Za-z_])", haystack) is not None


class SandboxEnv:
    """One episode of code execution against a sandbox server (the `Environment`
    protocol, replay recovery). Building one contacts nothing: the server is first
    called by `reset`."""

    recovery = REPLAY

    def __init__(self, *, url: str = "http://127.0.0.1:8765", max_turns: int = 4, max_code_chars: int = 8000,
                 max_output_chars: int = 4000, request_timeout_s: float = 10.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"sandbox env: url {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8765)")
        for name, value in (("max_turns", max_turns), ("max_code_chars", max_code_chars),
                            ("max_output_chars", max_output_chars), ("request_timeout_s", request_timeout_s)):
            if not value > 0:
                raise ValueError(f"sandbox env: {name} must be positive, got {value!r}")
        self.url = url.rstrip("/")
        self.max_turns, self.max_code_chars, self.max_output_chars = max_turns, max_code_chars, max_output_chars
        self.request_timeout_s = request_timeout_s
        self._answer: str | None = None
        self._session: str | None = None
        self._turns = 0

    def reset(self, row: Mapping[str, Any], seed: int) -> None:
        """Open a session for the episode on `row` (it needs `prompt` and `answer`)."""
        missing = [k for k in ("prompt", "answer") if k not in row]
        if missing:
            raise ValueError(f"sandbox env: row {dict(row)!r} has no {' or '.join(missing)}")
        request = {"url": self.url, "seed": int(seed), "prompt": str(row["prompt"])}
        result = effects.call_sync("sandbox.open", request, partial(_post, route="open", timeout_s=self.request_timeout_s))
        if not isinstance(result, dict) or not isinstance(result.get("session"), str):
            raise ValueError(f"sandbox env: /open answered {json.dumps(result)[:200]}, expected {{\"session\": id}}")
        self._answer, self._session, self._turns = str(row["answer"]), result["session"], 0

    def step(self, text: str) -> Step:
        if self._session is None or self._answer is None:
            raise RuntimeError("sandbox env: step() before reset()")
        code = extract_code(text, max_chars=self.max_code_chars)
        request = {"url": self.url, "session": self._session, "code": code}
        result = effects.call_sync("sandbox.run", request, partial(_post, route="run", timeout_s=self.request_timeout_s))
        stdout, ok, error = _run_result(result)
        self._turns += 1
        if contains_answer(stdout, self._answer) or contains_answer(text, self._answer):
            return Step(response=self._response(stdout, ok, error), done=True, reward=1.0)
        return Step(response=self._response(stdout, ok, error), done=self._turns >= self.max_turns, reward=0.0)

    def _response(self, stdout: str, ok: bool, error: str) -> str:
        if not ok:  # the error's last line (the exception, or why the run was stopped) is the useful one
            lines = error.strip().splitlines()
            sep = "" if not stdout or stdout.endswith("\n") else "\n"
            stdout = f"{stdout}{sep}error: {lines[-1] if lines else 'the run failed'}\n"
        return stdout[: self.max_output_chars]


def _run_result(result: Any) -> tuple[str, bool, str]:
    if (not isinstance(result, dict) or not isinstance(result.get("stdout"), str)
            or not isinstance(result.get("ok"), bool)):
        raise ValueError(f"sandbox env: /run answered {json.dumps(result)[:200]}, expected "
                         "{\"stdout\": str, \"ok\": bool, ...}")
    error = result.get("error", "")
    return result["stdout"], result["ok"], error if isinstance(error, str) else ""


def _post(request: Mapping[str, Any], key: str, *, route: str, timeout_s: float) -> Any:
    """POST the request (less its `url`) to {url}/{route} with the effect's key, and return
    the JSON answer; within `timeout_s` and `MAX_BODY_BYTES`."""
    url = f"{request['url']}/{route}"
    body = {k: v for k, v in request.items() if k != "url"}
    headers = {} if key == effects.UNRECORDED else {"Idempotency-Key": key}  # outside a run: no de-duplication
    deadline = time.monotonic() + timeout_s  # httpx's timeout is per read; this bounds the whole answer
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, follow_redirects=False) as client:
            with client.stream("POST", url, json=body, headers=headers) as resp:
                data = bytearray()
                for chunk in resp.iter_bytes():
                    data += chunk
                    if len(data) > MAX_BODY_BYTES:
                        raise ValueError(f"sandbox {url}: the answer is over {MAX_BODY_BYTES} bytes")
                    if time.monotonic() > deadline:
                        raise TimeoutError
    except (TimeoutError, httpx.TimeoutException):
        raise TimeoutError(f"sandbox {url}: no answer within {timeout_s:g} s") from None
    except httpx.TransportError as e:
        raise ConnectionError(f"sandbox {url}: {type(e).__name__}: {e} (is the sandbox server running?)") from None
    shown = bytes(data[:200]).decode("utf-8", "replace")
    if resp.status_code != 200:
        raise RuntimeError(f"sandbox {url}: HTTP {resp.status_code} (expected 200): {shown}")
    try:
        return json.loads(data)
    except ValueError:
        raise ValueError(f"sandbox {url}: the answer is not JSON: {shown!r}") from None

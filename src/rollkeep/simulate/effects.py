"""The simulation's side of calls to the outside (docs/design.md §13): a judge that lives
outside every simulated process, the requests the world's reward stage and environment send
it, and what the world observes of those calls across processes, checked at the end.

The judge is the service a reward function calls: it counts the calls it receives per
idempotency key and answers each as a pure function of the request (a reward from the
request's digest), so a call answered from the record and a call made again give the same
reward, and a deterministic run stays byte-identical to the run without crashes. With
`judge_errors` it refuses a share of requests (a pure function of the request too: a data
failure gives the sibling a new sampling seed, so its next attempt asks something else), so
error outcomes are recorded and answered from the record too. It lives on the `World`, not
on a segment: a crash kills the process, not the service.

The world carries out each call as `controller.effects` does (`world._Process._effect`)
and tells the `EffectBook` what it sees: each call's place, and, at every start of a
process, the records that process starts from (`core.restore.start.open_effects`, the
code a restore runs), so the book knows which called keys a crash left without a durable
outcome. The invariant (`EffectBook.problems`):

    with the journal   every key is called once, except that under `retry` a key whose
                       outcome was not durable at a crash (a restore found no outcome of
                       it) or was never recorded (its attempt was cut off during the call)
                       may be sent again, once per such loss; under `fail` never (the
                       attempt failed; a new one uses new keys). A key is only ever sent
                       with one request (a service that de-duplicates by key would answer
                       a second request with the first one's result)
    without it         at least once (see `rollkeep.effects`): an intent is durable only at
                       the next checkpoint, so a restore from a checkpoint alone may have no
                       record of a call, send the same attempt again and call with the same
                       key, under either policy, and with another request (the same holds
                       for a restore whose journal was set aside)
    always             every key called is this run's and names the sibling, turn and index
                       it was called for (a resent key: an attempt up to the caller's); every
                       trained sibling's reward is the judge's answer to its requests (no
                       reward an unknown or a mismatched record made up)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import msgspec
import numpy as np
import xxhash

from ..core.rollout.effects import RETRY, REWARD_TURN, EffectStore
from ..core.rollout.rows import ENV_VERSION, Row
from ..effects import canonical
from .episodes import SimTokenizer

__all__ = ["JUDGE", "JUDGE_ERROR", "RUN", "EffectBook", "Judge", "digest", "expected_reward", "reward_of",
           "reward_requests", "step_request"]

JUDGE = "judge"  # the kind of every call the simulation makes
JUDGE_ERROR = "judge unavailable"  # the text of the judge's error outcome
RUN = "sim"  # the run part of every key (`run_key` in the runner): keys are `rk-sim-...`


def digest(request: object) -> tuple[bytes, int]:
    """The request's canonical JSON and its xxh3-64 (what `effects.call` records)."""
    body = canonical(request)
    return body, xxhash.xxh3_64_intdigest(body)


class Judge:
    """The service outside the simulated process: `calls` per key survive every crash."""

    def __init__(self, error_rate: float = 0.0) -> None:
        self.error_rate = error_rate
        self.calls: Counter[str] = Counter()
        self.requests: dict[str, set[int]] = {}  # key -> the digests of the requests sent with it

    @staticmethod
    def answer(body: bytes) -> float:
        """The reward for a request: a pure function of its canonical JSON."""
        return (xxhash.xxh3_64_intdigest(b"judge/" + body) % 5) / 4

    def call(self, key: str, body: bytes) -> tuple[bool, bytes]:
        """Receive one call: (ok, the result's JSON or the error's text)."""
        self.calls[key] += 1
        self.requests.setdefault(key, set()).add(xxhash.xxh3_64_intdigest(body))
        if self.error_rate and xxhash.xxh3_64_intdigest(b"judge-error/" + body) / 2.0**64 < self.error_rate:
            return False, JUDGE_ERROR.encode()
        return True, msgspec.json.encode({"reward": self.answer(body)})


def reward_of(result: bytes) -> float:
    return float(msgspec.json.decode(result)["reward"])


# ====================================================================== the requests


def reward_requests(gid: str, gen: int, ids: np.ndarray, versions: np.ndarray, calls: int) -> list[dict]:
    """The reward stage's requests for a single-turn completion: `calls` of them (indexes
    0..calls-1 of turn REWARD_TURN), each of the completion's tokens and their versions (a
    sibling regenerated under new weights asks something new: its record is superseded)."""
    base = {"group": gid, "sibling": gen, "completion": np.asarray(ids).tolist(),
            "versions": np.asarray(versions).tolist()}
    return [{**base, "call": i} for i in range(calls)]


def step_request(gid: str, gen: int, turn: int, text: str) -> dict:
    """An environment step's request (index 0 of `turn`): the model's text of the turn."""
    return {"group": gid, "sibling": gen, "turn": turn, "text": text}


def _last_model_turn(row: Row) -> tuple[int, str] | None:
    """(the turn, its text) of the episode's last model turn, or None (it generated none):
    model turns and the environment's responses alternate, told apart by ENV_VERSION."""
    env = np.asarray(row.versions) == ENV_VERSION
    runs, start = [], 0
    for i in range(1, len(env) + 1):
        if i == len(env) or env[i] != env[start]:
            if not env[start]:
                runs.append((start, i))
            start = i
    if not runs:
        return None
    s, e = runs[-1]
    return len(runs) - 1, SimTokenizer().decode(np.asarray(row.completion_ids)[s:e])


def expected_reward(gid: str, gen: int, row: Row, *, turns: int, calls: int) -> float:
    """The reward the judge gives this row: the mean of its reward stage's answers, or for
    an episode the answer to its last step (the episode's reward is the last step's)."""
    if turns == 1:
        return sum(Judge.answer(digest(r)[0]) for r in reward_requests(gid, gen, row.completion_ids, row.versions,
                                                                      calls)) / calls
    last = _last_model_turn(row)
    return 0.0 if last is None else Judge.answer(digest(step_request(gid, gen, *last))[0])


# ====================================================================== what the world sees


def _place(key: str) -> tuple[str, str, int, int, int, int] | None:
    """(run, group, sibling, attempt, turn, index) of `rk-<run>-<group>-...`, or None."""
    head, sep, rest = key.partition("-")
    run, sep2, rest = rest.partition("-")
    parts = rest.rsplit("-", 4)
    if head != "rk" or not (sep and sep2) or len(parts) != 5:
        return None
    gid, gen, attempt, turn, index = parts
    try:
        return run, gid, int(gen), int(attempt), REWARD_TURN if turn == "r" else int(turn), int(index)
    except ValueError:
        return None


@dataclass
class EffectBook:
    """The world's observations of the run's calls, across its processes."""

    policy: str = RETRY
    lost: Counter = field(default_factory=Counter)  # key -> times its outcome was lost after the call
    vanished: Counter = field(default_factory=Counter)  # key -> weak restores that had no record of it
    seen: list[str] = field(default_factory=list)  # what was wrong, as it was seen
    answered: int = 0  # calls answered from the record
    unknown: int = 0  # attempts failed as effect_unknown, in any process (the scheduler's guard at the seal too)

    def called(self, key: str, *, gid: str, gen: int, attempt: int, turn: int, index: int) -> None:
        """A call was made with `key` for the attempt (gid, gen, attempt) at (turn, index)."""
        place = _place(key)
        if place is None or place[0] != RUN or place[1:3] != (gid, gen) or place[4:] != (turn, index) \
                or place[3] > attempt:
            self.seen.append(f"effects: call {key!r} made for {gid}/{gen} attempt {attempt} at turn {turn}, "
                             f"index {index} is not this run's key for that place")

    def cut_off(self, key: str) -> None:
        """The call was made, and its attempt ended before its outcome was recorded."""
        self.lost[key] += 1

    def restored(self, records: EffectStore, calls: Counter, *, weak: bool) -> None:
        """A process starts from `records`: a called key they hold no outcome of was not
        durable at the crash. `weak`: from a checkpoint alone (the journal off, or set
        aside), where even a call's intent may be lost."""
        by_key = {r.key: r for _, rs in records for r in rs}
        for key in calls:
            rec = by_key.get(key)
            if rec is None or rec.ok is None:
                self.lost[key] += 1
                if rec is None and weak:
                    self.vanished[key] += 1

    def trained(self, gid: str, gen: int, row: Row, *, turns: int, calls: int) -> None:
        """A sibling is trained on: its reward must be the judge's."""
        want = expected_reward(gid, gen, row, turns=turns, calls=calls)
        if row.reward != want:
            self.seen.append(f"effects: {gid}/{gen} was trained with reward {row.reward}, the judge's answer to "
                             f"its requests is {want}")

    def problems(self, judge: Judge) -> list[str]:
        """What was seen; every key called more often than the invariant allows; every key
        sent with two requests (a service that de-duplicates by key would answer the second
        with the first's result), unless a restore may have lost its intent."""
        out = list(self.seen)
        for key, digests in sorted(judge.requests.items()):
            if len(digests) > 1 and not self.vanished[key]:
                out.append(f"effects: key {key} was sent with {len(digests)} different requests")
        for key, n in sorted(judge.calls.items()):
            allowed = 1 + (self.lost[key] if self.policy == RETRY else 0) + self.vanished[key]
            if n > allowed:
                why = (f"{self.lost[key]} lost outcome(s), {self.vanished[key]} restore(s) without its record"
                       if self.policy == RETRY else f"on_unknown=fail, {self.vanished[key]} restore(s) without "
                       "its record")
                out.append(f"effects: key {key} was called {n} times ({why}: at most {allowed})")
        return out

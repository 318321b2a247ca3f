"""Multi-turn episodes (docs/design.md §5.4): the runner's part, which only waits.

One attempt of a sibling is one episode. `run_episode` drives the episode's state machine
(`core.schedule.episode.Episode`, which makes every decision: the rebuild, the replay
check, the turns and when they end) and carries out its commands: it rebuilds the
environment after the turns the attempt continues (`GenRequest.turns`: replayed, or
restored from the snapshot), then alternates an engine call for the model's turn and an
environment step for its response, reporting every finished turn (`on_turn`, which the
scheduler records as a `turn_sealed` event) before the next model call. Any engine works: a turn is a generation
that continues the trajectory so far (`GenRequest.prefix`), so an engine needs nothing but
prefix continuation and its tokenizer (`capabilities_of(engine)`: `continues`,
`episode_tokenizer` with `encode(text, bos=False)` and `decode(ids)`). With
`data.chat_template` (`EnvSpec.chat_template`) the engine's tokenizer renders each
response as a chat turn (`models.chat.chat_episodes`).

The trajectory's budget is the engine's (`completion_limit(prompt_tokens)` of its
capabilities: its
`max_new_tokens` within its context; the toy engine's `TRAJECTORY_TOKENS`; unbounded for
an engine without one): an environment response is cut to what is left of it, and the
episode ends when it is spent, when a turn generates nothing, when the environment says
it is done, or after `env.max_turns` turns.

Environment calls (the factory, `reset`, `step`, `snapshot`, `restore`) are user code:
each runs on one of the run's own worker threads (`usercode.UserCode`) within
`env.timeout_s`, and one past it is abandoned, its thread left to finish or hang, so it
never holds up a later call. Any failure of theirs, a late call, a malformed step and a
response over `env.max_response_bytes` (UTF-8) is a `DataError` (a data failure of the
attempt); SystemExit or KeyboardInterrupt from them stops the run (`usercode.UserStop`).

The warm start's demonstrations and the held-out evaluation call environments from plain
threads, not the loop: `bounded(spec)` gives them a factory whose environments' calls are
bounded alike (`usercode.call_sync`), every failure a DataError, SystemExit included.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.errors import RowsMismatch
from ..core.rollout.generation import Completion, DataError, GenRequest, Tokens
from ..core.rollout.prefixes import PrefixStore
from ..core.schedule.episode import (
    Done,
    EnvBuild,
    EnvReplay,
    EnvReset,
    EnvRestore,
    EnvSnapshot,
    EnvStep,
    Episode,
    Generate,
    Turn,
)
from ..engines.base import capabilities_of
from ..envs import LEASE, SNAPSHOT, EnvSpec, Step
from .usercode import Overdue, UserCode, UserStop, call_sync

OnTurn = Callable[[Tokens, int, bytes | None], None]  # (trajectory, turn, snapshot)


async def run_episode(engine: Any, spec: EnvSpec, req: GenRequest, progress: Any,
                      on_turn: OnTurn, *, code: UserCode, effects: Any = None,
                      built: list | None = None, gate: Any = None) -> tuple[Completion, float]:
    """One episode: the trajectory as a Completion (environment tokens carry ENV_VERSION)
    and its reward, the last step's (an environment that scores turns adds them in). The
    environment's calls run on `code`'s threads; every decision is the episode machine's
    (`core.schedule.episode`), this only carries out its commands. `effects` (the
    attempt's `AttemptEffects`) is told the turn each environment call is of: the reset
    and turn 0 are turn 0, a replayed turn is the turn it replays, so a replay's calls are
    answered from the records of the calls it repeats. `built` gets the environment once it
    is built (the runner releases a lease environment's lease when the episode is over).
    An environment that recovers by lease is driven as one that recovers by snapshot, its
    `commit()` and `resume(handle)` in place of `snapshot()` and `restore(data)`. `gate`
    (the cut's environment phase): `await gate.begin()` before a step, `gate.end()` once
    the step, its commit and its turn's report are done."""
    at = (lambda turn: None) if effects is None else (lambda turn: effects.at(turn, spec.timeout_s))
    caps = capabilities_of(engine)
    lease = spec.recovery == LEASE
    tokenizer = caps.episode_tokenizer
    if spec.chat_template:  # responses join as chat turns (data.chat_template)
        from ..models.chat import chat_episodes

        tokenizer = chat_episodes(tokenizer, engine=getattr(engine, "name", type(engine).__name__))
    machine = Episode(req, tokenizer=tokenizer, max_turns=spec.max_turns, label=spec.label,
                      recovery=SNAPSHOT if lease else spec.recovery, max_turn_tokens=spec.max_turn_tokens,
                      max_snapshot_bytes=spec.max_snapshot_bytes, completion_limit=caps.completion_limit)

    async def call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
        return await _call(spec, code, what, fn, *args)

    env: Any = None
    stepping = False  # between a gated step's begin and its end (the cut's environment phase)
    cmd = machine.begin()
    try:
        while True:
            match cmd:
                case EnvBuild():
                    env = await call(cmd.what, spec.factory)
                    if built is not None:
                        built.append(env)
                    cmd = machine.on_built()
                case EnvRestore(snapshot=snapshot):
                    await call("resuming the lease" if lease else cmd.what, env.resume if lease else env.restore,
                               snapshot)
                    cmd = machine.on_restored()
                case EnvReset(row=row, seed=seed):
                    at(0)
                    await call(cmd.what, env.reset, row, seed)
                    cmd = machine.on_reset()
                case EnvReplay(turn=turn, text=text):
                    at(turn)
                    cmd = machine.on_replayed(_checked(spec, await call(cmd.what, env.step, text)))
                case Generate(request=turn_req):
                    c = await (engine.generate(turn_req, progress) if progress is not None
                               else engine.generate(turn_req))
                    cmd = machine.on_generated(c)
                case EnvStep(turn=turn, text=text):
                    if gate is not None:
                        await gate.begin()
                        stepping = True
                    at(turn)
                    cmd = machine.on_step(_checked(spec, await call(cmd.what, env.step, text)))
                case EnvSnapshot():
                    cmd = machine.on_snapshot(await call("commit" if lease else cmd.what,
                                                         env.commit if lease else env.snapshot))
                case Turn(trajectory=traj, turn=turn, snapshot=snapshot):
                    on_turn(traj, turn, snapshot)
                    if stepping:
                        stepping = False
                        gate.end()
                    cmd = machine.on_reported()
                case Done(completion=completion, reward=reward):
                    return completion, reward
                case _:  # pragma: no cover
                    raise AssertionError(f"unknown episode command {cmd!r}")
    finally:
        if stepping:
            gate.end()


def check_restored(prefixes: PrefixStore, spec: EnvSpec | None, where: str) -> None:
    """After a restore: every finished turn of an environment that recovers by snapshot has
    its snapshot, within env.max_snapshot_bytes (else RowsMismatch, exit 3: the episode
    cannot be continued as it was). `where`: the checkpoint restored, for the message."""
    if spec is None or spec.recovery not in (SNAPSHOT, LEASE):
        return
    for (gid, gen), chain in prefixes.capture().items():
        for link in chain:
            if link.turn >= 0 and (link.snapshot is None or len(link.snapshot) > spec.max_snapshot_bytes):
                found = "none" if link.snapshot is None else f"{len(link.snapshot)} bytes"
                raise RowsMismatch(
                    f"turn {link.turn} of episode {gid}/{gen} has no usable environment snapshot", path=where,
                    field="turns", expected=f"the snapshot of environment {spec.label} (recovery 'snapshot'), at "
                    f"most env.max_snapshot_bytes={spec.max_snapshot_bytes}", found=found,
                    remedy="the checkpoint was written with another environment or a larger env.max_snapshot_bytes, "
                    "or its rows index was damaged: resume with the env.* it was written with, or from an "
                    "older checkpoint")


async def _call(spec: EnvSpec, code: UserCode, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on one of `code`'s threads within env.timeout_s; any failure is a
    DataError (UserStop, the code asking the process to stop, passes through)."""
    try:
        return await code.call(f"environment {spec.label} ({what})", spec.timeout_s, fn, *args)
    except Overdue:
        raise DataError(f"environment {spec.label}: {what} took longer than env.timeout_s={spec.timeout_s:g} s") \
            from None
    except Exception as e:
        raise DataError(f"environment {spec.label}: {what} raised {type(e).__name__}: {e}") from None


def _checked(spec: EnvSpec, out: Any) -> Step:
    """A step's result as a Step, or a DataError saying what is wrong with it."""
    if isinstance(out, tuple) and not isinstance(out, Step) and 1 <= len(out) <= 3:
        out = Step(*out)
    if not (isinstance(out, Step) and isinstance(out.response, str) and isinstance(out.done, bool)
            and isinstance(out.reward, numbers.Real) and not isinstance(out.reward, bool)
            and np.isfinite(out.reward)):
        raise DataError(f"environment {spec.label}: step() must return Step(response: str, done: bool, "
                        f"reward: finite float); got {str(out)[:120]}")
    size = len(out.response.encode("utf-8", "surrogatepass"))
    if size > spec.max_response_bytes:
        raise DataError(f"environment {spec.label}: step() returned a response of {size} bytes, over "
                        f"env.max_response_bytes={spec.max_response_bytes}")
    return out


class _Bounded:
    """An environment whose `reset` and `step` run as `_call`'s do, but from a plain thread."""

    def __init__(self, spec: EnvSpec, env: Any) -> None:
        self._spec, self._env = spec, env

    def reset(self, row: Any, seed: int) -> None:
        _call_sync(self._spec, "reset", self._env.reset, row, seed)

    def step(self, text: str) -> Step:
        return _checked(self._spec, _call_sync(self._spec, "step", self._env.step, text))


def bounded(spec: EnvSpec) -> Callable[[], _Bounded]:
    """A factory of the spec's environments for the synchronous paths (warm start, eval):
    each call (the factory's too) within env.timeout_s, its step checked as an episode's,
    any failure a DataError."""
    return lambda: _Bounded(spec, _call_sync(spec, "factory", spec.factory))


def _call_sync(spec: EnvSpec, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return call_sync(spec.timeout_s, fn, *args)
    except TimeoutError:
        raise DataError(f"environment {spec.label}: {what} took longer than env.timeout_s={spec.timeout_s:g} s") \
            from None
    except (Exception, UserStop) as e:  # (a UserStop's text names the SystemExit or KeyboardInterrupt)
        raised = e if isinstance(e, UserStop) else f"{type(e).__name__}: {e}"
        raise DataError(f"environment {spec.label}: {what} raised {raised}") from None


async def release(spec: EnvSpec, code: UserCode, env: Any = None, handle: bytes | None = None) -> str | None:
    """End a lease: the live environment's (`env`), or, on a fresh one, the lease of the
    episode `handle` names (`resume(handle)`, then `release()`). None, or what failed (a
    release that fails is reported, never retried: the server's lease may time out)."""
    try:
        if env is None:
            env = await _call(spec, code, "factory", spec.factory)
            await _call(spec, code, "resuming the lease to release it", env.resume, handle)
        await _call(spec, code, "release", env.release)
    except DataError as e:
        return str(e)
    return None

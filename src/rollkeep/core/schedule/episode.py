"""One multi-turn episode as a sans-IO state machine (docs/design.md §5.4).

The machine makes every decision of an episode and never waits, does IO or reads a clock:
its driver (the runner's `controller.episodes.run_episode`, the simulation's world) carries
out the command it is given and feeds the result back, which returns the next command.

    command                          the driver                  then
    EnvBuild()                       builds a fresh environment  on_built()
    EnvRestore(snapshot)             env.restore(snapshot)       on_restored()
    EnvReset(row, seed)              env.reset(row, seed)        on_reset()
    EnvReplay(turn, text, recorded)  env.step(text)              on_replayed(step)
    Generate(request)                engine.generate(request)    on_generated(completion)
    EnvStep(turn, text)              env.step(text)              on_step(step)
    EnvSnapshot()                    env.snapshot()              on_snapshot(data)
    Turn(trajectory, turn, snapshot) reports the finished turn   on_reported()
    Done(completion, reward)         the episode is over

`begin()` gives the first command. A `step` is anything with `response: str`, `done: bool`
and `reward: float` (`envs.Step`, checked by the driver: user code's output is validated
where it is called). Each command's `what` names the call for the driver's messages.

The episode: a fresh environment is brought to the state after `req.turns` (the finished
turns the attempt continues): restored from `req.snapshot` for an environment that recovers
by snapshot, else reset and stepped through the recorded model turns, each answer checked
against the recorded response (a difference is a DataError: the environment is not
deterministic). Then, turn after turn, the model's turn is a generation continuing the
trajectory so far (`GenRequest.prefix`, `turns`; its cap `max_turn_tokens` is
`GenRequest.max_tokens`) and the environment steps on its text. The episode ends when a
turn generates nothing, when the environment says it is done, after `max_turns` turns
(always at least one: a resume with a lowered `max_turns` takes its last one), or when the
environment's response would spend what is left of the engine's budget
(`completion_limit(prompt_tokens)`, None: none). Every finished turn but the last is
reported (`Turn`, after the environment's snapshot when it recovers by one) before the
next generation. The reward is the last step's.

An environment's response joins the trajectory as the tokenizer's `encode(response,
bos=False)`, or, for a tokenizer that renders a chat template (`data.chat_template`,
`models.chat.ChatTemplate`), as `response_ids(conversation, model_ids, response)`: the
template's tokens after the model's turn, the response as a chat turn and the next
generation prompt, all of them environment tokens; a restored episode's recorded responses
are read back through its `response_text`. A conversation the template cannot render
token by token fails the attempt (DataError).

`EPISODE_TABLE` is every transition; a pair not listed is a bug of the machine or its
driver (CustodyError), as is an input in a state that does not wait for it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import numpy as np

from ..errors import CustodyError
from ..rollout.generation import Completion, DataError, GenRequest, Tokens
from ..rollout.rows import ENV_VERSION

__all__ = ["EPISODE_TABLE", "SNAPSHOT", "WAITS_FOR", "Done", "EnvBuild", "EnvReplay", "EnvReset", "EnvRestore",
           "EnvSnapshot", "EnvStep", "Episode", "EpisodeCommand", "EpisodeState", "Generate", "Turn"]

SNAPSHOT = "snapshot"  # the recovery mode restored from a snapshot (`envs.SNAPSHOT`); any other replays
_EMPTY = Tokens(np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32))


class Tokenizer(Protocol):
    """`encode(text, bos=False)`, `decode(ids)`; one that renders a chat template also has
    `response_ids(conversation, model_ids, response)` and `response_text(conversation,
    model_ids, recorded)` (`models.chat.ChatTemplate`; the conversation: the prompt, then
    the model's turns and the responses alternately, ending with the model's turn)."""

    def encode(self, text: str, bos: bool = ...) -> Any: ...
    def decode(self, ids: Any) -> str: ...


class StepLike(Protocol):
    response: str
    done: bool
    reward: float


# ====================================================================== commands


@dataclass(frozen=True)
class EnvBuild:
    what = "building the environment"


@dataclass(frozen=True)
class EnvRestore:
    snapshot: bytes
    what = "restoring the snapshot"


@dataclass(frozen=True)
class EnvReset:
    row: Any
    seed: int
    what = "reset"


@dataclass(frozen=True)
class EnvReplay:
    turn: int
    text: str  # the recorded model turn, to step the environment with
    recorded: np.ndarray  # int32: the environment's recorded response to it, as tokens

    @property
    def what(self) -> str:
        return f"replay of turn {self.turn}"


@dataclass(frozen=True)
class Generate:
    request: GenRequest  # the model's turn: continues `request.prefix`


@dataclass(frozen=True)
class EnvStep:
    turn: int
    text: str  # the model's turn, decoded

    @property
    def what(self) -> str:
        return f"step of turn {self.turn}"


@dataclass(frozen=True)
class EnvSnapshot:
    what = "snapshot"


@dataclass(frozen=True)
class Turn:
    trajectory: Tokens  # every token so far, the environment's response to `turn` last
    turn: int
    snapshot: bytes | None  # the environment's, after the turn (recovery by snapshot)


@dataclass(frozen=True)
class Done:
    completion: Completion  # the trajectory (environment tokens carry ENV_VERSION)
    reward: float  # the last step's


EpisodeCommand = EnvBuild | EnvRestore | EnvReset | EnvReplay | Generate | EnvStep | EnvSnapshot | Turn | Done


# ====================================================================== the table


class EpisodeState(enum.StrEnum):
    START = "start"  # not begun
    BUILDING = "building"  # EnvBuild given
    RESTORING = "restoring"  # EnvRestore given
    RESETTING = "resetting"  # EnvReset given
    REPLAYING = "replaying"  # EnvReplay given
    GENERATING = "generating"  # Generate given
    STEPPING = "stepping"  # EnvStep given
    SNAPSHOTTING = "snapshotting"  # EnvSnapshot given
    REPORTING = "reporting"  # Turn given
    DONE = "done"  # Done given
    FAILED = "failed"  # a DataError raised


_E = EpisodeState

#: (state, what happened) → next state. Pairs not listed are a bug (CustodyError).
EPISODE_TABLE: dict[tuple[EpisodeState, str], EpisodeState] = {
    (_E.START, "build"): _E.BUILDING,
    (_E.BUILDING, "restore"): _E.RESTORING,  # turns to continue, recovery by snapshot
    (_E.BUILDING, "reset"): _E.RESETTING,  # a new episode, or turns to replay
    (_E.BUILDING, "no_snapshot"): _E.FAILED,  # turns to restore, but no snapshot of them
    (_E.RESTORING, "generate"): _E.GENERATING,
    (_E.RESTORING, "bad_render"): _E.FAILED,  # a recorded response the chat template does not render
    (_E.RESETTING, "replay"): _E.REPLAYING,  # the first recorded turn
    (_E.RESETTING, "generate"): _E.GENERATING,  # no turns to replay
    (_E.REPLAYING, "replay"): _E.REPLAYING,  # it answered as recorded: the next turn
    (_E.REPLAYING, "generate"): _E.GENERATING,  # ... and that was the last
    (_E.REPLAYING, "mismatch"): _E.FAILED,  # it answered otherwise: not deterministic
    (_E.REPLAYING, "bad_render"): _E.FAILED,  # the chat template cannot render the conversation
    (_E.GENERATING, "step"): _E.STEPPING,
    (_E.GENERATING, "nothing_generated"): _E.DONE,  # the budget is spent or the context is full
    (_E.STEPPING, "env_done"): _E.DONE,  # the environment says so: finish "stop"
    (_E.STEPPING, "max_turns"): _E.DONE,
    (_E.STEPPING, "budget"): _E.DONE,  # the response would spend what is left of the budget
    (_E.STEPPING, "bad_render"): _E.FAILED,  # the chat template cannot render the conversation
    (_E.STEPPING, "snapshot"): _E.SNAPSHOTTING,  # the turn is finished; recovery by snapshot
    (_E.STEPPING, "report"): _E.REPORTING,  # the turn is finished
    (_E.SNAPSHOTTING, "report"): _E.REPORTING,
    (_E.SNAPSHOTTING, "bad_snapshot"): _E.FAILED,
    (_E.REPORTING, "generate"): _E.GENERATING,  # the next turn
}

#: The driver's input each state waits for (DONE and FAILED wait for none).
WAITS_FOR: dict[EpisodeState, str] = {
    _E.START: "begin",
    _E.BUILDING: "on_built",
    _E.RESTORING: "on_restored",
    _E.RESETTING: "on_reset",
    _E.REPLAYING: "on_replayed",
    _E.GENERATING: "on_generated",
    _E.STEPPING: "on_step",
    _E.SNAPSHOTTING: "on_snapshot",
    _E.REPORTING: "on_reported",
}


# ====================================================================== the machine


class Episode:
    """One attempt's episode. `req`: the attempt (its prefix and finished turns); the rest
    are the environment's settings (`envs.EnvSpec`: `max_turns`, `max_turn_tokens`,
    `recovery`, `max_snapshot_bytes`, `label` for messages), the engine's tokenizer
    (`encode(text, bos=False)`, `decode(ids)`) and its budget (`completion_limit`)."""

    def __init__(self, req: GenRequest, *, tokenizer: Tokenizer, max_turns: int, label: str,
                 recovery: str = "replay", max_turn_tokens: int | None = None,
                 max_snapshot_bytes: int = 1 << 20,
                 completion_limit: Callable[[int], int | None] | None = None) -> None:
        self.req, self.tok, self.label = req, tokenizer, label
        self.max_turns, self.max_turn_tokens, self.recovery = max_turns, max_turn_tokens, recovery
        self.max_snapshot_bytes, self.completion_limit = max_snapshot_bytes, completion_limit
        self.state = EpisodeState.START
        self.trail: list[tuple[EpisodeState, str]] = []  # every transition taken, in order
        self.traj: Tokens = req.prefix if req.prefix is not None else _EMPTY
        self.turns: list[int] = list(req.turns)  # where each finished turn ends
        self.texts: list[str] = []  # the turns' and responses' texts so far
        self.finish = "length"
        self.reward = 0.0  # the last step's
        self._replay: list[tuple[str, np.ndarray, np.ndarray]] = []  # recorded turns still to replay (text, ids, response)
        self._last: Completion | None = None  # the last generation
        self._response: np.ndarray = np.zeros(0, np.int32)

    # ------------------------------------------------------------ inputs

    def begin(self) -> EpisodeCommand:
        self._expect("begin")
        self._go("build")
        return EnvBuild()

    def on_built(self) -> EpisodeCommand:
        """The environment is built: restore it, or reset it (and replay the recorded turns)."""
        self._expect("on_built")
        req = self.req
        if req.turns and self.recovery == SNAPSHOT:
            if req.snapshot is None:
                self._go("no_snapshot")
                raise DataError(f"environment {self.label}: turn {len(req.turns) - 1} of "
                                f"{req.group_id}/{req.generation} has no snapshot to restore")
            self._go("restore")
            return EnvRestore(req.snapshot)
        self._go("reset")
        return EnvReset(req.prompt.row, req.seed)

    def on_restored(self) -> EpisodeCommand:
        """Restored: the recorded responses are taken as they are."""
        self._expect("on_restored")
        texts: list[str] = []
        recover = getattr(self.tok, "response_text", None)  # a chat template's
        for model, recorded in self._recorded():
            texts.append(self.tok.decode(model))
            texts.append(self.tok.decode(recorded) if recover is None
                         else self._rendering(recover, [self.req.prompt.prompt, *texts], model, recorded))
        self.texts += texts
        self._go("generate")
        return self._generate()

    def on_reset(self) -> EpisodeCommand:
        self._expect("on_reset")
        self._replay = [(self.tok.decode(model), model, recorded) for model, recorded in self._recorded()]
        return self._next_replay()

    def on_replayed(self, step: StepLike) -> EpisodeCommand:
        """The environment's answer to a recorded turn: it must be the recorded response."""
        self._expect("on_replayed")
        text, model, recorded = self._replay[0]
        turn = len(self.texts) // 2
        if step.done or not np.array_equal(self._response_ids([*self.texts, text], model, step.response), recorded):
            self._go("mismatch")
            req = self.req
            raise DataError(
                f"environment {self.label} replayed turn {turn} of {req.group_id}/{req.generation} "
                f"differently: recorded response {self.tok.decode(recorded)!r}, now "
                f"{'done' if step.done else repr(step.response)} (a `replay` environment must be a "
                "function of row, seed and turns; declare recovery='snapshot' otherwise)")
        self._replay.pop(0)
        self.texts += [text, step.response]
        return self._next_replay()

    def on_generated(self, completion: Completion) -> EpisodeCommand:
        """The model's turn: the trajectory so far, continued."""
        self._expect("on_generated")
        self._last = c = completion
        self.traj = Tokens(c.completion_ids, c.logprobs, c.versions)
        turn_ids = self.traj.completion_ids[self._start():]  # a continued prefix's tokens included
        if not len(turn_ids):
            self._go("nothing_generated")  # the budget is spent or the context is full
            return self._done()
        text = self.tok.decode(turn_ids)
        self.texts.append(text)
        self._go("step")
        return EnvStep(len(self.turns), text)

    def on_step(self, step: StepLike) -> EpisodeCommand:
        """The environment's answer to the model's turn."""
        self._expect("on_step")
        self.reward = step.reward
        if step.done or len(self.turns) + 1 >= self.max_turns:
            self.finish = "stop" if step.done else "length"
            self._go("env_done" if step.done else "max_turns")
            return self._done()
        response = self._response_ids(self.texts, self.traj.completion_ids[self._start():], step.response)
        assert self._last is not None
        limit = None if self.completion_limit is None else self.completion_limit(len(self._last.prompt_ids))
        if limit is not None and len(self.traj) + len(response) >= limit:
            self._go("budget")  # the response would spend what is left of the budget: the episode is cut here
            return self._done()
        t = self.traj
        self.traj = Tokens(np.concatenate([t.completion_ids, response]),
                           np.concatenate([t.logprobs, np.zeros(len(response), np.float32)]),
                           np.concatenate([t.versions, np.full(len(response), ENV_VERSION, np.int32)]))
        self.texts.append(step.response)
        if self.recovery == SNAPSHOT:
            self._go("snapshot")
            return EnvSnapshot()
        self._go("report")
        return Turn(self.traj, len(self.turns), None)

    def on_snapshot(self, data: Any) -> EpisodeCommand:
        """The environment's snapshot after the turn: bytes, at most `max_snapshot_bytes`."""
        self._expect("on_snapshot")
        if not isinstance(data, bytes | bytearray) or len(data) > self.max_snapshot_bytes:
            found = f"{type(data).__name__}" if not isinstance(data, bytes | bytearray) else f"{len(data)} bytes"
            self._go("bad_snapshot")
            raise DataError(f"environment {self.label}: snapshot() must return at most env.max_snapshot_bytes="
                            f"{self.max_snapshot_bytes} bytes; got {found}")
        self._go("report")
        return Turn(self.traj, len(self.turns), bytes(data))

    def on_reported(self) -> EpisodeCommand:
        """The finished turn is reported: the next one."""
        self._expect("on_reported")
        self.turns.append(len(self.traj))
        self._go("generate")
        return self._generate()

    # ------------------------------------------------------------ internals

    def _start(self) -> int:
        return self.turns[-1] if self.turns else 0  # where the turn in progress begins

    def _generate(self) -> Generate:
        start = self._start()
        cap = None if self.max_turn_tokens is None else start + self.max_turn_tokens
        return Generate(msgspec.structs.replace(self.req, prefix=self.traj if len(self.traj) else None,
                                                turns=tuple(self.turns), max_tokens=cap))

    def _response_ids(self, texts: list[str], model: np.ndarray, response: str) -> np.ndarray:
        """The response's tokens after the turns and responses `texts`, which end with the
        model's turn (its tokens `model`)."""
        render = getattr(self.tok, "response_ids", None)  # a chat template's
        if render is None:
            return np.asarray(self.tok.encode(response, bos=False), np.int32)
        return np.asarray(self._rendering(render, [self.req.prompt.prompt, *texts], model, response), np.int32)

    def _rendering(self, render: Callable[..., Any], conversation: list[str], model: np.ndarray, arg: Any) -> Any:
        """`render(conversation, model ids, arg)`; a conversation the template cannot render
        is a data failure of the attempt (DataError, the machine FAILED)."""
        try:
            return render(conversation, [int(t) for t in model], arg)
        except DataError as e:
            self._go("bad_render")
            req = self.req
            raise DataError(f"environment {self.label}, episode {req.group_id}/{req.generation}: {e}") from None

    def _recorded(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each finished turn's model tokens and the environment's recorded response."""
        out, start, traj = [], 0, self.traj
        for end in self.req.turns:
            ids, versions = traj.completion_ids[start:end], traj.versions[start:end]
            out.append((ids[versions != ENV_VERSION], ids[versions == ENV_VERSION]))
            start = end
        return out

    def _next_replay(self) -> EpisodeCommand:
        if self._replay:
            self._go("replay")
            text, _, recorded = self._replay[0]
            return EnvReplay(len(self.texts) // 2, text, recorded)
        self._go("generate")
        return self._generate()

    def _done(self) -> Done:
        c = self._last
        assert c is not None
        t = self.traj
        return Done(Completion(prompt_ids=c.prompt_ids, completion_ids=t.completion_ids, logprobs=t.logprobs,
                               versions=t.versions, finish_reason=self.finish, text="".join(self.texts),
                               replica=c.replica), float(self.reward))

    def _expect(self, what: str) -> None:
        if WAITS_FOR.get(self.state) != what:
            raise CustodyError(f"episode {self.req.group_id}/{self.req.generation}: {what}() in state "
                               f"{self.state.value}", expected=WAITS_FOR.get(self.state, "nothing (it is over)"),
                               found=what, remedy="this is a bug in the episode's driver")

    def _go(self, what: str) -> None:
        nxt = EPISODE_TABLE.get((self.state, what))
        if nxt is None:
            raise CustodyError(f"episode: '{what}' in state {self.state.value}", expected="a pair of EPISODE_TABLE",
                               found=f"({self.state.value}, {what})", remedy="this is a bug in the episode machine")
        self.trail.append((self.state, what))
        self.state = nxt

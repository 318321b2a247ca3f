"""The episode machine (core/schedule/episode.py) on its own, driven by a scripted engine
and environment with no IO: the commands it gives, each termination rule, the rebuild (replay
and its check, snapshot), an episode continued after k finished turns, and its table."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from rollkeep.core.errors import CustodyError
from rollkeep.core.rollout.generation import Completion, DataError, GenRequest, Tokens
from rollkeep.core.rollout.rows import ENV_VERSION
from rollkeep.core.rollout.source import Prompt
from rollkeep.core.schedule.episode import (
    EPISODE_TABLE,
    SNAPSHOT,
    WAITS_FOR,
    Done,
    EnvBuild,
    EnvReplay,
    EnvReset,
    EnvRestore,
    EnvSnapshot,
    EnvStep,
    Episode,
    EpisodeState,
    Generate,
    Turn,
)
from rollkeep.envs import SNAPSHOT as ENVS_SNAPSHOT
from rollkeep.envs import Step

ROW = {"prompt": "1+1=", "answer": "2"}
LENGTHS = (3, 2, 4, 1, 2)  # the model's turns, in tokens (the scripted engine's)


class Tok:
    """ids <-> space-separated numbers."""

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: Any) -> str:
        return " ".join(str(int(i)) for i in np.asarray(ids).tolist())


class Engine:
    """Continues the prefix to the end of the turn (LENGTHS), within max_tokens and the budget;
    token at position p is (3p + 1) % 10 under version 5."""

    def __init__(self, budget: int | None = None, lengths: tuple[int, ...] = LENGTHS) -> None:
        self.budget, self.lengths, self.calls = budget, lengths, 0

    def completion_limit(self, prompt_tokens: int) -> int | None:
        assert prompt_tokens == 3
        return self.budget

    def generate(self, req: GenRequest) -> Completion:
        self.calls += 1
        p = req.prefix
        first = 0 if p is None else len(p)
        start = req.turns[-1] if req.turns else 0
        end = start + self.lengths[len(req.turns)]
        for limit in (req.max_tokens, self.budget):
            end = end if limit is None else min(end, limit)
        new = np.array([(3 * i + 1) % 10 for i in range(first, max(first, end))], np.int32)
        old = p if p is not None else Tokens(np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32))
        return Completion(prompt_ids=np.arange(3, dtype=np.int32),
                          completion_ids=np.concatenate([old.completion_ids, new]),
                          logprobs=np.concatenate([old.logprobs, np.full(len(new), -0.5, np.float32)]),
                          versions=np.concatenate([old.versions, np.full(len(new), 5, np.int32)]),
                          finish_reason="length", text="", replica=2)


class Env:
    """Deterministic: its n-th step since reset answers `answer(n)`, done at `done_at`,
    rewarded n / 10."""

    def __init__(self, done_at: int | None = None, answer=lambda n: f"{n} 9") -> None:
        self.done_at, self.answer, self.n, self.log = done_at, answer, 0, []

    def reset(self, row: Any, seed: int) -> None:
        self.log.append(("reset", row, seed))
        self.n = 0

    def step(self, text: str) -> Step:
        self.log.append(("step", text))
        self.n += 1
        return Step(self.answer(self.n), self.done_at is not None and self.n >= self.done_at, self.n / 10)

    def snapshot(self) -> bytes:
        return str(self.n).encode()

    def restore(self, data: bytes) -> None:
        self.log.append(("restore", data))
        self.n = int(data)


def request(**kw: Any) -> GenRequest:
    prompt = Prompt(key=(0, 0), group_id="g0.1", idx=0, task="t", row=ROW, row_fingerprint=0, prompt=ROW["prompt"])
    kw = {"attempt": 0, **kw}
    return GenRequest(group_id="g0.1", generation=2, prompt=prompt, seed=99, pinned_version=None, **kw)


class ChatTok(Tok):
    """A chat template's tokenizer (`models.chat.ChatTemplate`'s two methods): a response
    joins as 70 (its role marker), its ids, 71 (the next generation prompt); `fail`: the
    template cannot render the conversation (a ChatTemplateError is a DataError)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.seen = fail, []

    def response_ids(self, conversation: list[str], model_ids: list[int], response: str) -> list[int]:
        self.seen.append((list(conversation), list(model_ids)))
        if self.fail:
            raise DataError("chat template: it rewrites earlier turns")
        return [70, *self.encode(response), 71]

    def response_text(self, conversation: list[str], model_ids: list[int], recorded: Any) -> str:
        if self.fail:
            raise DataError("chat template: no response renders to these tokens")
        return self.decode(np.asarray(recorded)[1:-1])


def machine(req: GenRequest | None = None, *, engine: Engine | None = None, max_turns: int = 3,
            recovery: str = "replay", tokenizer: Any = None, **kw: Any) -> tuple[Episode, Engine]:
    engine = engine or Engine()
    kw = {"completion_limit": engine.completion_limit, **kw}
    return Episode(req or request(), tokenizer=tokenizer or Tok(), max_turns=max_turns, label="test",
                   recovery=recovery, **kw), engine


def drive(m: Episode, engine: Engine, env: Env | None = None) -> tuple[list[Any], Done]:
    """Carry out every command as a runner does; return them all and the last (Done)."""
    env = env or Env()
    cmds, cmd = [], m.begin()
    while True:
        cmds.append(cmd)
        match cmd:
            case EnvBuild():
                cmd = m.on_built()
            case EnvRestore(snapshot=s):
                env.restore(s)
                cmd = m.on_restored()
            case EnvReset(row=row, seed=seed):
                env.reset(row, seed)
                cmd = m.on_reset()
            case EnvReplay(text=text):
                cmd = m.on_replayed(env.step(text))
            case Generate(request=r):
                cmd = m.on_generated(engine.generate(r))
            case EnvStep(text=text):
                cmd = m.on_step(env.step(text))
            case EnvSnapshot():
                cmd = m.on_snapshot(env.snapshot())
            case Turn():
                cmd = m.on_reported()
            case Done():
                assert m.state is EpisodeState.DONE
                return cmds, cmd


def kinds(cmds: list[Any]) -> list[str]:
    return [type(c).__name__ for c in cmds]


def last_rule(m: Episode) -> str:
    return m.trail[-1][1]


# ====================================================================== a fresh episode


def test_a_fresh_episode_builds_resets_and_alternates_model_turns_and_steps_until_max_turns() -> None:
    m, engine = machine()
    env = Env()
    cmds, done = drive(m, engine, env)
    assert kinds(cmds) == ["EnvBuild", "EnvReset", "Generate", "EnvStep", "Turn", "Generate", "EnvStep", "Turn",
                           "Generate", "EnvStep", "Done"]
    assert cmds[1] == EnvReset(ROW, 99) and env.log[0] == ("reset", ROW, 99)
    gens = [c.request for c in cmds if isinstance(c, Generate)]
    assert gens[0].prefix is None and gens[0].turns == () and gens[0].max_tokens is None
    assert [g.turns for g in gens] == [(), (5,), (5, 9)]  # 3 model + 2 env tokens, then 2 + 2
    assert [c.what for c in cmds if isinstance(c, EnvStep)] == ["step of turn 0", "step of turn 1", "step of turn 2"]
    turns = [c for c in cmds if isinstance(c, Turn)]
    assert [t.turn for t in turns] == [0, 1] and all(t.snapshot is None for t in turns)
    c = done.completion
    assert last_rule(m) == "max_turns" and c.finish_reason == "length" and c.replica == 2
    assert done.reward == pytest.approx(0.3)  # the last step's
    env_tok = c.versions == ENV_VERSION
    assert c.completion_ids[env_tok].tolist() == [1, 9, 2, 9]  # the responses "1 9", "2 9" (not the last)
    assert (c.logprobs[env_tok] == 0).all() and (c.versions[~env_tok] == 5).all()
    assert len(c.completion_ids) == 3 + 2 + 2 + 2 + 4
    for t in turns:  # each report is the trajectory so far, its response last
        assert np.array_equal(t.trajectory.completion_ids, c.completion_ids[: len(t.trajectory)])
        assert t.trajectory.versions[-1] == ENV_VERSION
    tok = Tok()
    assert c.text == "".join([tok.decode(c.completion_ids[:3]), "1 9", tok.decode(c.completion_ids[5:7]), "2 9",
                              tok.decode(c.completion_ids[9:])])


def test_the_environment_saying_done_ends_the_episode_with_stop_and_its_reward() -> None:
    m, engine = machine(max_turns=5)
    cmds, done = drive(m, engine, Env(done_at=2))
    assert last_rule(m) == "env_done" and done.completion.finish_reason == "stop"
    assert kinds(cmds).count("Turn") == 1 and done.reward == pytest.approx(0.2)
    assert (done.completion.versions[-2:] == 5).all()  # the last turn's response is not appended


def test_done_takes_precedence_over_max_turns() -> None:
    m, engine = machine(max_turns=2)
    _, done = drive(m, engine, Env(done_at=2))
    assert last_rule(m) == "env_done" and done.completion.finish_reason == "stop"


def test_a_turn_that_generates_nothing_ends_the_episode() -> None:
    m, engine = machine(engine=Engine(lengths=(3, 0, 4)), max_turns=5)
    cmds, done = drive(m, engine)
    assert last_rule(m) == "nothing_generated" and done.completion.finish_reason == "length"
    assert kinds(cmds)[-3:] == ["Turn", "Generate", "Done"]
    assert done.reward == pytest.approx(0.1)  # the last step's: turn 0's
    assert len(done.completion.completion_ids) == 5  # the trajectory as reported, its response included
    m, engine = machine(engine=Engine(lengths=(0,)))  # nothing at all: no step, reward 0
    cmds, done = drive(m, engine)
    assert kinds(cmds) == ["EnvBuild", "EnvReset", "Generate", "Done"] and done.reward == 0.0


def test_a_response_that_would_spend_the_engines_budget_ends_the_episode_before_it() -> None:
    # 3 model tokens + 2 (turn 0) + 2 model = 7; turn 1's response would make 9 >= 9.
    m, engine = machine(engine=Engine(budget=9), max_turns=5)
    cmds, done = drive(m, engine)
    assert last_rule(m) == "budget" and done.completion.finish_reason == "length"
    assert kinds(cmds).count("Turn") == 1 and len(done.completion.completion_ids) == 7
    assert done.reward == pytest.approx(0.2)
    m, engine = machine(engine=Engine(budget=10), max_turns=5)  # 9 < 10: turn 1 is finished; turn 2 is one token
    cmds, done = drive(m, engine)
    assert last_rule(m) == "budget" and kinds(cmds).count("Turn") == 2 and len(done.completion.completion_ids) == 10
    m, _ = machine(max_turns=5, completion_limit=None)  # an engine without a budget
    _, done = drive(m, Engine(budget=None))
    assert last_rule(m) == "max_turns"


def test_max_turn_tokens_caps_every_model_turn() -> None:
    m, engine = machine(max_turn_tokens=2)
    cmds, done = drive(m, engine)
    gens = [c.request for c in cmds if isinstance(c, Generate)]
    assert [g.max_tokens for g in gens] == [2, 4 + 2, 8 + 2]  # each turn's start + the cap
    assert len(done.completion.completion_ids) == 2 + 2 + 2 + 2 + 2


# ====================================================================== the rebuild


def uninterrupted(recovery: str, max_turns: int = 4, env: Env | None = None) -> tuple[list[Any], Done]:
    m, engine = machine(max_turns=max_turns, recovery=recovery)
    return drive(m, engine, env)


def continued(cmds: list[Any], k: int, extra: int = 0) -> GenRequest:
    """The request of an attempt continuing after the k-th finished turn (and `extra` tokens
    of the turn in flight), as the scheduler dispatches it."""
    turns = [c for c in cmds if isinstance(c, Turn)]
    full = [c for c in cmds if isinstance(c, Done)][0].completion
    end = len(turns[k - 1].trajectory) + extra
    prefix = Tokens(full.completion_ids[:end], full.logprobs[:end], full.versions[:end])
    return request(prefix=prefix, turns=tuple(len(t.trajectory) for t in turns[:k]), snapshot=turns[k - 1].snapshot,
                   attempt=1)


@pytest.mark.parametrize("recovery", ["replay", SNAPSHOT])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_an_episode_continued_after_k_finished_turns_ends_as_one_never_interrupted(recovery: str, k: int) -> None:
    cmds, done = uninterrupted(recovery)
    env = Env()
    m, engine = machine(continued(cmds, k), max_turns=4, recovery=recovery)
    again, done2 = drive(m, engine, env)
    c, c2 = done.completion, done2.completion
    for f in ("completion_ids", "logprobs", "versions"):
        assert np.array_equal(getattr(c, f), getattr(c2, f))
    assert (c.text, c.finish_reason, done.reward) == (c2.text, c2.finish_reason, done2.reward)
    assert [t.turn for t in again if isinstance(t, Turn)] == list(range(k, 3))  # it reports the turns after k
    assert engine.calls == 4 - k  # the finished turns are not generated again
    first_gen = next(g.request for g in again if isinstance(g, Generate))
    assert first_gen.turns == continued(cmds, k).turns and first_gen.attempt == 1
    if recovery == SNAPSHOT:
        assert kinds(again)[:3] == ["EnvBuild", "EnvRestore", "Generate"] and "EnvReplay" not in kinds(again)
        assert env.log[0] == ("restore", str(k).encode())
        assert [t.snapshot for t in again if isinstance(t, Turn)] == [str(n).encode() for n in range(k + 1, 4)]
    else:
        assert kinds(again)[:2 + k + 1] == ["EnvBuild", "EnvReset"] + ["EnvReplay"] * k + ["Generate"]
        replays = [r for r in again if isinstance(r, EnvReplay)]
        assert [r.what for r in replays] == [f"replay of turn {i}" for i in range(k)]
        assert [r.recorded.tolist() for r in replays] == [[n, 9] for n in range(1, k + 1)]
        assert env.log[1:k + 1] == [("step", r.text) for r in replays]


@pytest.mark.parametrize("recovery", ["replay", SNAPSHOT])
def test_a_turn_in_flight_is_continued_from_its_tokens(recovery: str) -> None:
    cmds, done = uninterrupted(recovery)
    m, engine = machine(continued(cmds, 1, extra=1), max_turns=4, recovery=recovery)
    again, done2 = drive(m, engine)
    assert np.array_equal(done.completion.completion_ids, done2.completion.completion_ids)
    assert done.completion.text == done2.completion.text


def test_a_resume_with_a_lowered_max_turns_still_takes_one_turn() -> None:
    cmds, _ = uninterrupted("replay")
    m, engine = machine(continued(cmds, 3), max_turns=2)
    again, done = drive(m, engine)
    assert kinds(again)[-3:] == ["Generate", "EnvStep", "Done"] and last_rule(m) == "max_turns"


def test_snapshot_recovery_snapshots_every_finished_turn_but_the_last() -> None:
    cmds, _ = uninterrupted(SNAPSHOT)
    assert kinds(cmds) == ["EnvBuild", "EnvReset"] + ["Generate", "EnvStep", "EnvSnapshot", "Turn"] * 3 + [
        "Generate", "EnvStep", "Done"]
    assert [t.snapshot for t in cmds if isinstance(t, Turn)] == [b"1", b"2", b"3"]
    assert SNAPSHOT == ENVS_SNAPSHOT


def test_a_replay_that_answers_differently_is_a_data_error_naming_the_environment_as_not_deterministic() -> None:
    cmds, _ = uninterrupted("replay")
    m, engine = machine(continued(cmds, 2), max_turns=4)
    with pytest.raises(DataError) as e:
        drive(m, engine, Env(answer=lambda n: "1 9" if n == 1 else "8 8"))
    assert str(e.value) == (
        "environment test replayed turn 1 of g0.1/2 differently: recorded response '2 9', now '8 8' (a `replay` "
        "environment must be a function of row, seed and turns; declare recovery='snapshot' otherwise)")
    assert m.state is EpisodeState.FAILED and last_rule(m) == "mismatch" and engine.calls == 0
    m, engine = machine(continued(cmds, 2), max_turns=4)
    with pytest.raises(DataError, match=r"replayed turn 0 of g0.1/2 differently: recorded response '1 9', now done"):
        drive(m, engine, Env(done_at=1))
    with pytest.raises(CustodyError):  # a failed episode takes no more input
        m.on_generated(engine.generate(request()))


def test_a_snapshot_environment_without_its_snapshot_or_with_a_bad_one_is_a_data_error() -> None:
    cmds, _ = uninterrupted(SNAPSHOT)
    req = msgspec.structs.replace(continued(cmds, 2), snapshot=None)
    m, engine = machine(req, recovery=SNAPSHOT)
    with pytest.raises(DataError) as e:
        drive(m, engine)
    assert str(e.value) == "environment test: turn 1 of g0.1/2 has no snapshot to restore"
    assert m.state is EpisodeState.FAILED and last_rule(m) == "no_snapshot"
    for bad, found in (("str", "str"), (b"x" * 9, "9 bytes")):
        m, engine = machine(recovery=SNAPSHOT, max_snapshot_bytes=8)
        env = Env()
        env.snapshot = lambda bad=bad: bad  # type: ignore[method-assign]
        with pytest.raises(DataError) as e:
            drive(m, engine, env)
        assert str(e.value) == ("environment test: snapshot() must return at most env.max_snapshot_bytes=8 bytes; "
                                f"got {found}")
        assert m.state is EpisodeState.FAILED and last_rule(m) == "bad_snapshot"
    m, engine = machine(recovery=SNAPSHOT, max_snapshot_bytes=8)  # a bytearray of 8 is fine, reported as bytes
    env = Env()
    env.snapshot = lambda: bytearray(b"12345678")  # type: ignore[method-assign]
    cmds, _ = drive(m, engine, env)
    assert all(type(t.snapshot) is bytes for t in cmds if isinstance(t, Turn))


# ====================================================================== the table


def test_an_input_the_state_does_not_wait_for_is_a_bug() -> None:
    m, engine = machine()
    with pytest.raises(CustodyError, match="on_built"):
        m.on_built()
    assert m.state is EpisodeState.START
    m.begin()
    with pytest.raises(CustodyError):
        m.on_step(Step("x"))
    _, done = drive(*machine())
    m2, _ = machine()
    drive(m2, Engine())
    with pytest.raises(CustodyError):
        m2.on_reported()


def every_scenario() -> list[Episode]:
    """One machine per path through the table."""
    out = []

    def run(m: Episode, engine: Engine, env: Env | None = None) -> None:
        out.append(m)
        try:
            drive(m, engine, env)
        except DataError:
            pass

    for recovery in ("replay", SNAPSHOT):
        cmds, _ = uninterrupted(recovery)
        for k in (1, 3):
            run(*machine(continued(cmds, k), max_turns=4, recovery=recovery))
        run(*machine(max_turns=4, recovery=recovery))
    run(*machine(max_turns=5), Env(done_at=2))
    run(*machine(engine=Engine(lengths=(3, 0))))
    run(*machine(engine=Engine(budget=9), max_turns=5))
    cmds, _ = uninterrupted("replay")
    run(*machine(continued(cmds, 2), max_turns=4), Env(answer=lambda n: "0"))
    cmds, _ = uninterrupted(SNAPSHOT)
    run(*machine(msgspec.structs.replace(continued(cmds, 2), snapshot=None), recovery=SNAPSHOT))
    env = Env()
    env.snapshot = lambda: "no"  # type: ignore[method-assign]
    run(*machine(recovery=SNAPSHOT), env)
    run(*machine(tokenizer=ChatTok(fail=True)))  # a response the chat template cannot render
    for recovery in ("replay", SNAPSHOT):  # ... nor a recorded one, replayed or restored
        cmds, _ = uninterrupted(recovery)
        run(*machine(continued(cmds, 1), recovery=recovery, tokenizer=ChatTok(fail=True)))
    return out


def test_the_table_is_complete_and_every_pair_of_it_is_taken() -> None:
    used = {pair for m in every_scenario() for pair in m.trail}
    assert used <= set(EPISODE_TABLE)  # (`_go` refuses any other: CustodyError)
    assert used == set(EPISODE_TABLE), set(EPISODE_TABLE) - used
    # Every state but the two ends waits for exactly one input and leads somewhere; the ends lead nowhere.
    sources = {s for s, _ in EPISODE_TABLE}
    ends = {EpisodeState.DONE, EpisodeState.FAILED}
    assert sources == set(EpisodeState) - ends == set(WAITS_FOR)
    assert set(EPISODE_TABLE.values()) | {EpisodeState.START} == set(EpisodeState)  # every state is reached
    for name in WAITS_FOR.values():
        assert callable(getattr(Episode, name))


def test_an_unlisted_pair_is_refused() -> None:
    m, _ = machine()
    with pytest.raises(CustodyError, match="EPISODE_TABLE"):
        m._go("generate")  # (START, generate) is not a transition
    assert m.state is EpisodeState.START and m.trail == []


# ====================================================================== a chat template


def test_with_a_chat_template_each_response_is_rendered_from_the_conversation_and_masked() -> None:
    """data.chat_template: the tokenizer renders the response after the conversation so far
    (the prompt, then the model's turns and the responses); every token it gives, role
    markers and generation prompt included, is the environment's."""
    tok = ChatTok()
    m, engine = machine(tokenizer=tok)
    _, done = drive(m, engine)
    c = done.completion
    env_tok = c.versions == ENV_VERSION
    assert c.completion_ids[env_tok].tolist() == [70, 1, 9, 71, 70, 2, 9, 71]
    assert (c.logprobs[env_tok] == 0).all() and (c.versions[~env_tok] == 5).all()
    first, second = tok.seen
    assert first == (["1+1=", Tok().decode(c.completion_ids[:3])], c.completion_ids[:3].tolist())
    assert second[0] == [*first[0], "1 9", Tok().decode(c.completion_ids[7:9])]
    assert second[1] == c.completion_ids[7:9].tolist()


@pytest.mark.parametrize("recovery", ["replay", SNAPSHOT])
def test_with_a_chat_template_a_continued_episode_ends_as_one_never_interrupted(recovery: str) -> None:
    m, engine = machine(max_turns=4, recovery=recovery, tokenizer=ChatTok())
    cmds, done = drive(m, engine)
    for k in (1, 2):
        tok = ChatTok()
        m2, engine2 = machine(continued(cmds, k), max_turns=4, recovery=recovery, tokenizer=tok)
        _, again = drive(m2, engine2)
        assert np.array_equal(again.completion.completion_ids, done.completion.completion_ids)
        assert np.array_equal(again.completion.versions, done.completion.versions)
        assert again.completion.text == done.completion.text  # the responses read back as their texts


@pytest.mark.parametrize("recovery", ["replay", SNAPSHOT])
def test_a_conversation_the_chat_template_cannot_render_is_a_data_failure(recovery: str) -> None:
    m, engine = machine(tokenizer=ChatTok(fail=True))
    with pytest.raises(DataError, match="episode g0.1/2: chat template: it rewrites"):
        drive(m, engine)
    assert m.state is EpisodeState.FAILED and last_rule(m) == "bad_render"
    cmds, _ = uninterrupted(recovery)
    m, engine = machine(continued(cmds, 1), recovery=recovery, tokenizer=ChatTok(fail=True))
    with pytest.raises(DataError, match="chat template"):
        drive(m, engine)
    assert m.state is EpisodeState.FAILED and last_rule(m) == "bad_render"

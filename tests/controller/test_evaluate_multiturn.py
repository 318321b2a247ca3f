"""Greedy multi-turn evaluation (`Evaluator(make_env=...)`, `greedy_episodes`) and the warm
start on demonstrations (`warmup.demonstration`), on scripted decoders and a scripted
environment: what each turn sees, when an episode stops, what is reported."""

from __future__ import annotations

import threading

import pytest
import torch

from rollkeep.cli import exit_code
from rollkeep.controller.episodes import bounded
from rollkeep.controller.evaluate import Evaluator, greedy_episodes
from rollkeep.controller.usercode import UserCodeError
from rollkeep.controller.warmup import demonstration
from rollkeep.core.errors import DatasetError
from rollkeep.envs import EnvSpec
from rollkeep.envs.base import Step
from rollkeep.envs.calc import make as make_calc
from rollkeep.models.gpt import GPT, GPTConfig
from rollkeep.models.sampling import greedy, greedy_ids
from rollkeep.models.tokenizer import EOS, CharTokenizer
from rollkeep.tasks import calc

TOK = CharTokenizer()
ROWS = [calc.problem(37, 48), calc.problem(12, 11)]


def show(ids) -> str:
    """A context as text, EOS as "|" (decode stops at EOS), BOS dropped."""
    return "".join("|" if i == EOS else TOK.decode([i]) for i in ids)


class Scripted:
    """A decoder that answers each context with the turn its script gives for that
    context's text, recording every call."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def __call__(self, model, contexts, *, max_new_tokens):
        self.calls.append(([show(c) for c in contexts], list(max_new_tokens)))
        out = []
        for c, budget in zip(contexts, max_new_tokens, strict=True):
            ids = TOK.encode(self.script(show(c)), bos=False) + [EOS]
            out.append(ids[:budget])
        return out


def demonstrator(text: str) -> str:
    """Follows the demonstration: call the tool, then copy its answer."""
    if text.endswith("="):
        return f"CALC({text[:-1]})"
    return text.rsplit("=", 1)[1].rstrip(";")


def run(script, rows=ROWS, **kw):
    decode = Scripted(script)
    args = dict(max_turns=3, max_new_tokens=40, greedy_ids=decode, block_size=64)
    args.update(kw)
    return greedy_episodes(None, TOK, rows, make_calc, **args), decode


def test_turns_see_the_trajectory_so_far_and_are_batched() -> None:
    eps, decode = run(demonstrator)
    assert [(e.text, e.reward, e.turns, e.responses) for e in eps] == [
        ("CALC(37*48)=1776;1776", 1.0, 2, 1), ("CALC(12*11)=132;132", 1.0, 2, 1)]
    # One call per turn for all live episodes; budgets = trajectory bound - trajectory so far.
    assert decode.calls == [
        (["37*48=", "12*11="], [40, 40]),
        (["37*48=CALC(37*48)|=1776;", "12*11=CALC(12*11)|=132;"], [40 - 18, 40 - 17]),
    ]


def test_episodes_stop_at_max_turns_and_at_the_bounds() -> None:
    always_call = lambda text: "CALC(1)"  # noqa: E731 -- never answers
    eps, decode = run(always_call, rows=ROWS[:1])
    assert (eps[0].turns, eps[0].responses, eps[0].reward) == (3, 2, 0.0)
    assert eps[0].text == "CALC(1)=1;CALC(1)=1;CALC(1)"
    # Trajectory bound 20: turn 1 (8) + "=1;" (3) leave 9 for turn 2 (8 + "=1;" do not fit).
    eps, _ = run(always_call, rows=ROWS[:1], max_new_tokens=20)
    assert (eps[0].turns, eps[0].text) == (2, "CALC(1)=1;CALC(1)")
    # block_size: the prompt (7) + 8 + 3 + 8 = 26; a second response (3) does not fit 28.
    eps, _ = run(always_call, rows=ROWS[:1], block_size=28)
    assert (eps[0].turns, eps[0].text) == (2, "CALC(1)=1;CALC(1)")
    # A turn cut short by its budget (no EOS) is scored and ends the episode.
    eps, _ = run(demonstrator, rows=ROWS[:1], max_new_tokens=5)
    assert (eps[0].text, eps[0].turns, eps[0].reward) == ("CALC(", 1, 0.0)


def test_evaluator_reports_episodes() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=TOK.vocab_size, n_layer=1, n_head=2, n_embd=16, block_size=64))
    wrong_second = lambda text: "CALC(2*2)" if text.endswith("=") else "9"  # noqa: E731
    ev = Evaluator(ROWS, model=model, tokenizer=TOK, max_new_tokens=40, num_samples=1,
                   make_env=make_calc, max_turns=3, greedy_ids=Scripted(wrong_second))
    res = ev.evaluate(model.state_dict())
    assert res.metrics == {"eval/accuracy": 0.0, "eval/reward_mean": 0.0, "eval/tool_calls": 1.0,
                           "eval/turns": 2.0, "eval/env_failures": 0.0}
    assert res.samples == [{"prompt": "37*48=", "completion": "CALC(2*2)=4;9", "reward": 0.0, "turns": 2,
                            "answer": "1776"}]
    ev.greedy_ids = Scripted(demonstrator)
    assert ev.evaluate(model.state_dict()).metrics["eval/accuracy"] == 1.0


def test_greedy_ids_agrees_with_greedy_and_honours_budgets() -> None:
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=TOK.vocab_size, n_layer=1, n_head=2, n_embd=16, block_size=16))
    prompts = ["1*2=", "33*4=", "5*6="]
    ids = greedy_ids(model, [TOK.encode(p) for p in prompts], max_new_tokens=6)
    assert [TOK.decode(x) for x in ids] == greedy(model, TOK, prompts, max_new_tokens=6)
    for x in ids:
        assert len(x) <= 6 and (EOS not in x or x.index(EOS) == len(x) - 1)
    per = greedy_ids(model, [TOK.encode(p) for p in prompts], max_new_tokens=[1, 0, 20])
    assert len(per[0]) == 1 and per[1] == [] and len(per[2]) <= 16 - 5  # block_size bounds it


def test_demonstration_examples() -> None:
    ex = demonstration(ROWS[0], make_calc, TOK)
    assert [(show(p), show(t)) for p, t in ex] == [
        ("37*48=", "CALC(37*48)|"), ("37*48=CALC(37*48)|=1776;", "1776|")]
    assert ex[0][0][0] == TOK.encode("")[0]  # BOS first
    assert ex[1][0] == TOK.encode("37*48=") + TOK.encode("CALC(37*48)", bos=False) + [EOS] + TOK.encode(
        "=1776;", bos=False)
    assert all(t[-1] == EOS for _, t in ex)
    # No `turns`: the answer is a one-turn demonstration.
    ex = demonstration({"prompt": "1*1=", "answer": "1"}, make_calc, TOK)
    assert [(show(p), show(t)) for p, t in ex] == [("1*1=", "1|")]


def test_demonstration_that_ends_early_is_refused() -> None:
    row = {**ROWS[0], "turns": ["1776", "1776"]}  # the first turn already answers
    with pytest.raises(DatasetError, match="ended the demonstration of row 3 at turn 1 of 2"):
        demonstration(row, make_calc, TOK, where="row 3")
    with pytest.raises(DatasetError, match="empty"):
        demonstration({**ROWS[0], "turns": []}, make_calc, TOK)


class Echo:
    recovery = "replay"

    def reset(self, row, seed):
        self.seed = seed

    def step(self, text):
        return Step(response=f"<{self.seed}>", done=text == "stop")


def test_demonstration_resets_with_the_seed() -> None:
    ex = demonstration({"prompt": "p", "turns": ["a", "stop"]}, Echo, TOK, seed=7)
    assert show(ex[1][0]) == "pa|<7>"


class Hangs:
    """An environment whose step never returns on the turn `hang_on` (the text it gets)
    and raises on "boom": the user's code at its worst."""

    recovery = "replay"
    forever = threading.Event()  # never set

    def reset(self, row, seed):
        pass

    def step(self, text):
        if text == "hang":
            self.forever.wait()
        if text == "boom":
            raise RuntimeError("sandbox down")
        if text == "huge":
            return Step(response="x" * 100, done=False)
        return Step(response="", done=True, reward=1.0)


def spec(factory, **kw) -> EnvSpec:
    args = dict(recovery="replay", max_turns=3, timeout_s=0.5, max_snapshot_bytes=1 << 20, label="hangs",
                max_response_bytes=64)
    args.update(kw)
    return EnvSpec(factory, **args)


def test_eval_episodes_whose_environment_hangs_raises_or_floods_fail_alone_and_are_counted() -> None:
    rows = [{"prompt": p} for p in ("a", "b", "c", "d")]
    answers = {"a": "hang", "b": "boom", "c": "fine", "d": "huge"}
    eps = greedy_episodes(None, TOK, rows, bounded(spec(Hangs)), max_turns=3, max_new_tokens=40,
                          greedy_ids=Scripted(lambda text: answers[text[:1]]), block_size=64)
    assert [e.reward for e in eps] == [0.0, 0.0, 1.0, 0.0]
    assert "took longer than env.timeout_s=0.5 s" in eps[0].error
    assert "RuntimeError: sandbox down" in eps[1].error
    assert eps[2].error is None
    assert "over env.max_response_bytes=64" in eps[3].error


def test_a_demonstration_whose_environment_hangs_is_the_users_code_exit_2() -> None:
    with pytest.raises(UserCodeError, match=r"demonstration of row 3 \(turn 1\)") as e:
        demonstration({"prompt": "p", "turns": ["hang", "x"]}, bounded(spec(Hangs)), TOK, where="row 3")
    assert exit_code(e.value) == 2 and "took longer than env.timeout_s=0.5 s" in str(e.value)

    def never():
        Hangs.forever.wait()

    with pytest.raises(UserCodeError, match=r"\(the reset\)"):
        demonstration({"prompt": "p", "turns": ["x"]}, bounded(spec(never)), TOK)

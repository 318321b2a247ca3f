"""Held-out evaluation: greedy accuracy of the current weights on the eval set.

Runs in a worker thread from the train pump at `eval.every_steps`, on its own copy of the
model, so neither pump's weights are touched. Each evaluation also returns the first
`eval.num_samples` rows' completions: the same prompts every time, so a reader of
`RUN_DIR/samples.jsonl` watches their answers change.

With an environment (`make_env`), each row is a greedy multi-turn episode
(`greedy_episodes`): turn k of every episode is decoded in one batched call, the
environment answers each, and its response's tokens join that episode's context. An
episode ends when the environment says done, after `max_turns` turns, or when the next
turn has no room: the trajectory (model turns and responses, the prompt excluded) is
bounded by `max_new_tokens` and prompt + trajectory by the model's `block_size` (the
bounds the engine applies to one completion). A turn cut short by those bounds (no EOS)
is still given to the environment, as a single-turn completion cut short is still scored,
and ends the episode. The reward is the sum of the steps' rewards. The environments are
the run's bounded ones (`episodes.bounded`): a call that fails, takes longer than
env.timeout_s or answers badly (a DataError) ends that episode with reward 0, and is
counted in eval/env_failures; the evaluation goes on.

Metrics: eval/accuracy (fraction of episodes, or completions, with reward 1.0),
eval/reward_mean; with an environment also eval/tool_calls (mean environment responses
per episode: turns that did not end it, for calc its tool calls), eval/turns (mean
model turns per episode) and eval/env_failures (episodes an environment failed).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.rollout.generation import DataError
from ..tasks import reward_fn

GreedyIds = Callable[..., list[list[int]]]  # (model, contexts, max_new_tokens=...) -> new ids each


@dataclass(frozen=True)
class EvalResult:
    metrics: dict[str, float]  # eval/accuracy, eval/reward_mean (numbers, for metrics.jsonl)
    samples: list[dict[str, Any]]  # prompt, completion, reward, answer (None if the row has none)


@dataclass(frozen=True)
class Episode:
    """One greedy episode: its trajectory as it reads (model turns and the responses that
    joined the context, in order), its reward and its counts."""

    text: str
    reward: float
    turns: int  # model turns taken
    responses: int  # turns the environment answered without ending the episode
    error: str | None = None  # the environment's failure that ended it (its reward is then 0)


def greedy_episodes(model: Any, tokenizer: Any, rows: Sequence[Mapping[str, Any]], make_env: Callable[[], Any],
                    *, max_turns: int, max_new_tokens: int, greedy_ids: GreedyIds,
                    block_size: int | None) -> list[Episode]:
    """A greedy episode per row (module docstring: the turns, the bounds; `block_size`
    None: the model has no bound of its own); episode i's environment is reset with seed
    i. All episodes still going take their turn k in one `greedy_ids` call."""
    if max_turns < 1:
        raise ValueError(f"evaluation: max_turns must be >= 1, got {max_turns}")
    block = float("inf") if block_size is None else block_size
    prompts = [tokenizer.encode(str(r["prompt"])) for r in rows]
    trajs: list[list[int]] = [[] for _ in rows]  # completion ids so far (model and environment)
    texts = [""] * len(rows)
    rewards, turns, responses = [0.0] * len(rows), [0] * len(rows), [0] * len(rows)
    errors: list[str | None] = [None] * len(rows)
    envs: list[Any] = [None] * len(rows)
    for i, row in enumerate(rows):
        try:
            envs[i] = make_env()
            envs[i].reset(row, i)
        except DataError as e:
            errors[i] = str(e)
    live = [i for i in range(len(rows)) if errors[i] is None]
    while live:
        new = greedy_ids(model, [prompts[i] + trajs[i] for i in live],
                         max_new_tokens=[max_new_tokens - len(trajs[i]) for i in live])
        going = []
        for i, ids in zip(live, new, strict=True):
            text = tokenizer.decode(ids)
            try:
                step = envs[i].step(text)
            except DataError as e:
                errors[i], rewards[i] = str(e), 0.0
                continue
            rewards[i] += float(step.reward)
            turns[i] += 1
            trajs[i] += ids
            texts[i] += text
            if step.done or turns[i] == max_turns:
                continue
            responses[i] += 1
            resp = tokenizer.encode(step.response, bos=False)
            room = min(max_new_tokens - len(trajs[i]), block - len(prompts[i]) - len(trajs[i]))
            cut = not ids or ids[-1] != tokenizer.eos_id
            if cut or len(resp) >= room:  # no room for the response and a next turn's token
                continue
            trajs[i] += resp
            texts[i] += step.response
            going.append(i)
        live = going
    return [Episode(*ep) for ep in zip(texts, rewards, turns, responses, errors, strict=True)]


class Evaluator:
    """`greedy(model, tokenizer, prompts, max_new_tokens=N) -> texts` decodes; the default
    is the built-in GPT's (`rollkeep.models.sampling.greedy`), the hf trainer passes
    `rollkeep.models.hf.greedy_texts`."""

    def __init__(self, rows: list[dict], *, model: Any, tokenizer: Any, max_new_tokens: int,
                 num_samples: int = 0, greedy: Callable[..., list[str]] | None = None,
                 make_env: Callable[[], Any] | None = None, max_turns: int = 1,
                 greedy_ids: GreedyIds | None = None) -> None:
        """With `make_env` (a fresh Environment per call) every row is a multi-turn episode
        of at most `max_turns` turns, decoded by `greedy_ids` (default: the built-in GPT's,
        `rollkeep.models.sampling.greedy_ids`); `max_new_tokens` then bounds the whole
        trajectory."""
        self.rows = rows
        self.model = copy.deepcopy(model).eval()
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.num_samples = num_samples
        self.greedy = greedy
        self.make_env = make_env
        self.max_turns = max_turns
        self.greedy_ids = greedy_ids

    def evaluate(self, weights: Mapping[str, Any]) -> EvalResult:
        """Exact-match accuracy (reward 1.0) and mean reward of greedy completions, and the
        first `num_samples` of them."""
        from ..models.sampling import greedy, greedy_ids

        self.model.load_state_dict(weights)
        if self.make_env is not None:
            return self._episodes(self.greedy_ids or greedy_ids)
        texts = (self.greedy or greedy)(self.model, self.tokenizer, [r["prompt"] for r in self.rows],
                                        max_new_tokens=self.max_new_tokens)
        rewards = [_rewarded(reward_fn(r.get("task", "default")), t, r) for t, r in zip(texts, self.rows, strict=True)]
        samples = [
            {"prompt": str(r["prompt"]), "completion": t, "reward": x,
             "answer": None if r.get("answer") is None else str(r["answer"])}
            for r, t, x in zip(self.rows[: self.num_samples], texts, rewards, strict=False)
        ]
        return EvalResult(
            metrics={
                "eval/accuracy": sum(x == 1.0 for x in rewards) / len(rewards),
                "eval/reward_mean": sum(rewards) / len(rewards),
            },
            samples=samples,
        )

    def _episodes(self, decode: GreedyIds) -> EvalResult:
        eps = greedy_episodes(self.model, self.tokenizer, self.rows, self.make_env, max_turns=self.max_turns,
                              max_new_tokens=self.max_new_tokens, greedy_ids=decode,
                              block_size=getattr(getattr(self.model, "cfg", None), "block_size", None))
        n = len(eps)
        samples = [
            {"prompt": str(r["prompt"]), "completion": e.text, "reward": e.reward, "turns": e.turns,
             "answer": None if r.get("answer") is None else str(r["answer"]),
             **({} if e.error is None else {"error": e.error})}
            for r, e in zip(self.rows[: self.num_samples], eps, strict=False)
        ]
        return EvalResult(
            metrics={
                "eval/accuracy": sum(e.reward == 1.0 for e in eps) / n,
                "eval/reward_mean": sum(e.reward for e in eps) / n,
                "eval/tool_calls": sum(e.responses for e in eps) / n,
                "eval/turns": sum(e.turns for e in eps) / n,
                "eval/env_failures": float(sum(e.error is not None for e in eps)),
            },
            samples=samples,
        )


def _rewarded(fn: Any, text: str, row: Any) -> float:
    """A held-out reward, on the evaluator's thread: an `async def` reward function runs to
    its end on a loop of its own (its effects are not recorded: evaluation trains nothing)."""
    value = fn(text, row)
    return float(asyncio.run(value) if inspect.isawaitable(value) else value)

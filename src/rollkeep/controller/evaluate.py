"""Held-out evaluation: greedy accuracy of the current weights on the eval set.

Runs in a worker thread from the train pump at `eval.every_steps`, on its own copy of the
model, so neither pump's weights are touched. Each evaluation also returns the first
`eval.num_samples` rows' completions: the same prompts every time, so a reader of
`RUN_DIR/samples.jsonl` watches their answers change.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..tasks import reward_fn


@dataclass(frozen=True)
class EvalResult:
    metrics: dict[str, float]  # eval/accuracy, eval/reward_mean (numbers, for metrics.jsonl)
    samples: list[dict[str, Any]]  # prompt, completion, reward, answer (None if the row has none)


class Evaluator:
    """`greedy(model, tokenizer, prompts, max_new_tokens=N) -> texts` decodes; the default
    is the built-in GPT's (`rollkeep.models.sampling.greedy`), the hf trainer passes
    `rollkeep.models.hf.greedy_texts`."""

    def __init__(self, rows: list[dict], *, model: Any, tokenizer: Any, max_new_tokens: int,
                 num_samples: int = 0, greedy: Callable[..., list[str]] | None = None) -> None:
        self.rows = rows
        self.model = copy.deepcopy(model).eval()
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.num_samples = num_samples
        self.greedy = greedy

    def evaluate(self, weights: Mapping[str, Any]) -> EvalResult:
        """Exact-match accuracy (reward 1.0) and mean reward of greedy completions, and the
        first `num_samples` of them."""
        from ..models.sampling import greedy

        self.model.load_state_dict(weights)
        texts = (self.greedy or greedy)(self.model, self.tokenizer, [r["prompt"] for r in self.rows],
                                        max_new_tokens=self.max_new_tokens)
        rewards = [float(reward_fn(r.get("task", "default"))(t, r)) for t, r in zip(texts, self.rows, strict=True)]
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

"""Held-out evaluation: greedy accuracy of the current weights on the eval set.

Runs in a worker thread from the train pump at `eval.every_steps`, on its own copy of the
model, so neither pump's weights are touched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from ..tasks import reward_fn


class Evaluator:
    """`greedy(model, tokenizer, prompts, max_new_tokens=N) -> texts` decodes; the default
    is the built-in GPT's (`rollkeep.models.sampling.greedy`), the hf trainer passes
    `rollkeep.models.hf.greedy_texts`."""

    def __init__(self, rows: list[dict], *, model: Any, tokenizer: Any, max_new_tokens: int,
                 greedy: Callable[..., list[str]] | None = None) -> None:
        self.rows = rows
        self.model = copy.deepcopy(model).eval()
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.greedy = greedy

    def evaluate(self, weights: Mapping[str, Any]) -> dict[str, float]:
        """Exact-match accuracy (reward 1.0) and mean reward of greedy completions."""
        from ..models.sampling import greedy

        self.model.load_state_dict(weights)
        texts = (self.greedy or greedy)(self.model, self.tokenizer, [r["prompt"] for r in self.rows],
                                        max_new_tokens=self.max_new_tokens)
        rewards = [reward_fn(r.get("task", "default"))(t, r) for t, r in zip(texts, self.rows, strict=True)]
        return {
            "eval/accuracy": sum(x == 1.0 for x in rewards) / len(rewards),
            "eval/reward_mean": sum(rewards) / len(rewards),
        }

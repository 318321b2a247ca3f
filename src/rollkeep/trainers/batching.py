"""Collation: (prompt, completion) token rows -> right-padded teacher-forcing batches
(`MicroBatch`, `collate`), the form in which the GRPO trainer's RL and SFT steps feed
them to the model.

A multi-turn completion (a trajectory) holds the environment's tokens between the model's
turns; their `versions` entry is negative (`envs.base.ENV_VERSION`). They are context,
not actions: `collate(..., versions=...)` leaves them out of `loss_mask` and of `tokens`,
so the loss, its normalisation and every token statistic are over model tokens only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["MicroBatch", "collate", "model_tokens"]


@dataclass(frozen=True)
class MicroBatch:
    """Sequences `prompt + completion`, right-padded. Position t of `input_ids` predicts
    `targets[:, t]` (token t + 1); `loss_mask` marks targets that are completion tokens.
    T = longest sequence - 1."""

    input_ids: Tensor  # (B, T) int64
    attention_mask: Tensor  # (B, T) int64, 1 = real token, 0 = padding
    targets: Tensor  # (B, T) int64
    loss_mask: Tensor  # (B, T) float32
    old_logp: Tensor  # (B, T) float32: behaviour log-probs at completion targets, else 0
    advantages: Tensor  # (B,) float32
    tokens: int  # model-written completion tokens = loss_mask.sum()
    versions: Tensor | None = None  # (B, T) int64: the version each completion target was sampled under, else -1


def model_tokens(versions: Sequence[int] | np.ndarray) -> int:
    """How many tokens of a completion the model wrote (version >= 0), i.e. what the loss
    counts; environment tokens (negative versions) are not."""
    v = np.asarray(versions)
    return int(v.size) if v.size == 0 or v.min() >= 0 else int((v >= 0).sum())


def collate(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    pad_id: int,
    old_logp: Sequence[Sequence[float]] | None = None,
    advantages: Sequence[float] | None = None,
    versions: Sequence[Sequence[int]] | None = None,
    device: torch.device | str = "cpu",
) -> MicroBatch:
    """`versions` (one per completion token, as in `Row.versions`): targets whose version
    is negative, the environment's tokens, get loss_mask 0 and are not counted in
    `tokens`. Without it every completion token is the model's."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    B, T = len(lengths), max(lengths) - 1
    ids = np.full((B, T + 1), pad_id, dtype=np.int64)
    real = np.zeros((B, T + 1), dtype=np.int64)
    loss_mask = np.zeros((B, T), dtype=np.float32)
    behaviour = np.zeros((B, T), dtype=np.float32)
    stamped = np.full((B, T), -1, dtype=np.int64)
    for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        P, C = len(p), len(c)
        if P == 0:
            raise ValueError(f"sequence {b} has an empty prompt: its first token has no context")
        ids[b, :P] = p
        ids[b, P : P + C] = c
        real[b, : P + C] = 1
        loss_mask[b, P - 1 : P - 1 + C] = 1.0  # logits at P-1+j predict completion token j
        if versions is not None:
            v = np.asarray(versions[b])
            if len(v) != C:
                raise ValueError(f"sequence {b} has {C} completion tokens but {len(v)} versions")
            loss_mask[b, P - 1 : P - 1 + C] *= v >= 0  # environment tokens: context, not actions
            stamped[b, P - 1 : P - 1 + C] = v
        if old_logp is not None:
            behaviour[b, P - 1 : P - 1 + C] = old_logp[b]
    adv = np.zeros(B, dtype=np.float32) if advantages is None else np.asarray(advantages, np.float32)
    return MicroBatch(
        input_ids=torch.from_numpy(ids[:, :-1]).to(device),
        attention_mask=torch.from_numpy(real[:, :-1]).to(device),
        targets=torch.from_numpy(ids[:, 1:]).to(device),
        loss_mask=torch.from_numpy(loss_mask).to(device),
        old_logp=torch.from_numpy(behaviour).to(device),
        advantages=torch.from_numpy(adv).to(device),
        tokens=int(sum(len(c) for c in completions)) if versions is None else int(loss_mask.sum()),
        versions=None if versions is None else torch.from_numpy(stamped).to(device),
    )


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]

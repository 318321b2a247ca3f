"""Collation: (prompt, completion) token rows -> right-padded teacher-forcing batches
(`MicroBatch`, `collate`), the form in which the GRPO trainer's RL and SFT steps feed
them to the model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["MicroBatch", "collate"]


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
    tokens: int  # completion tokens = loss_mask.sum()


def collate(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    pad_id: int,
    old_logp: Sequence[Sequence[float]] | None = None,
    advantages: Sequence[float] | None = None,
    device: torch.device | str = "cpu",
) -> MicroBatch:
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    B, T = len(lengths), max(lengths) - 1
    ids = np.full((B, T + 1), pad_id, dtype=np.int64)
    real = np.zeros((B, T + 1), dtype=np.int64)
    loss_mask = np.zeros((B, T), dtype=np.float32)
    behaviour = np.zeros((B, T), dtype=np.float32)
    for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        P, C = len(p), len(c)
        if P == 0:
            raise ValueError(f"sequence {b} has an empty prompt: its first token has no context")
        ids[b, :P] = p
        ids[b, P : P + C] = c
        real[b, : P + C] = 1
        loss_mask[b, P - 1 : P - 1 + C] = 1.0  # logits at P-1+j predict completion token j
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
        tokens=int(sum(len(c) for c in completions)),
    )


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]

"""Optimizer backends, chosen by `trainer.name`: toy, torch, hf."""

from __future__ import annotations

from typing import Any

from .base import Batch, Trainer, TrainerSnapshot, TrainGroup

__all__ = ["Batch", "TrainGroup", "Trainer", "TrainerSnapshot", "make_trainer"]


def make_trainer(cfg: Any, **context: Any) -> Trainer:
    """Build the trainer named by `cfg.name` from its own config section only."""
    if cfg.name == "toy":
        from .toy import ToyTrainer

        return ToyTrainer(step_sleep_ms=cfg.step_sleep_ms)
    if cfg.name == "torch":
        from .grpo import TorchTrainer

        return TorchTrainer(cfg, **context)
    if cfg.name == "hf":
        from .hf import HFTrainer

        return HFTrainer(cfg, **context)
    raise ValueError(f"unknown trainer {cfg.name!r}")  # the config model already refuses it

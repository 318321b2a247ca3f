"""Generation backends, chosen by `engine.name`: toy, torch, hf, vllm."""

from __future__ import annotations

from typing import Any

from .base import Completion, DataError, Engine, GenRequest, InfraError, sampling_seed

__all__ = ["Completion", "DataError", "Engine", "GenRequest", "InfraError", "make_engine", "sampling_seed"]


def make_engine(cfg: Any, **context: Any) -> Engine:
    """Build the engine named by `cfg.name` from its own config section only.

    `context` carries what some backends need from the run (e.g. the tokenizer, the
    initial model of the built-in trainer)."""
    fields = {k: v for k, v in cfg.model_dump().items() if k != "name"}
    if cfg.name == "toy":
        from .toy import ToyEngine

        return ToyEngine(**fields, **context)
    if cfg.name == "torch":
        from .torch_gpt import TorchEngine

        return TorchEngine(**fields, **context)
    if cfg.name == "hf":
        from .hf import HFEngine

        return HFEngine(**fields, **context)
    if cfg.name == "vllm":
        from .vllm import VLLMEngine

        return VLLMEngine(**fields, **context)
    raise ValueError(f"unknown engine {cfg.name!r}")  # the config model already refuses it

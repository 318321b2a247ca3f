"""Generation backends, chosen by `engine.name`: toy, torch, hf, vllm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .base import Completion, DataError, Engine, GenRequest, InfraError, sampling_seed

__all__ = ["Completion", "DataError", "Engine", "EngineRecipe", "GenRequest", "InfraError", "make_engine",
           "sampling_seed"]


@dataclass(frozen=True)
class EngineRecipe:
    """How to build the run's engine: its config section and what it needs from the run
    (`make_engine`'s context). A value, so an engine replica can be built in another
    process (`cluster.backend: ray`) exactly as the local one is."""

    section: Any  # the `engine` config section
    context: dict[str, Any] = field(default_factory=dict)

    def make(self) -> Engine:
        return make_engine(self.section, **self.context)


def make_engine(cfg: Any, **context: Any) -> Engine:
    """Build the engine named by `cfg.name` from its own config section only.

    `context` carries what some backends need from the run (e.g. the tokenizer, the
    initial model of the built-in trainer). A key in both is the context's: deterministic
    runs sample the hf engine in float64 in place of `engine.dtype: auto` (the config
    refuses any other `engine.dtype` with `deterministic: true`)."""
    fields = {k: v for k, v in cfg.model_dump().items() if k not in ("name", "replicas")}
    fields |= context
    if cfg.name == "toy":
        from .toy import ToyEngine

        return ToyEngine(**fields)
    if cfg.name == "torch":
        from .torch_gpt import TorchEngine

        return TorchEngine(**fields)
    if cfg.name == "hf":
        from .hf import HFEngine

        return HFEngine(**fields)
    if cfg.name == "vllm":
        from .vllm import VLLMEngine

        return VLLMEngine(**fields)
    raise ValueError(f"unknown engine {cfg.name!r}")  # the config model already refuses it

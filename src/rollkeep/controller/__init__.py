"""The single controller and the entry point of `rollkeep train`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..core.errors import RollkeepError
from .build import build
from .run import Controller, RunResult
from .warmup import run_warmup

__all__ = ["Controller", "RunResult", "train"]


def train(
    cfg: Config,
    *,
    allow_config_change: tuple[str, ...] = (),
    allow_dataset_change: bool = False,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
) -> RunResult:
    """Run (or resume) the job `cfg` describes until `train.total_steps`, the end of the
    data, or SIGINT/SIGTERM. Resumes from RUN_DIR/checkpoints/LATEST when it exists; a
    supervised warm start (`warmup.sft_steps`) runs first, as its own checkpointed phase."""
    parts = build(cfg)
    controller = Controller(
        cfg,
        source=parts.source,
        engine=parts.engine,
        trainer=parts.trainer,
        allow_config_change=allow_config_change,
        allow_dataset_change=allow_dataset_change,
        on_step=on_step,
        evaluator=parts.evaluator,
    )
    run_warmup(cfg, dataset=parts.dataset, trainer=parts.trainer, tokenizer=parts.tokenizer,
               log=lambda line: print(line, flush=True) if cfg.logger.progress != "none" else None)
    try:
        return asyncio.run(controller.run())
    except BaseExceptionGroup as group:
        # A TaskGroup wraps the pump's error; surface a single rollkeep error as itself.
        for leaf in _leaves(group):
            if isinstance(leaf, RollkeepError):
                raise leaf from group
        raise


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out

"""Build a run's components from its config (the recipe's ingredients, torchtune-style):
the dataset and prompt source, the engine, the trainer. Each gets only its own section."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..core.source import Dataset, PromptSource, load_dataset
from ..engines import Engine, make_engine
from ..tasks import arith, check_tasks
from ..trainers import Trainer, make_trainer


@dataclass
class Parts:
    source: PromptSource
    eval_rows: list[dict] | None
    engine: Engine
    trainer: Trainer
    on_step: Callable[[int, dict[str, Any]], None] | None = None


def build_data(cfg: Config) -> tuple[Dataset, list[dict] | None]:
    """The training dataset and, for the built-in task, a held-out eval set."""
    if cfg.data.path is not None:
        return load_dataset(cfg.data.path), None
    gen = cfg.data.generated
    if gen.task != arith.TASK:
        from ..core.errors import ConfigError

        raise ConfigError(
            f"unknown built-in dataset task {gen.task!r}",
            field="data.generated.task",
            expected=arith.TASK,
            found=repr(gen.task),
            remedy="set data.generated.task=arith or point data.path at a JSONL file",
        )
    rows = arith.make_rows(gen.n_rows + gen.eval_rows, digits=gen.digits, seed=cfg.seed)
    from ..core.source import SequenceDataset

    return SequenceDataset(rows[: gen.n_rows]), rows[gen.n_rows :]


def build(cfg: Config) -> Parts:
    dataset, eval_rows = build_data(cfg)
    check_tasks(str(dataset[i].get("task", "default")) for i in range(len(dataset)))
    source = PromptSource(dataset, seed=cfg.seed, epochs=cfg.data.epochs)
    trainer = make_trainer(cfg.trainer)
    engine = make_engine(cfg.engine)
    return Parts(source=source, eval_rows=eval_rows, engine=engine, trainer=trainer)

"""Build a run's components from its config (the recipe's ingredients, torchtune-style):
the dataset and prompt source, the engine, the trainer, the evaluator. Each gets only its
own config section, plus what it must share with the others (the tokenizer, the model's
initial weights, the sampling temperature, the maximum completion length)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..core.errors import ConfigError
from ..core.source import Dataset, PromptSource, SequenceDataset, load_dataset
from ..engines import Engine, make_engine
from ..tasks import arith, check_tasks
from ..trainers import Trainer, make_trainer


@dataclass
class Parts:
    dataset: Dataset
    source: PromptSource
    eval_rows: list[dict] | None
    engine: Engine
    trainer: Trainer
    tokenizer: Any = None
    evaluator: Any = None


def build_data(cfg: Config) -> tuple[Dataset, list[dict] | None]:
    """The training dataset and, for the built-in task, a held-out eval set."""
    if cfg.data.path is not None:
        return load_dataset(cfg.data.path), None
    gen = cfg.data.generated
    if gen.task not in (arith.TASK, arith.TASK_PARTIAL):
        raise ConfigError(
            f"unknown built-in dataset task {gen.task!r}",
            field="data.generated.task",
            expected=f"{arith.TASK} (exact match) or {arith.TASK_PARTIAL} (partial credit)",
            found=repr(gen.task),
            remedy="set data.generated.task=arith or point data.path at a JSONL file",
        )
    # The training rows are the first n_rows of a stream of n_rows + eval_rows problems (as
    # they always were: a run started by an older rollkeep resumes on the same rows). The
    # held-out rows are problems that appear in no training row: greedy accuracy on them
    # measures what the policy learned, not what it memorised.
    rows = arith.make_rows(gen.n_rows + gen.eval_rows, digits=gen.digits, seed=cfg.seed, task=gen.task,
                           fmt=gen.format)
    train = rows[: gen.n_rows]
    try:
        held_out = arith.held_out_rows(gen.eval_rows, digits=gen.digits, seed=cfg.seed, exclude=train,
                                       task=gen.task, fmt=gen.format)
    except ValueError as e:
        raise ConfigError(
            f"the built-in dataset cannot hold out {gen.eval_rows} problems: {e}",
            field="data.generated.eval_rows",
            expected="at most the number of problems that no training row holds",
            found=str(gen.eval_rows),
            remedy="lower data.generated.eval_rows or data.generated.n_rows, or raise data.generated.digits",
        ) from None
    return SequenceDataset(train), held_out


def build(cfg: Config) -> Parts:
    dataset, eval_rows = build_data(cfg)
    check_tasks(str(dataset[i].get("task", "default")) for i in range(len(dataset)))
    source = PromptSource(dataset, seed=cfg.seed, epochs=cfg.data.epochs)
    if cfg.trainer.name == "torch":
        return _build_torch(cfg, dataset, source, eval_rows)
    if cfg.trainer.name == "hf":
        return _build_hf(cfg, dataset, source, eval_rows)
    return Parts(dataset, source, eval_rows, make_engine(cfg.engine), make_trainer(cfg.trainer))


def _build_torch(cfg: Config, dataset: Dataset, source: PromptSource, eval_rows) -> Parts:
    import torch

    from ..engines.torch_gpt import TorchEngine
    from ..models.gpt import GPT, GPTConfig
    from ..models.tokenizer import CharTokenizer
    from ..trainers.grpo import TorchTrainer
    from .evaluate import Evaluator

    # One intra-op thread each: the engine's thread and the trainer's thread then run
    # side by side on two cores instead of fighting over one pool.
    torch.set_num_threads(1)
    tokenizer = CharTokenizer()
    m = cfg.trainer.model
    model_cfg = GPTConfig(
        vocab_size=m.vocab_size or tokenizer.vocab_size,
        n_layer=m.n_layer,
        n_head=m.n_head,
        n_embd=m.n_embd,
        block_size=m.block_size,
        dropout=m.dropout,
    )
    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg)
    e = cfg.engine
    trainer = TorchTrainer(cfg.trainer, model=model, tokenizer=tokenizer, temperature=e.temperature,
                           seed=cfg.seed, max_completion_length=e.max_new_tokens)
    engine = TorchEngine(
        temperature=e.temperature,
        top_p=e.top_p,
        max_new_tokens=e.max_new_tokens,
        max_batch_size=e.max_batch_size,
        update_weights_in_flight=e.update_weights_in_flight,
        model=copy.deepcopy(model),
        tokenizer=tokenizer,
        # Deterministic runs sample in float64: a batch of other size than the one the
        # uninterrupted run had must not flip a token on a last-bit difference.
        dtype=torch.float64 if cfg.deterministic else torch.float32,
    )
    evaluator = None
    if eval_rows and cfg.eval.every_steps:
        rows = eval_rows[: cfg.eval.n_rows] if cfg.eval.n_rows else eval_rows
        evaluator = Evaluator(rows, model=model, tokenizer=tokenizer, max_new_tokens=e.max_new_tokens)
    return Parts(dataset, source, eval_rows, engine, trainer, tokenizer, evaluator)


def _build_hf(cfg: Config, dataset: Dataset, source: PromptSource, eval_rows) -> Parts:
    import torch

    from ..trainers.hf import HFTrainer

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # as for the built-in model: engine and trainer side by side
    trainer = HFTrainer(cfg.trainer, temperature=cfg.engine.temperature, seed=cfg.seed,
                        max_completion_length=cfg.engine.max_new_tokens)
    if cfg.engine.name == "hf" and cfg.deterministic:
        # float64 sampling: a different batch composition must not flip a token (see _build_torch)
        engine = make_engine(cfg.engine, dtype=torch.float64)
    else:
        engine = make_engine(cfg.engine)
    return Parts(dataset, source, eval_rows, engine, trainer, getattr(trainer, "tokenizer", None))

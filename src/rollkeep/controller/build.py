"""Build a run's components from its config (the recipe's ingredients, torchtune-style):
the reward functions (`reward.fn`), the dataset and prompt source, the held-out set, the
engine, the trainer, the evaluator. Each gets only its own config section, plus what it
must share with the others (the tokenizer, the model's initial weights, the sampling
temperature, the maximum completion length). What the config asks for but cannot happen
(evaluation without held-out data) is said in `Parts.notes`, printed at start-up."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ..cluster import EnginePool, ReplicaGone, open_engine
from ..config import Config
from ..core.errors import ConfigError, ExternalError
from ..core.rollout.datasets import Dataset, SequenceDataset, load_dataset
from ..core.rollout.source import PromptSource
from ..engines import Engine, EngineRecipe
from ..envs import EnvSpec, resolve
from ..tasks import arith, calc, check_tasks, use_rewards
from ..trainers import Trainer, make_trainer
from .episodes import bounded
from .metrics import check_logger


@dataclass
class Parts:
    dataset: Dataset
    source: PromptSource
    eval_rows: list[dict] | None
    engine: Engine
    trainer: Trainer
    tokenizer: Any = None
    evaluator: Any = None
    notes: list[str] = field(default_factory=list)  # said at start-up (`warning: ...`)
    env: EnvSpec | None = None  # the multi-turn environment (`env.*`), None = single-turn
    chat: Any = None  # the chat template prompts are rendered with (`models.chat.ChatTemplate`), None = off


def build_data(cfg: Config) -> tuple[Dataset, list[dict] | None]:
    """The training dataset and the held-out eval set: `eval.path` when set, else the
    built-in task's held-out rows (None with `data.path`: a dataset has no held-out part)."""
    dataset, eval_rows = (load_dataset(cfg.data.path), None) if cfg.data.path is not None else _generated(cfg)
    if cfg.eval.path is not None:
        held_out = load_dataset(cfg.eval.path)  # refuses a missing file, a FIFO, a bad row
        eval_rows = [dict(held_out[i]) for i in range(len(held_out))]
    return dataset, eval_rows


def _generated(cfg: Config) -> tuple[Dataset, list[dict]]:
    gen = cfg.data.generated
    if gen.task not in (arith.TASK, arith.TASK_PARTIAL, calc.TASK):
        raise ConfigError(
            f"unknown built-in dataset task {gen.task!r}",
            field="data.generated.task",
            expected=f"{arith.TASK} (exact match), {arith.TASK_PARTIAL} (partial credit) or calc (multiplication "
                     "with a calculator tool, for env.name=calc)",
            found=repr(gen.task),
            remedy="set data.generated.task=arith or point data.path at a JSONL file",
        )
    if gen.task == calc.TASK:
        make = partial(calc.make_rows, digits=gen.digits, seed=cfg.seed, tool_share=gen.tool_share)
        hold = partial(calc.held_out_rows, digits=gen.digits, seed=cfg.seed)
    else:
        make = partial(arith.make_rows, digits=gen.digits, seed=cfg.seed, task=gen.task, fmt=gen.format)
        hold = partial(arith.held_out_rows, digits=gen.digits, seed=cfg.seed, task=gen.task, fmt=gen.format)
    # The training rows are the first n_rows of a stream of n_rows + eval_rows problems (as
    # they always were: a run started by an older rollkeep resumes on the same rows). The
    # held-out rows are problems that appear in no training row: greedy accuracy on them
    # measures what the policy learned, not what it memorised.
    rows = make(gen.n_rows + gen.eval_rows)
    train = rows[: gen.n_rows]
    try:
        held_out = hold(gen.eval_rows, exclude=train)
    except ValueError as e:
        raise ConfigError(
            f"the built-in dataset cannot hold out {gen.eval_rows} problems: {e}",
            field="data.generated.eval_rows",
            expected="at most the number of problems that no training row holds",
            found=str(gen.eval_rows),
            remedy="lower data.generated.eval_rows or data.generated.n_rows, or raise data.generated.digits",
        ) from None
    return SequenceDataset(train), held_out


def with_chat_template(cfg: Config) -> Config:
    """The config the run's parts are built from, with the chat template decided in this one
    place: prompts are rendered with it when `data.chat_template or engine.chat_template`
    (the engine's `chat_template` is set to that), episodes only with `data.chat_template`
    (`EnvSpec.chat_template`). An engine section without the key cannot: ConfigError."""
    if not cfg.data.chat_template or getattr(cfg.engine, "chat_template", False):
        return cfg
    if "chat_template" not in type(cfg.engine).model_fields:
        raise ConfigError(f"data.chat_template is true but engine {cfg.engine.name} does not render prompts with a "
                          "chat template", field="data.chat_template",
                          expected="an engine with a Hugging Face tokenizer and `engine.chat_template` (hf, vllm, remote)",
                          found=f"engine.name {cfg.engine.name}", remedy="set data.chat_template=false, or use "
                          "engine.name=hf")
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"chat_template": True})})


def build(cfg: Config) -> Parts:
    cfg = with_chat_template(cfg)
    check_logger(cfg.logger, cfg.run_dir)  # the tb / wandb extras, before anything runs
    use_rewards(cfg.reward.fn, cfg.reward.fns)  # imports the user's reward modules: exit 2 on any problem
    dataset, eval_rows = build_data(cfg)
    check_tasks(str(dataset[i].get("task", "default")) for i in range(len(dataset)))
    if eval_rows:
        check_tasks(str(r.get("task", "default")) for r in eval_rows)
    source = PromptSource(dataset, seed=cfg.seed, epochs=cfg.data.epochs)
    env = resolve(cfg.env)  # imports the user's environment: exit 2 on any problem
    if env is not None and cfg.data.chat_template:
        env = dataclasses.replace(env, chat_template=True)  # each response joins as a chat turn
    if cfg.trainer.name in ("torch", "custom"):  # custom: the user's trainer on the built-in GPT
        parts = _build_torch(cfg, dataset, source, eval_rows, env)
    elif cfg.trainer.name == "hf":
        parts = _build_hf(cfg, dataset, source, eval_rows, env)
    else:  # the toy engine speaks the tool protocol: a call on every turn but the last
        engine = open_engine(cfg, EngineRecipe(cfg.engine, {"tool_turns": 0 if env is None else env.max_turns - 1}))
        parts = Parts(dataset, source, eval_rows, engine, make_trainer(cfg.trainer))
    parts.env = env
    parts.notes.extend(eval_notes(cfg, eval_rows, evaluates=parts.evaluator is not None))
    return parts


def eval_notes(cfg: Config, eval_rows: list[dict] | None, *, evaluates: bool) -> list[str]:
    """Why evaluation the config asks for will not run (empty when it runs or is off)."""
    every = cfg.eval.every_steps
    if evaluates or (every == 0 and cfg.eval.path is None):
        return []
    if cfg.trainer.name == "hf" and (cfg.env.name or cfg.env.factory) and every and eval_rows:
        return [f"eval.every_steps is {every} but greedy evaluation of multi-turn episodes runs only with "
                "the built-in GPT (trainer.name torch); no evaluation runs (set eval.every_steps=0 to "
                "silence this)"]
    if cfg.trainer.name == "toy":
        if cfg.eval.path is None:
            return []  # the toy trainer has no model: eval.every_steps means nothing there
        return ["eval.path is set but the toy trainer has no model to evaluate; no evaluation "
                "runs (use trainer.name torch or hf)"]
    if every == 0:
        return ["eval.path is set but eval.every_steps is 0: no evaluation runs (set "
                "eval.every_steps, e.g. eval.every_steps=25)"]
    if cfg.data.path is not None and cfg.eval.path is None:
        why = ("data.path is set and eval.path is not: your dataset has no held-out part; "
               "give eval.path (a held-out JSONL file) to evaluate on it")
    elif cfg.eval.path is None:
        why = "data.generated.eval_rows is 0; raise it to hold problems out"
    else:
        why = "eval.path holds no rows"
    return [f"eval.every_steps is {every} but there is no held-out data, so no evaluation "
            f"runs: {why} (or set eval.every_steps=0 to silence this)"]


def _build_torch(cfg: Config, dataset: Dataset, source: PromptSource, eval_rows, env: EnvSpec | None) -> Parts:
    import torch

    from ..models.gpt import GPT, GPTConfig
    from ..models.tokenizer import CharTokenizer
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
    trainer = make_trainer(cfg.trainer, model=model, tokenizer=tokenizer, temperature=e.temperature,
                           seed=cfg.seed, max_completion_length=e.max_new_tokens, **_ranks(cfg))
    # Deterministic runs sample in float64: a batch of other size than the one the
    # uninterrupted run had must not flip a token on a last-bit difference.
    engine = open_engine(cfg, EngineRecipe(e, {"model": copy.deepcopy(model), "tokenizer": tokenizer,
                                               "dtype": torch.float64 if cfg.deterministic else torch.float32}))
    evaluator = None
    if eval_rows and cfg.eval.every_steps:
        rows = eval_rows[: cfg.eval.n_rows] if cfg.eval.n_rows else eval_rows
        evaluator = Evaluator(rows, model=model, tokenizer=tokenizer, max_new_tokens=e.max_new_tokens,
                              num_samples=cfg.eval.num_samples, make_env=None if env is None else bounded(env),
                              max_turns=1 if env is None else env.max_turns)
    return Parts(dataset, source, eval_rows, engine, trainer, tokenizer, evaluator)


def _build_hf(cfg: Config, dataset: Dataset, source: PromptSource, eval_rows, env: EnvSpec | None) -> Parts:
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # as for the built-in model: engine and trainer side by side
    trainer = make_trainer(cfg.trainer, temperature=cfg.engine.temperature, seed=cfg.seed,
                           max_completion_length=cfg.engine.max_new_tokens, **_ranks(cfg))
    chat = None
    if getattr(cfg.engine, "chat_template", False):  # (`with_chat_template`): the warm start's and eval's prompts
        from ..models.chat import ChatTemplate

        chat = ChatTemplate(trainer.tokenizer.tok, field="data.chat_template" if cfg.data.chat_template
                            else "engine.chat_template")
        if env is not None and cfg.data.chat_template:
            chat.probe()  # a template that cannot render episodes token by token: exit 2 now
    # float64 sampling when deterministic: a different batch composition must not flip a
    # token (see _build_torch). It takes the place of `engine.dtype: auto` (any other
    # engine.dtype is refused with deterministic); otherwise the hf and vllm engines get
    # `engine.dtype`, `engine.enforce_eager` and `engine.chat_template` from their section
    # (`make_engine`), and hold the trainer's float32 weights cast to that dtype.
    context = {"dtype": torch.float64} if cfg.engine.name == "hf" and cfg.deterministic else {}
    engine = open_engine(cfg, EngineRecipe(cfg.engine, context))
    evaluator = None
    if eval_rows and cfg.eval.every_steps and env is None:  # (multi-turn greedy: the built-in GPT's only)
        from ..models.hf import greedy_texts
        from .evaluate import Evaluator

        rows = eval_rows[: cfg.eval.n_rows] if cfg.eval.n_rows else eval_rows
        evaluator = Evaluator(rows, model=trainer.model, tokenizer=trainer.tokenizer.tok,
                              max_new_tokens=cfg.engine.max_new_tokens, num_samples=cfg.eval.num_samples,
                              greedy=lambda m, t, p, max_new_tokens: greedy_texts(
                                  m, t, p, max_new_tokens=max_new_tokens, chat_template=chat is not None))
    return Parts(dataset, source, eval_rows, engine, trainer, getattr(trainer, "tokenizer", None), evaluator,
                 chat=chat)


def _ranks(cfg: Config) -> dict[str, Any]:
    """Where trainer ranks (`trainer.world_size` > 1) write their output, and where they
    run: Ray actors with `cluster.backend: ray`, child processes otherwise."""
    c = cfg.cluster
    ray = None
    if c.backend == "ray":  # the ranks' module only when used: not on a local run's start-up
        from ..trainers.ranks import RayPlacement

        ray = RayPlacement(c.trainer_cpus, c.trainer_gpus)
    return {"log_dir": Path(cfg.run_dir) / "ranks", "ray": ray}


async def start_replicas(engine: Engine, cfg: Config) -> None:
    """Start the engine replicas (`cluster.backend: ray`; any other engine: nothing)."""
    if not isinstance(engine, EnginePool):
        return
    try:
        await engine.open()
    except ReplicaGone as e:
        if cfg.engine.name == "remote":
            raise ExternalError(
                "no server of engine.servers answered", field="engine.servers",
                expected=f"a live {cfg.engine.flavor} server at one of {', '.join(cfg.engine.servers)}",
                found=str(e), remedy="start the servers (docs/server-mode.md) or fix engine.servers; "
                "nothing was changed") from None
        raise ExternalError(
            "the engine replicas did not start", field="engine.replicas",
            expected=f"{cfg.engine.replicas} replica(s) of engine {cfg.engine.name} on Ray",
            found=str(e), remedy="check the Ray cluster's resources (cluster.replica_cpus, "
            "cluster.replica_gpus) and the engine's own errors above; nothing was changed") from None

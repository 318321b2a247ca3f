"""The run's config: one typed, frozen model, parsed once at the edge (STYLE habits 7, 8).

    load_config(path, overrides)  YAML file + dotted `key.sub=value` overrides -> `Config`
    Config.to_dict() / dump_yaml  the full resolved config, as plain data / YAML text
    semantic(cfg)                 the keys that change what a run trains on (restore step 8)

Every section is its own model, so each component is handed only its own fields
(`cfg.engine`, `cfg.sampler`, ...) and nothing reads a config dict with defaults deep inside.
Models are strict: `extra="forbid"` (an unknown key is an error that suggests the closest
valid one), `frozen=True`, and no type coercion (`"3"` is not an integer; quote a string
that YAML would read as a number). `engine` and `trainer` are unions chosen by `name`;
their valid keys are those of the chosen variant, and `name` defaults to `toy`.

Every problem in a config -- unknown keys, wrong types, values out of range, broken
overrides, cross-field rules -- is collected and raised as ONE `ConfigError` that lists
each as a dotted path with what was expected and what was found, before anything runs.

Sampler size limits (buffer capacity vs `max_inflight_prompts` / `max_buffered_rollouts`)
are checked by `rollkeep.core.samplers.check_limits`, not here.
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rollkeep.core.errors import ConfigError

__all__ = [
    "Config",
    "DataConfig",
    "GeneratedDataConfig",
    "ToyEngineConfig",
    "TorchEngineConfig",
    "HFEngineConfig",
    "VLLMEngineConfig",
    "EngineConfig",
    "ToyTrainerConfig",
    "TorchModelConfig",
    "TorchTrainerConfig",
    "HFTrainerConfig",
    "TrainerConfig",
    "RolloutConfig",
    "TrainConfig",
    "CheckpointConfig",
    "SamplerConfig",
    "EvalConfig",
    "WarmupConfig",
    "LoggerConfig",
    "load_config",
    "dump_yaml",
    "semantic",
    "check_allowed_changes",
]


class _Section(BaseModel):
    """Base of every config model: unknown keys refused, immutable, no type coercion, and
    each field's docstring kept as its description."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True,
        allow_inf_nan=False,  # no honest setting is infinite or NaN (`latency_ms: .inf` hung)
    )


def _list_to_tuple(v: Any) -> Any:
    # YAML has no tuples; strict mode would refuse the list YAML gives us.
    return tuple(v) if isinstance(v, list) else v


Beta = Annotated[float, Field(ge=0.0, lt=1.0)]
Betas = Annotated[tuple[Beta, Beta], BeforeValidator(_list_to_tuple)]


# --------------------------------------------------------------------------------- data


class GeneratedDataConfig(_Section):
    """Settings of the built-in generated dataset (used when `data.path` is null)."""

    task: str = "arith"
    """Built-in task: `arith` (exact-match reward) or `arith_partial` (partial credit for digits
    in the right place)."""
    n_rows: int = Field(512, ge=1)
    """Number of training prompts generated (rows)."""
    digits: int = Field(2, ge=1)
    """Number of digits per operand of a generated problem."""
    eval_rows: int = Field(128, ge=0)
    """Number of held-out prompts generated for evaluation (rows)."""
    format: Literal["plain", "padded", "reversed"] = "plain"
    """How problems are written: `plain` "7+45=" -> "52"; `padded` operands and answer
    zero-padded to fixed widths, "07+45=" -> "052"; `reversed` padded, with the answer's
    digits least significant first, "07+45=" -> "250" (each digit then depends only on
    the operand digits at and below its place, and the carry from the one before)."""


class DataConfig(_Section):
    """Where prompts come from and how many passes are made over them."""

    path: str | None = None
    """Path of a JSONL/Parquet dataset; null uses the built-in generated dataset."""
    epochs: int | None = Field(1, ge=1)
    """Passes over the dataset before the source is exhausted; null = unbounded."""
    generated: GeneratedDataConfig = GeneratedDataConfig()
    """The built-in dataset's settings (ignored when `path` is set)."""


# ------------------------------------------------------------------------------ engines


class ToyEngineConfig(_Section):
    """Deterministic fake engine with configurable latency and failure injection."""

    name: Literal["toy"] = "toy"
    """Engine backend."""
    latency_ms: float = Field(0.0, ge=0.0)
    """Simulated time per generation, in milliseconds."""
    latency_jitter_ms: float = Field(0.0, ge=0.0)
    """Extra random time per generation, uniform in [0, jitter], in milliseconds."""
    infra_fail_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that an attempt fails as an infra failure (engine error)."""
    data_fail_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that an attempt fails as a data failure (environment or reward error)."""
    completion_tokens: int = Field(8, ge=1)
    """Tokens in each fake completion."""
    hang_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that an attempt never returns (until `rollout.timeout_s` aborts it);
    keyed by the sibling's infra-retry count like `infra_fail_rate`, so the same hangs
    happen in every lineage."""


class _SamplingSection(_Section):
    """Sampling settings shared by the real engines (torch, hf, vllm)."""

    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature (> 0)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass, in (0, 1]; 1 = no truncation."""
    max_new_tokens: int = Field(8, ge=1)
    """Maximum completion length, in tokens."""


class TorchEngineConfig(_SamplingSection):
    """The built-in tiny GPT sampling with a KV cache on CPU."""

    name: Literal["torch"] = "torch"
    """Engine backend."""
    max_batch_size: int = Field(64, ge=1)
    """Most sequences generated in one batch."""
    update_weights_in_flight: bool = False
    """Apply new weights between decode steps of a running generation (fast mode only)."""


class HFEngineConfig(_SamplingSection):
    """A transformers causal LM loaded from a local path."""

    name: Literal["hf"] = "hf"
    """Engine backend."""
    model_path: str
    """Local directory of the transformers model and tokenizer (required)."""
    chat_template: bool = False
    """Wrap each prompt with the tokenizer's chat template."""
    max_batch_size: int = Field(16, ge=1)
    """Most sequences generated in one batch."""


class VLLMEngineConfig(_SamplingSection):
    """vLLM on the GPU (import-guarded: needs the `vllm` extra)."""

    name: Literal["vllm"] = "vllm"
    """Engine backend."""
    model_path: str
    """Local directory of the model (required)."""
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may take, in (0, 1]."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Number of GPUs the model is sharded over."""

    @field_validator("top_p")
    @classmethod
    def _full_vocabulary_only(cls, v: float) -> float:
        # vLLM renormalises its behaviour log-probs over the nucleus; GRPO's ratio takes
        # the full-vocabulary log_softmax(logits / T): they agree only at top_p = 1.
        if v != 1.0:
            from pydantic_core import PydanticCustomError

            raise PydanticCustomError(
                "vllm_top_p",
                "1.0 with engine vllm (with top_p < 1 vLLM renormalises its behaviour log-probs "
                "over the nucleus, and GRPO's ratio against them would be wrong; use engine.name=hf "
                "for nucleus sampling)",
            )
        return v


EngineConfig = Annotated[
    ToyEngineConfig | TorchEngineConfig | HFEngineConfig | VLLMEngineConfig,
    Field(discriminator="name"),
]


# ----------------------------------------------------------------------------- trainers


class _TrainerSection(_Section):
    """What every trainer section has: how advantages are computed at finalize (they are
    stored in the ledger, so this is a semantic key; `rollkeep.advantages` has the formulas)."""

    scale_rewards: Literal["group_population", "group", "batch", "none"] = "group_population"
    """What a group's centred rewards r - mean(group) are divided by: `group_population` the
    group's population std (divisor G; the default, rollkeep's behaviour before this key),
    `group` the group's sample std (divisor G - 1: TRL's `scale_rewards="group"`, verl's
    `norm_adv_by_std_in_grpo: true`), `batch` the sample std of every reward in the step's
    batch (TRL's `scale_rewards="batch"`; the ledger stores centred advantages and the
    trainer divides at train time; the toy trainer records them as stored), `none` nothing
    (TRL `"none"`, verl `false`, Dr. GRPO). Every mode adds eps = 1e-6; a group whose
    siblings all scored alike gets exactly zero advantages in every mode."""


class ToyTrainerConfig(_TrainerSection):
    """Deterministic fake trainer: a digest of the batches it saw (proves resume equivalence)."""

    name: Literal["toy"] = "toy"
    """Trainer backend."""
    step_sleep_ms: float = Field(0.0, ge=0.0)
    """Simulated time per optimizer step, in milliseconds."""


class TorchModelConfig(_Section):
    """Shape of the built-in tiny GPT."""

    vocab_size: int | None = Field(None, ge=1)
    """Vocabulary size, in tokens; null = taken from the tokenizer."""
    n_layer: int = Field(2, ge=1)
    """Number of transformer blocks."""
    n_head: int = Field(4, ge=1)
    """Attention heads per block (must divide `n_embd`)."""
    n_embd: int = Field(128, ge=1)
    """Width of the residual stream."""
    block_size: int = Field(64, ge=1)
    """Longest sequence (prompt + completion) the model accepts, in tokens."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout probability, in [0, 1)."""


class _GRPOSection(_TrainerSection):
    """GRPO and AdamW settings shared by the real trainers (torch, hf). The formulas of
    every option are in `rollkeep.trainers.grpo`."""

    lr: float = Field(3e-4, gt=0.0)
    """AdamW learning rate."""
    lr_warmup_steps: int = Field(0, ge=0)
    """RL steps over which the learning rate rises linearly to `lr`: step k (from 1) uses
    lr x min(1, k / lr_warmup_steps). A fresh AdamW's first updates move every weight by
    about lr whatever its gradient, which can undo much of a warm start; 0 = `lr` from
    the first step (the behaviour before this key)."""
    lr_decay_steps: int = Field(0, ge=0)
    """RL steps, counted from the end of the warmup, over which the learning rate falls
    linearly from `lr` to `lr` x `lr_final_ratio`, where it then stays (so a run extended
    past them keeps learning at that rate); 0 = no decay (the behaviour before this key)."""
    lr_final_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Where the decay of `lr_decay_steps` ends, as a fraction of `lr`, in [0, 1]."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    betas: Betas = (0.9, 0.95)
    """AdamW (beta1, beta2), each in [0, 1)."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Global gradient-norm clip (> 0)."""
    clip_eps: float = Field(0.2, gt=0.0)
    """PPO ratio clip: the ratio is clipped to [1 - eps, 1 + eps]."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty (k3 estimator) against a frozen reference: the policy as it
    was when RL started (after the warm start); 0 = no KL term."""
    ppo_epochs: int = Field(1, ge=1)
    """Optimizer passes over each step's batch."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward pass (gradient accumulation; memory only, except under
    `loss_type: bnpo`, where it changes the loss and is a semantic key)."""
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = "dapo"
    """How per-token losses are aggregated over a step's batch: `dapo` token mean over the
    whole batch (the default; TRL `loss_type="dapo"`, verl `loss_agg_mode: token-mean`),
    `grpo` mean over sequences of each sequence's token mean (TRL `"grpo"`, verl
    `seq-mean-token-mean`), `dr_grpo` token sum over (sequences x `engine.max_new_tokens`)
    (TRL `"dr_grpo"`), `bnpo` token mean per micro-batch, averaged over micro-batches (TRL
    `"bnpo"`; `micro_batch_size` then changes the update)."""
    dual_clip: float | None = Field(None, gt=1.0)
    """Dual clip (verl's `clip_ratio_c`, usually 3): a token with negative advantage A loses
    at most -c x A however large its ratio grows (the clipped objective is unbounded there);
    null = off. Must be > 1."""


class TorchTrainerConfig(_GRPOSection):
    """GRPO on the built-in tiny GPT with AdamW, on CPU."""

    name: Literal["torch"] = "torch"
    """Trainer backend."""
    model: TorchModelConfig = TorchModelConfig()
    """Shape of the model."""


class HFTrainerConfig(_GRPOSection):
    """GRPO on a transformers causal LM loaded from a local path."""

    name: Literal["hf"] = "hf"
    """Trainer backend."""
    model_path: str
    """Local directory of the transformers model and tokenizer (required)."""
    lr: float = Field(1e-5, gt=0.0)
    """AdamW learning rate (a pretrained model wants a small one)."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward pass (gradient accumulation; memory only, except under
    `loss_type: bnpo`, where it changes the loss and is a semantic key)."""


TrainerConfig = Annotated[
    ToyTrainerConfig | TorchTrainerConfig | HFTrainerConfig,
    Field(discriminator="name"),
]


# ------------------------------------------------------------------- loop and custody


class RolloutConfig(_Section):
    """Groups, retries and what happens to a prompt whose budget is spent (DESIGN §6)."""

    group_size: int = Field(4, ge=1, le=4096)
    """Completions (siblings) generated per prompt; GRPO normalises rewards within a group.
    At most 4096."""
    timeout_s: float = Field(600.0, gt=0.0)
    """Deadline of one attempt, in seconds: an attempt that delivers nothing for this long
    is aborted and fails as infra (within `max_infra_attempts`)."""
    max_infra_attempts: int = Field(3, ge=1, le=255)
    """Attempts per sibling that may fail as infra (engine error, timeout) before the group
    is dropped."""
    max_data_attempts: int = Field(2, ge=1, le=255)
    """Attempts per sibling that may fail as data (environment or reward error) before the
    group is dropped."""
    backoff_ms: float = Field(10.0, ge=0.0)
    """First retry delay, in milliseconds; doubles on each retry."""
    backoff_max_ms: float = Field(2000.0, ge=0.0)
    """Longest retry delay, in milliseconds (>= `backoff_ms`)."""
    on_dropped_prompt: Literal["replace", "shrink"] = "replace"
    """A dropped group's step is refilled from the spare pool (`replace`) or trains on
    fewer groups (`shrink`)."""
    min_step_batch_fraction: float = Field(0.5, gt=0.0, le=1.0)
    """With `shrink`: the run stops with an error if a step would train on fewer than
    ceil(fraction x num_prompts_per_step) groups. In (0, 1]."""
    spare_prompts: int = Field(0, ge=0)
    """Prompts kept in the spare pool for `replace`."""


class RecoveryConfig(_Section):
    """What a restart reuses (DESIGN §1 granularity; issue: restart cost made visible)."""

    mode: Literal["sibling", "prompt_group", "cursor_only"] = "sibling"
    """`sibling`: a restart keeps finished siblings and regenerates only those in flight.
    `prompt_group`: a group is all-or-nothing; an unfinished group regenerates every
    sibling. `cursor_only`: the behaviour of systems without a ledger, for comparison only:
    groups in flight at the checkpoint are lost on restore (recorded as DROPPED with reason
    "lost in flight at the cut", and refilled from the source)."""


class TrainConfig(_Section):
    """How much training a run does."""

    num_prompts_per_step: int = Field(8, ge=1)
    """Prompt groups per optimizer step."""
    total_steps: int = Field(20, ge=1)
    """Optimizer steps after which the run ends (a resumed run may extend it)."""


class CheckpointConfig(_Section):
    """When atomic cuts are written and how many are kept."""

    every_steps: int = Field(5, ge=1)
    """Write a checkpoint every this many committed steps."""
    keep_last: int = Field(3, ge=1)
    """Number of most recent checkpoints kept on disk."""
    on_shutdown: bool = True
    """Write a checkpoint on a graceful shutdown (SIGINT/SIGTERM)."""
    warmup_every_steps: int = Field(100, ge=1)
    """Checkpoint the supervised warm start every this many of its steps."""


class SamplerConfig(_Section):
    """Admission gate and step selection policy (DESIGN §2)."""

    name: Literal["in_order", "weight_fifo", "windowed"] = "in_order"
    """`in_order`: step k trains groups stamped k; `weight_fifo`: oldest ready groups within
    the staleness bound; `windowed`: ungated, groups falling out of the window are evicted."""
    max_lookahead_versions: int = Field(1, ge=0)
    """`in_order`: how many steps (weight versions) dispatch may run ahead of the trainer."""
    max_staleness_versions: int = Field(1, ge=0)
    """`weight_fifo` / `windowed`: oldest weight version a trained group may come from,
    counted back from the trainer's version."""
    on_stale: Literal["regenerate", "drop"] = "regenerate"
    """`windowed`: a group evicted from the window is generated again, or dropped."""

    @property
    def window(self) -> int:
        """Versions the sampler admits beyond the current one; buffer capacity is
        num_prompts_per_step x (window + 1)."""
        if self.name == "in_order":
            return self.max_lookahead_versions
        return self.max_staleness_versions


class EvalConfig(_Section):
    """Periodic evaluation on the held-out set."""

    every_steps: int = Field(10, ge=0)
    """Evaluate every this many committed steps; 0 = never."""
    n_rows: int | None = Field(None, ge=1)
    """Eval prompts used per evaluation (rows); null = all of the eval set."""


class WarmupConfig(_Section):
    """Supervised warm-up before RL, so a tiny model starts from non-zero reward."""

    sft_steps: int = Field(0, ge=0)
    """Supervised steps before the first RL step; 0 = no warm-up."""
    sft_lr: float = Field(1e-3, gt=0.0)
    """Learning rate of the supervised warm-up."""
    sft_batch_size: int = Field(32, ge=1)
    """Examples per supervised step."""


class LoggerConfig(_Section):
    """What the run reports while it runs."""

    tensorboard: bool = False
    """Also write metrics as TensorBoard event files under run_dir."""
    progress: Literal["auto", "bar", "lines", "none"] = "auto"
    """Live progress: a bar, one line per step, nothing, or `auto` (bar on a terminal,
    lines otherwise)."""


# ------------------------------------------------------------------------------- Config


class Config(_Section):
    """A whole run. Build it with `load_config`; hand each component only its section."""

    run_dir: str = "runs/default"
    """Directory of the run: checkpoints, trace and metrics. A run resumes from it."""
    seed: int = Field(0, ge=0, lt=2**63)
    """Seeds the dataset permutation, sampling and initial weights; 0 <= seed < 2**63."""
    deterministic: bool = False
    """Make every step a function of the config alone (needs sampler `in_order`, no weight
    updates in flight): a killed-and-resumed run ends byte-identical to an unkilled one."""
    data: DataConfig = DataConfig()
    """Dataset."""
    engine: EngineConfig = ToyEngineConfig()
    """Generation backend, chosen by `engine.name`: toy, torch, hf, vllm."""
    trainer: TrainerConfig = ToyTrainerConfig()
    """Training backend, chosen by `trainer.name`: toy, torch, hf."""
    rollout: RolloutConfig = RolloutConfig()
    """Groups, retries, drops."""
    recovery: RecoveryConfig = RecoveryConfig()
    """What a restart reuses."""
    train: TrainConfig = TrainConfig()
    """Steps."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoint cadence and retention."""
    sampler: SamplerConfig = SamplerConfig()
    """Admission and selection policy."""
    max_inflight_prompts: int | None = None
    """Most prompt groups being generated at once; null = the sampler's buffer capacity."""
    max_buffered_rollouts: int | None = None
    """Most finished groups waiting for the trainer; null = the sampler's buffer capacity."""
    eval: EvalConfig = EvalConfig()
    """Evaluation."""
    warmup: WarmupConfig = WarmupConfig()
    """Supervised warm-up."""
    logger: LoggerConfig = LoggerConfig()
    """Progress and metrics output."""

    @field_validator("engine", "trainer", mode="before")
    @classmethod
    def _name_defaults_to_toy(cls, v: Any) -> Any:
        # `engine: {latency_ms: 2}` (or the override `engine.latency_ms=2` on the defaults)
        # means the default backend, like any other omitted key.
        if isinstance(v, dict) and "name" not in v:
            return {**v, "name": "toy"}
        return v

    @model_validator(mode="after")
    def _cross_field(self, info: ValidationInfo) -> Config:
        if not (info.context or {}).get(_DEFER_CROSS_FIELD):
            problems = _cross_field_problems(_model_getter(self))
            if problems:
                raise _config_error(problems, path=None, overrides=(), source="the config")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The full resolved config as plain JSON-able data (tuples become lists), with
        each backend's `name` first."""
        out = self.model_dump(mode="json")
        for section in ("engine", "trainer"):
            out[section] = {"name": out[section]["name"], **out[section]}
        return out


def dump_yaml(cfg: Config) -> str:
    """The full resolved config as YAML; `load_config` reads it back to an equal `Config`."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


# ----------------------------------------------------------------------------- semantic

# Every leaf of every variant is in exactly one of these two lists (a test checks it), so a
# new key cannot join the config without someone deciding whether it changes semantics.
# A prefix covers everything under it; `_NOT_SEMANTIC` entries carve exceptions out of it.
_SEMANTIC = (
    "seed",
    "deterministic",
    "data",
    "engine.name",
    "engine.temperature",
    "engine.top_p",
    "engine.max_new_tokens",
    "engine.completion_tokens",
    "engine.model_path",
    "engine.chat_template",
    "trainer",
    "rollout.group_size",
    "train.num_prompts_per_step",
    "sampler",
    "warmup",
)
_NOT_SEMANTIC = (
    "run_dir",
    "engine.latency_ms",
    "engine.latency_jitter_ms",
    "engine.infra_fail_rate",
    "engine.data_fail_rate",
    "engine.hang_rate",
    "engine.max_batch_size",
    "engine.update_weights_in_flight",
    "engine.gpu_memory_utilization",
    "engine.tensor_parallel_size",
    "trainer.step_sleep_ms",
    "trainer.micro_batch_size",
    "rollout.timeout_s",
    "rollout.max_infra_attempts",
    "rollout.max_data_attempts",
    "rollout.backoff_ms",
    "rollout.backoff_max_ms",
    "rollout.on_dropped_prompt",
    "rollout.min_step_batch_fraction",
    "rollout.spare_prompts",
    "train.total_steps",
    "recovery",
    "checkpoint",
    "max_inflight_prompts",
    "max_buffered_rollouts",
    "eval",
    "logger",
)


def _under(path: str, prefixes: Sequence[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def is_semantic(path: str) -> bool:
    """Whether the dotted config key `path` is part of `semantic()` in every config (keys
    that are semantic only under another key's value are in `_semantic_when`)."""
    return _under(path, _SEMANTIC) and not _under(path, _NOT_SEMANTIC)


def _semantic_when(cfg: Config) -> frozenset[str]:
    """Keys of `_NOT_SEMANTIC` that this config makes semantic: under `trainer.loss_type:
    bnpo` the loss is a token mean per micro-batch, so `trainer.micro_batch_size` changes
    the update, not only memory use."""
    if isinstance(cfg.trainer, _GRPOSection) and cfg.trainer.loss_type == "bnpo":
        return frozenset({"trainer.micro_batch_size"})
    return frozenset()


def semantic(cfg: Config) -> dict[str, Any]:
    """The part of the config that changes what a run trains on, as a nested dict.

    The checkpoint stores it and restore step 8 (DESIGN §5) refuses to resume a run whose
    semantic config differs, unless the user names the keys they mean to change
    (`--allow-config-change KEY`): a silently different dataset, seed, group size, batch,
    sampler, sampling setting or optimizer would make the resumed run a different run.

    Left out on purpose, because changing them on resume is legitimate and does not change
    which prompts are trained on or how: `train.total_steps` (extending a run),
    `checkpoint.*` (cadence and retention), `run_dir`, `eval`, `logger`, the in-flight and
    buffer limits, rollout retry/backoff/drop settings (they decide whether a prompt is
    retried, not what a finished rollout contains), and the engine's latency,
    failure-injection, batch-size, memory and parallelism settings (throughput only).
    `trainer.micro_batch_size` only splits a step's batch for memory (except under
    `trainer.loss_type: bnpo`, which makes it semantic), and `trainer.step_sleep_ms` only
    slows the toy trainer.
    """
    flat = _flatten(cfg.to_dict())
    also = _semantic_when(cfg)
    out: dict[str, Any] = {}
    for path, value in flat.items():
        if is_semantic(path) or path in also:
            *parents, leaf = path.split(".")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
    return out


#: Semantic keys added after rollkeep 0.1.0, with the value that reproduces what a run did
#: before the key existed: a checkpoint written without the key resumes under that value
#: (and any other value is a change to name with --allow-config-change).
ADDED_KEYS: dict[str, Any] = {
    "data.generated.format": "plain",
    "trainer.lr_warmup_steps": 0,
    "trainer.lr_decay_steps": 0,
    "trainer.lr_final_ratio": 0.1,
    "trainer.scale_rewards": "group_population",
    "trainer.loss_type": "dapo",
    "trainer.dual_clip": None,
}

#: Semantic keys a resume can never change, with the reason.
_NEVER_CHANGE = {
    "seed": "it defines the permutation of prompts, and prompts already handed out were "
    "chosen by the old one",
}


def config_paths() -> set[str]:
    """Every dotted key of the config (of every engine and trainer variant), sections
    included: what `--allow-config-change` may name."""
    out: set[str] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            path = prefix + name
            out.add(path)
            variants = _variants(field.annotation)
            for sub in variants.values() or ([field.annotation] if _is_model(field.annotation) else []):
                walk(sub, path + ".")

    walk(Config, "")
    return out


def check_allowed_changes(keys: Sequence[str]) -> None:
    """Refuse `--allow-config-change` keys that name no config key, or a key that can never
    change on resume (ConfigError, exit 2). Run before anything else."""
    paths = config_paths()
    problems = []
    for key in keys:
        if key in _NEVER_CHANGE:
            problems.append(
                _Problem(key, f"`{key}` can never change on resume: {_NEVER_CHANGE[key]}; start a "
                         "new run_dir to use another value")
            )
        elif key not in paths:
            parent = key.rpartition(".")[0]
            siblings = sorted(p for p in paths if p.rpartition(".")[0] == parent) if parent in paths else []
            close = difflib.get_close_matches(key, siblings or sorted(paths), n=1, cutoff=0.4)
            hint = f"; did you mean `{close[0]}`?" if close else ""
            problems.append(_Problem(key, f"`{key}` is not a config key{hint}"))
    if problems:
        n = len(problems)
        raise ConfigError(
            f"{n} problem{'s' if n > 1 else ''} with --allow-config-change:\n"
            + "\n".join(f"  - {p.line}" for p in problems)
            + "\nNothing was run",
            field=", ".join(p.path for p in problems),
            expected="dotted config keys (e.g. train.num_prompts_per_step) that may change on resume",
            remedy="fix the keys listed above; `rollkeep train --help` shows an example",
        )


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ------------------------------------------------------------------------ cross-field

_DEFER_CROSS_FIELD = "rollkeep.config.defer_cross_field"
_BROKEN = object()  # a value that is absent, invalid, or already reported


@dataclass(frozen=True)
class _Problem:
    path: str
    line: str  # one readable line naming the dotted path, what was expected and found


def _cross_field_problems(get: Callable[[str], Any]) -> list[_Problem]:
    """Rules that tie keys together. `get(dotted_path)` returns the value (its default when
    absent) or `_BROKEN`, in which case the rule is skipped: that key is reported already."""
    problems: list[_Problem] = []

    if get("deterministic") is True:
        sampler = get("sampler.name")
        if isinstance(sampler, str) and sampler != "in_order":
            problems.append(
                _Problem(
                    "sampler.name",
                    f"`deterministic: true` needs `sampler.name: in_order`; found `{sampler}` "
                    "(only in_order pins which weight version generates each step)",
                )
            )
        if get("rollout.on_dropped_prompt") == "replace":
            problems.append(
                _Problem(
                    "rollout.on_dropped_prompt",
                    "`deterministic: true` needs `rollout.on_dropped_prompt: shrink`; found "
                    "`replace` (which prompt refills a step depends on how far generation ran "
                    "ahead when the drop happened, which is timing)",
                )
            )
        if get("engine.name") == "torch" and get("engine.update_weights_in_flight") is True:
            problems.append(
                _Problem(
                    "engine.update_weights_in_flight",
                    "`deterministic: true` needs `engine.update_weights_in_flight: false`; found "
                    "true (a weight update inside a generation depends on timing)",
                )
            )

    engine, trainer = get("engine.name"), get("trainer.name")
    pairs = {"toy": ("toy",), "torch": ("torch",), "hf": ("hf",), "vllm": ("hf",)}
    if isinstance(engine, str) and isinstance(trainer, str) and engine in pairs and trainer not in pairs[engine]:
        problems.append(
            _Problem(
                "trainer.name",
                f"`engine.name: {engine}` needs `trainer.name: {' or '.join(pairs[engine])}`; found "
                f"`{trainer}` (the trainer's weights must load into the engine's model)",
            )
        )

    lo, hi = get("rollout.backoff_ms"), get("rollout.backoff_max_ms")
    if _is_number(lo) and _is_number(hi) and hi < lo:
        problems.append(
            _Problem(
                "rollout.backoff_max_ms",
                f"`rollout.backoff_max_ms` must be >= `rollout.backoff_ms` ({lo}); found {hi}",
            )
        )

    if get("trainer.name") == "torch":
        embd, head = get("trainer.model.n_embd"), get("trainer.model.n_head")
        if _is_int(embd) and _is_int(head) and head > 0 and embd % head:
            problems.append(
                _Problem(
                    "trainer.model.n_embd",
                    f"`trainer.model.n_embd` must be a multiple of `trainer.model.n_head` ({head}); "
                    f"found {embd}",
                )
            )
    return problems


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _model_getter(cfg: Config) -> Callable[[str], Any]:
    def get(path: str) -> Any:
        node: Any = cfg
        for part in path.split("."):
            node = getattr(node, part, _BROKEN)
            if node is _BROKEN:
                return _BROKEN
        return node

    return get


def _raw_getter(raw: Mapping[str, Any], reported: set[str]) -> Callable[[str], Any]:
    """Read a dotted path from the unvalidated dict, falling back to the model default of
    the variant the dict names; `_BROKEN` if the path was reported or does not resolve."""

    def get(path: str) -> Any:
        if any(_under(path, [r]) or _under(r, [path]) for r in reported):
            return _BROKEN
        node: Any = raw
        model: type[BaseModel] | None = Config
        for part in path.split("."):
            field = model.model_fields.get(part) if model is not None else None
            if field is None:
                return _BROKEN
            value = node.get(part, _BROKEN) if isinstance(node, Mapping) else _BROKEN
            variants = _variants(field.annotation)
            if variants:
                name = value.get("name", "toy") if isinstance(value, Mapping) else "toy"
                model = variants.get(name)
                node = value if isinstance(value, Mapping) else {}
            elif _is_model(field.annotation):
                model = field.annotation
                node = value if isinstance(value, Mapping) else {}
            else:
                model = None
                if value is _BROKEN:
                    if field.is_required():
                        return _BROKEN
                    value = field.get_default(call_default_factory=True)
                node = value
        return node

    return get


# ------------------------------------------------------------------------------ loading


class _Loader(yaml.SafeLoader):
    """`yaml.SafeLoader` with two fixes: YAML 1.2 floats (`3e-4` is a number, not the
    string PyYAML's YAML 1.1 rules make it) and an error on a duplicate key (PyYAML keeps
    the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"duplicate key {key!r} (first defined on line {seen[key].line + 1})",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _parse_yaml(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader: no arbitrary objects
    except RecursionError:  # PyYAML recurses per nesting level; no config nests that deep
        raise yaml.YAMLError("nested too deeply to be a config") from None


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Read the YAML file at `path` (None = defaults only), apply dotted overrides
    (`train.total_steps=50`, `engine.name=torch`, `data.path=null`; each value is read as
    YAML), and validate. Every problem is raised together as one `ConfigError`."""
    raw = _read_file(path) if path is not None else {}
    problems: list[_Problem] = []
    for text in overrides:
        problem = _apply_override(raw, text)
        if problem is not None:
            problems.append(problem)

    cfg: Config | None = None
    try:
        cfg = Config.model_validate(raw, context={_DEFER_CROSS_FIELD: True})
    except ValidationError as err:
        problems.extend(_problem_from_pydantic(e) for e in err.errors())

    reported = {p.path for p in problems}
    getter = _model_getter(cfg) if cfg is not None else _raw_getter(raw, reported)
    problems.extend(_cross_field_problems(getter))

    if problems:
        raise _config_error(problems, path=path, overrides=overrides)
    assert cfg is not None
    return cfg


def _read_file(path: str | Path) -> dict[str, Any]:
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"config file {where} does not exist",
            path=where,
            expected="a readable YAML file",
            found="no such file",
            remedy="check the path, or give no config file to run with the defaults",
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"config file {where} cannot be read",
            path=where,
            expected="a readable UTF-8 YAML file",
            found=f"{type(err).__name__}: {err}",
            remedy="check the path and the file's permissions and encoding",
        ) from None
    try:
        data = _parse_yaml(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        found = err.problem or err.context or "a syntax error"
        if err.problem and err.context and err.context_mark is not None:
            found += f" ({err.context}, which starts at line {err.context_mark.line + 1})"
        raise ConfigError(
            f"config file {where} is not valid YAML{at}: {err.problem or err.context}",
            path=where,
            expected="valid YAML",
            found=found,
            remedy=f"fix the YAML{at}",
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(
            f"config file {where} is not valid YAML: {err}",
            path=where,
            expected="valid YAML",
            found=str(err),
            remedy="fix the YAML",
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {where} must be a mapping of keys to values",
            path=where,
            expected="a mapping at the top level (`key: value` lines)",
            found=_show(data),
            remedy="write the config as `section:` / `  key: value` lines",
        )
    return data


def _apply_override(raw: dict[str, Any], text: str) -> _Problem | None:
    """Set one `a.b.c=value` in `raw` (creating sections on the way); a problem or None."""
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep:
        return _Problem(
            text,
            f"override `{text}` has no `=`; expected `key.sub=value`, e.g. `train.total_steps=50`",
        )
    parts = key.split(".")
    if not key or any(not p for p in parts):
        return _Problem(text, f"override `{text}` has an empty key; expected `key.sub=value`")
    try:
        value = _parse_yaml(value_text)
    except yaml.YAMLError as err:
        detail = " ".join(str(getattr(err, "problem", None) or err).split())
        return _Problem(key, f"override `{text}`: the value is not valid YAML ({detail}); quote it")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            section = ".".join(parts[: i + 1])
            return _Problem(
                section,
                f"override `{text}`: `{section}` is {_show(child)}, not a section, so it has "
                f"no key `{parts[i + 1]}`",
            )
        node = child
    node[parts[-1]] = value
    return None


# ------------------------------------------------------------------- error messages


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _variants(annotation: Any) -> dict[str, type[BaseModel]]:
    """For a union of models chosen by `name`: {name: model}; else {}."""
    if typing.get_origin(annotation) not in (Union, types.UnionType):
        return {}
    out = {}
    for model in typing.get_args(annotation):
        if _is_model(model) and "name" in model.model_fields:
            out[model.model_fields["name"].default] = model
    return out


def _resolve(loc: tuple[Any, ...]) -> tuple[str, type[BaseModel] | None, str | None]:
    """Pydantic's error location -> (dotted path without union tags, the model at the end
    of it or None, the union section's chosen variant name if the path crossed one)."""
    shown: list[str] = []
    model: type[BaseModel] | None = Config
    variant: str | None = None
    i = 0
    while i < len(loc):
        part = loc[i]
        i += 1
        if isinstance(part, int):
            shown[-1:] = [f"{shown[-1]}[{part}]"] if shown else [f"[{part}]"]
            model = None
            continue
        shown.append(str(part))
        field = model.model_fields.get(part) if model is not None else None
        model = None
        if field is None:
            continue
        variants = _variants(field.annotation)
        if variants:
            if i < len(loc) and loc[i] in variants:
                variant = loc[i]
                model = variants[variant]
                i += 1
        elif _is_model(field.annotation):
            model = field.annotation
    return ".".join(shown), model, variant


_KINDS = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "tuple_type": "a list",
    "model_type": "a section (a mapping of keys to values)",
    "model_attributes_type": "a section (a mapping of keys to values)",
    "dict_type": "a section (a mapping of keys to values)",
}
_BOUNDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def _problem_from_pydantic(e: Mapping[str, Any]) -> _Problem:
    kind, loc, ctx, value = e["type"], tuple(e["loc"]), e.get("ctx") or {}, e.get("input")
    if kind == "extra_forbidden":
        parent_path, parent, variant = _resolve(loc[:-1])
        return _Problem(_resolve(loc)[0], _unknown_key(parent_path, parent, variant, loc[-1]))
    path, _, _ = _resolve(loc)
    if kind == "missing":
        return _Problem(path, f"`{path}` is required and has no default; set it")
    if kind == "union_tag_invalid":
        names = ", ".join(ctx.get("expected_tags", "").replace("'", "").split(", "))
        return _Problem(
            f"{path}.name",
            f"`{path}.name` must be one of {names}; found {_show(ctx.get('tag'))}",
        )
    if kind == "literal_error":
        expected = f"one of {ctx.get('expected', '').replace(chr(39), '')}"
    elif kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        expected = f"a value {op} {ctx.get(key)}"
    elif kind in _KINDS:
        expected = _KINDS[kind]
    else:
        expected = str(e["msg"]).removeprefix("Input should be ").rstrip(".")
    line = f"`{path}`: expected {expected}; found {_show(value)}"
    if kind == "string_type" and isinstance(value, (int, float, bool)):
        line += "; YAML reads it as a number or boolean, so quote it"
    elif kind in ("int_type", "float_type", "bool_type") and isinstance(value, str):
        line += "; remove the quotes"
    return _Problem(path, line)


def _unknown_key(
    parent_path: str, parent: type[BaseModel] | None, variant: str | None, key: Any
) -> str:
    full = f"{parent_path}.{key}" if parent_path else str(key)
    line = f"unknown key `{full}`"
    if parent is None:
        return line
    valid = list(parent.model_fields)
    close = difflib.get_close_matches(str(key), valid, n=1)
    prefix = f"{parent_path}." if parent_path else ""
    if close:
        line += f"; did you mean `{prefix}{close[0]}`?"
    else:
        line += f"; valid keys here: {', '.join(valid)}"
    if variant is not None:
        # The key may belong to another variant: the commonest slip after `engine.name=...`.
        section = parent_path.split(".")[-1]
        field = Config.model_fields.get(section)
        others = _variants(field.annotation if field else None)
        keys = {k for model in others.values() for k in model.model_fields} - set(valid)
        meant = difflib.get_close_matches(str(key), sorted(keys), n=1)
        if meant:
            owners = [name for name, model in others.items() if meant[0] in model.model_fields]
            line += (
                f" (`{meant[0]}` is a setting of {section} {', '.join(owners)}; "
                f"this {section} is `{variant}`)"
            )
    return line


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    kind = {
        str: "a string",
        int: "an integer",
        float: "a number",
        list: "a list",
        dict: "a mapping",
    }.get(type(value))
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({kind})" if kind in ("a string", "a list", "a mapping") else text


def _config_error(
    problems: Sequence[_Problem],
    *,
    path: str | Path | None,
    overrides: Sequence[str],
    source: str | None = None,
) -> ConfigError:
    if source is None:
        source = f"config file {path}" if path is not None else "the default config"
    if overrides:
        source += " with overrides " + " ".join(overrides)
    n = len(problems)
    lines = "\n".join(f"  - {p.line}" for p in problems)
    return ConfigError(
        f"{n} problem{'s' if n > 1 else ''} in {source}:\n{lines}\nNothing was run",
        path=None if path is None else str(path),
        field=", ".join(dict.fromkeys(p.path for p in problems)),
        remedy="fix every key listed above, in the file or in the overrides; "
        "configs/toy.yaml is a valid example",
    )

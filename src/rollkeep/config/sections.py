"""The config's sections: one typed, frozen pydantic model each (see the package docstring)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..core.rollout.samplers import SAMPLERS
from .problems import _DEFER_CROSS_FIELD, _config_error, _cross_field_problems, _model_getter


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
    """Number of held-out prompts generated for evaluation (rows), drawn so that none is a
    training problem."""
    tool_share: float = Field(1.0, ge=0.0, le=1.0)
    """Task `calc`: the share of the training rows whose demonstration (the warm start's)
    calls the calculator; the others answer at once, as a demonstrator who can multiply
    would. Below 1 the warm start uses the tool on only some problems."""
    format: Literal["plain", "padded", "reversed"] = "plain"
    """How problems are written: `plain` "7+45=" -> "52"; `padded` operands and answer
    zero-padded to fixed widths, "07+45=" -> "052"; `reversed` padded, with the answer's
    digits least significant first, "07+45=" -> "250" (each digit then depends only on
    the operand digits at and below its place, and the carry from the one before)."""


class DataConfig(_Section):
    """Where prompts come from and how many passes are made over them."""

    path: str | None = None
    """Path of a JSONL/Parquet dataset (`prompt` required, `task` optional, other fields go to
    the reward function); null uses the built-in generated dataset."""
    epochs: int | None = Field(1, ge=1)
    """Passes over the dataset before the source is exhausted; null = unbounded."""
    generated: GeneratedDataConfig = GeneratedDataConfig()
    """The built-in dataset's settings (ignored when `path` is set)."""
    chat_template: bool = False
    """Render prompts and multi-turn episodes with the model tokenizer's chat template: the
    prompt is a user turn and the generation prompt, in the engine, the warm start and
    evaluation alike; each environment response is a user turn, and the template's tokens
    after the model's turn, the response and the next generation prompt are environment
    tokens (masked out of the loss). Needs an engine with a Hugging Face tokenizer (hf,
    vllm, remote): an error with toy or torch. (`engine.chat_template` renders the prompt
    alone.)"""


# ------------------------------------------------------------------------------ engines


class _EngineSection(_Section):
    """What every engine backend has: how many copies of it generate."""

    replicas: int = Field(1, ge=1, le=1024)
    """Engine replicas generating side by side, each in its own process (a Ray actor; more
    than one needs `cluster.backend: ray`, and is exit 2 on `local`). Not semantic: a run
    resumes on any number."""


class ToyEngineConfig(_EngineSection):
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
    """Tokens in each fake completion, at most (each completion's length is a function of its seed)."""
    token_ms: float = Field(0.0, ge=0.0)
    """Simulated time per generated token, in milliseconds, on top of `latency_ms`; with it the
    engine streams one chunk per token, so long generations are cheap to test (at 0 a
    generation is instant and reports only its result)."""
    max_concurrent: int = Field(0, ge=0, le=1_000_000)
    """Most attempts one toy engine runs at once, the others queued (a GPU engine's batch
    capacity, so throughput grows with `engine.replicas`); 0 = unbounded."""
    hang_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Probability that an attempt never returns (until `rollout.timeout_s` aborts it);
    keyed by the sibling's infra-retry count like `infra_fail_rate`, so the same hangs
    happen in every lineage."""


class _SamplingSection(_EngineSection):
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
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Precision of the engine's copy of the weights: `auto` = the checkpoint's dtype
    (config.json's, as transformers loads it). Trainers keep float32 master weights; every
    refit publishes them to the engine cast to this dtype, so behaviour log-probs carry its
    rounding (deterministic runs sample in float64 and need `auto`)."""


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
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Precision vLLM computes in and holds the weights in: `auto` = the checkpoint's dtype,
    as vLLM resolves it (a float32 checkpoint runs in bfloat16). Trainers keep float32 master
    weights; every refit publishes them to the engine cast to this dtype, and the behaviour
    log-probs, computed in it, enter the PPO ratio against the trainer's float32 ones
    (docs/backends.md, "vllm")."""
    enforce_eager: bool = False
    """Run vLLM's model eagerly: no torch.compile and no CUDA graphs (a faster start, slower
    decoding; for debugging)."""
    chat_template: bool = False
    """Wrap each prompt with the tokenizer's chat template (as engine `hf` does); a tokenizer
    without one is refused at start-up."""

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


_URL = re.compile(r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?")


class RemoteEngineConfig(_SamplingSection):
    """A fleet of inference servers driven over HTTP (server mode, docs/server-mode.md): a
    vLLM or SGLang the user runs, or `rollkeep serve`. Fenced on every start."""

    name: Literal["remote"] = "remote"
    """Engine backend."""
    flavor: Literal["vllm", "sglang"] = "vllm"
    """Which server's routes and fields: `vllm` (`/v1/completions` with token ids, the dev-mode
    control routes) or `sglang` (`/generate` with `input_ids`)."""
    servers: list[str] = Field(min_length=1, max_length=1024)
    """Base URLs of the servers, `http://host:port` (not semantic: a resume may use other
    servers, or another number of them)."""
    model: str | None = None
    """The served model name sent with every request (vLLM `model`); null: the first of the
    server's `/v1/models` (SGLang serves one model and ignores it)."""
    tokenizer_path: str
    """Local directory of the servers' tokenizer (a Hugging Face tokenizer; it must be the
    one the servers use): prompts are encoded, episodes and eval decoded with it (required)."""
    chat_template: bool = False
    """Wrap each prompt with the tokenizer's chat template."""
    max_concurrent: int = Field(64, ge=1, le=100_000)
    """Most requests in flight to one server at once (the others wait for a slot)."""
    request_timeout_s: float = Field(300.0, gt=0.0, le=86_400.0)
    """Longest one HTTP exchange may take, a streamed generation included, before it is an
    infra failure of the attempt (the scheduler's `rollout.timeout_s` still applies)."""
    api_key_env: str | None = None
    """The NAME of an environment variable holding a bearer token for the servers (the token
    itself is never in the config, the trace, the metrics or an error)."""
    max_response_bytes: int = Field(16 << 20, ge=1024, le=1 << 31)
    """Most bytes one response may make the controller read (a streamed one in all); past
    it the attempt is an infra failure."""
    unavailable_timeout_s: float = Field(120.0, gt=0.0, le=86_400.0)
    """While no server is live this long, the run stops with a final checkpoint (exit 5)."""

    @field_validator("servers")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        from pydantic_core import PydanticCustomError

        out = [u.rstrip("/") for u in v]
        for u in out:
            if not _URL.fullmatch(u):
                raise PydanticCustomError("server_url", "a list of http://host:port URLs (no query, no "
                                          "credentials)")
        if len(set(out)) != len(out):
            raise PydanticCustomError("server_url", "distinct servers; found one listed twice")
        return out



EngineConfig = Annotated[
    ToyEngineConfig | TorchEngineConfig | HFEngineConfig | VLLMEngineConfig | RemoteEngineConfig,
    Field(discriminator="name"),
]


# ----------------------------------------------------------------------------- trainers


class _TrainerSection(_Section):
    """What every trainer section has: how advantages are computed at finalize (they are
    stored in the ledger, so this is a semantic key; `rollkeep.core.rollout.advantages` has the formulas)."""

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
    the loss options are in `rollkeep.trainers.grpo_loss`, the learning-rate schedule in
    `rollkeep.trainers.grpo` (`GRPOTrainer.step_lr`)."""

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
    """Dual clip (verl's `clip_ratio_c`): a token with negative advantage A loses at most
    -c x A however large its ratio grows (the clipped objective is unbounded there); null =
    off. Must be > 1. verl applies it always (`clip_ratio_c` defaults to 3 and cannot be
    turned off), so a run ported from verl sets 3; TRL's `delta` is the same cap when it is
    > 1 + `clip_eps` (at or below that, TRL caps the ratio, not the loss)."""
    kl_clamp: float | None = Field(None, gt=0.0)
    """Upper bound on each token's k3 KL estimate (verl clamps it to 10 in `low_var_kl`);
    null = no clamp (TRL). A clamped token's KL term has no gradient."""
    log_ratio_clamp: float | None = Field(None, gt=0.0)
    """Bound c on every log-ratio, the PPO ratio's and the KL's: clamped to [-c, c] (verl
    clamps both to 20); null = no clamp (TRL). A clamped token's term has no gradient."""
    off_policy: Literal["none", "tis", "mis"] = "none"
    """Off-policy correction for tokens sampled by another policy than the trainer's (a
    version behind with lookahead, or another engine's kernels and dtype): `none` takes the
    PPO ratio against the behaviour log-probs (the clip is the only correction; verl's
    bypass mode); `tis` takes the ratio against the step's starting weights and weighs
    each token's loss by min(w, `is_cap`), w = their probability over the behaviour's
    (truncated importance sampling: TRL `vllm_importance_sampling_mode: token_truncate` /
    `sequence_truncate`, verl `rollout_correction.rollout_is`); `mis` drops the tokens (or
    sequences) whose w exceeds `is_cap` (masked importance sampling: TRL `token_mask` /
    `sequence_mask`). Formulas in `rollkeep.trainers.off_policy`; the `off_policy/*`
    metrics are logged in every mode."""
    is_cap: float = Field(2.0, gt=1.0)
    """With `off_policy: tis | mis`: the importance weight's cap (tis) or mask threshold (mis),
    > 1 (TRL's `vllm_importance_sampling_cap`, default 3; verl's `rollout_is_threshold`,
    default 2)."""
    is_level: Literal["token", "sequence"] = "token"
    """With `off_policy: tis | mis`: `token` weighs each token by its own ratio; `sequence` weighs
    every token of a sequence by the product of its tokens' ratios."""
    autocast: Literal["none", "bf16"] = "none"
    """Mixed precision: `bf16` runs the forward passes under torch.autocast(bfloat16), as
    GPU runs usually do, while the master weights, gradients and AdamW state stay in the
    trainer's dtype (float32); `none` computes in the weights' dtype. Log-probs, losses and
    statistics are float32 either way."""
    world_size: int = Field(1, ge=1, le=64)
    """Data-parallel training ranks: 1 trains in the controller's process; N > 1 starts N
    rank processes on this machine (gloo on CPU, nccl on GPU) that shard the model and the
    AdamW state with FSDP2 and write sharded checkpoints (docs/design.md §14). The loss is
    the one-process loss for every `loss_type` (to round-off); a run resumes on any number
    of ranks, so this may change between restarts."""
    step_timeout_s: float = Field(600.0, gt=0.0)
    """With `world_size` > 1: seconds a rank may take over one operation (a step, a
    checkpoint write, a load) before the run stops as failed (exit 5, naming the rank) with
    its last checkpoint intact."""


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
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype of the master weights and the AdamW state, whatever the checkpoint's
    (Qwen and Llama ship bf16, and transformers would load them so): at lr 1e-5 most bf16
    updates round away, so keep float32 and use `autocast: bf16` for speed. The engines
    get the weights cast to the dtype they serve (`engine.dtype`)."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward pass (gradient accumulation; memory only, except under
    `loss_type: bnpo`, where it changes the loss and is a semantic key)."""


def _trainer_factory(v: Any) -> str:
    from pydantic_core import PydanticCustomError

    if isinstance(v, str) and _REWARD_SPEC.match(v):
        return v
    raise PydanticCustomError("trainer_factory", "a `package.module:callable` string (a module path, a colon, "
                              "a class or function name, e.g. `examples.dcp_trainer:make`)")


class CustomTrainerConfig(_TrainerSection):
    """Your own trainer for the built-in GPT (docs/library.md, "Bring your own trainer"): rollkeep
    builds the model, the character tokenizer and the torch engine as for `torch`, and the
    trainer with `factory`."""

    name: Literal["custom"] = "custom"
    """Trainer backend."""
    factory: Annotated[str, PlainValidator(_trainer_factory)]
    """`"package.module:callable"` (required), called once at start-up as
    `callable(model=, tokenizer=, temperature=, seed=, max_completion_length=,
    scale_rewards=, **kwargs)`; it returns a trainer (`train_step`, `snapshot`, `load`,
    `weights`, `weights_sha256`: rollkeep.trainers.base). Imported from the current
    directory or the Python path; a factory that cannot be imported or called, or builds
    something that is not a trainer, is exit 2 at start-up."""
    kwargs: dict[str, Any] = {}
    """More keyword arguments of `factory` (your trainer's own settings)."""
    model: TorchModelConfig = TorchModelConfig()
    """Shape of the built-in GPT it trains."""


TrainerConfig = Annotated[
    ToyTrainerConfig | TorchTrainerConfig | HFTrainerConfig | CustomTrainerConfig,
    Field(discriminator="name"),
]


# ------------------------------------------------------------------- loop and custody


class RolloutConfig(_Section):
    """Groups, retries and what happens to a prompt whose budget is spent (docs/design.md §6)."""

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
    fail_fast_attempts: int = Field(8, ge=0, le=100_000)
    """When the run's first this many attempts all fail as data with the same error (a reward
    function or an environment that raises on every row), the run stops with exit 2 before
    dropping anything: the fault is the code, not the data; the same command resumes once it
    is fixed. Until the first success (or two different errors) no prompt is dropped. 0: off."""


class RecoveryConfig(_Section):
    """What a restart reuses (docs/design.md §1 granularity; issue: restart cost made visible)."""

    partial: Literal["resume", "regenerate"] = "resume"
    """What a restart does with a generation cut off mid-way (docs/design.md §5.3). `resume`: a
    streaming engine's tokens are recorded as they come (coalesced to one `progressed` event
    per attempt per journal flush) and the sibling's next attempt continues from them, as
    token ids, with their behaviour log-probs and versions. `regenerate`: it starts over.
    Applies to `mode: sibling` with the journal on (prefixes are durable only through it)."""
    progress_ms: float = Field(250.0, ge=1.0)
    """How often an attempt records the tokens it has streamed, at most, in milliseconds: its
    first record comes once it has generated for this long, then at most one per interval,
    and the rest just before its seal. So a generation shorter than this records nothing but
    its seal, and a kill loses at most this much of each longer one (plus the journal's last
    flush)."""
    lost_versions: Literal["keep", "regenerate"] = "keep"
    """What a restart from the journal does with work generated under a lost version: a
    weight version newer than the restored checkpoint, whose weights died with the process
    (docs/design.md §5.1). `keep`: the sealed rows are trained again by the re-done steps,
    which train the same groups (bit for bit the same weights in deterministic mode), and
    a group the killed process admitted is generated and trained no earlier than the
    version it was admitted under, so no batch is older than the sampler's window.
    `regenerate`: every sibling sealed under a lost version, and every partial generation
    the journal recorded after the checkpoint, is generated again under the resumed
    lineage's weights (the prompts stay in custody; costs the regeneration)."""
    mode: Literal["sibling", "prompt_group", "cursor_only"] = "sibling"
    """`sibling`: a restart keeps finished siblings and regenerates only those in flight.
    `prompt_group`: a group is all-or-nothing; an unfinished group regenerates every
    sibling. `cursor_only`: the behaviour of systems without a ledger, for comparison only:
    groups in flight at the checkpoint are lost on restore (recorded as DROPPED with reason
    "lost in flight at the cut", and refilled from the source; the trace and `rollkeep chaos`
    say so)."""


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


class ClusterConfig(_Section):
    """Where engine replicas run (docs/design.md §10). `local`: one engine inside the
    controller's process. `ray`: `engine.replicas` Ray actors, each in its own process,
    on this machine or on a cluster; the controller stays one process. Not semantic."""

    backend: Literal["local", "ray"] = "local"
    """`local` or `ray` (needs the `ray` extra: pip install 'rollkeep[ray]')."""
    address: str | None = None
    """Ray cluster to connect to (`ray start --head` prints it, e.g. `127.0.0.1:6379`, or
    `auto`); null starts a local Ray for the run, bound to loopback, dashboard off."""
    num_cpus: int | None = Field(None, ge=1, le=4096)
    """CPUs of the local Ray the run starts (null: all of this machine's); ignored with `address`."""
    replica_cpus: float = Field(1.0, ge=0.0, le=1024)
    """CPUs Ray reserves for each replica (fractions allowed: 0.5 packs two on a core)."""
    replica_gpus: float | None = Field(None, ge=0.0, le=64)
    """GPUs Ray reserves for each replica; null: `engine.tensor_parallel_size` for vllm, 0 otherwise."""
    max_restarts: int = Field(3, ge=0, le=10_000)
    """Times Ray restarts a replica whose process died, before it is gone for good."""
    replica_timeout_s: float = Field(120.0, gt=0, le=86_400)
    """With no replica alive for this long (at start or after deaths), the run stops with
    a final checkpoint and exit 5."""
    trainer_cpus: float = Field(1.0, ge=0.0, le=1024)
    """With `trainer.world_size` > 1: CPUs Ray reserves for each trainer rank, which then
    runs as a Ray actor on the controller's node (rather than a child process)."""
    trainer_gpus: float = Field(0.0, ge=0.0, le=64)
    """With `trainer.world_size` > 1: GPUs Ray reserves for each trainer rank (1 on a GPU
    node: each rank then sees its own device)."""


class JournalConfig(_Section):
    """The custody journal (docs/design.md §5.1): every ledger event and every finished
    generation is made durable every few milliseconds, so a kill loses only the last
    flush instead of everything since the last checkpoint."""

    enabled: bool = True
    """Journal the run in RUN_DIR/journal and RUN_DIR/rows; false: a restart resumes from
    the last checkpoint alone (and regenerates what was generated after it)."""
    flush_ms: float = Field(10.0, gt=0, le=10_000)
    """Group commit: one fsync of what was appended at most this often, in milliseconds."""
    flush_events: int = Field(4096, ge=1)
    """... or as soon as this many events are waiting."""


class SamplerConfig(_Section):
    """Admission gate and step selection policy (docs/design.md §2)."""

    name: Literal[SAMPLERS] = "in_order"  # type: ignore[valid-type]
    """`in_order`: step k trains groups stamped k; `weight_fifo`: oldest ready groups within
    the staleness bound; `windowed`: `weight_fifo`'s gate, oldest ready groups waiting for no
    one; stragglers falling out of the window are evicted."""
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
    """Periodic evaluation on the held-out set (greedy completions, with the torch and hf
    trainers)."""

    every_steps: int = Field(10, ge=0)
    """Evaluate every this many committed steps; 0 = never."""
    n_rows: int | None = Field(None, ge=1)
    """Eval prompts used per evaluation (rows); null = all of the eval set."""
    num_samples: int = Field(4, ge=0)
    """Sample completions kept per evaluation (the first this many eval rows: the same
    prompts every time), in RUN_DIR/samples.jsonl and as TensorBoard text; 0 = none."""
    path: str | None = None
    """A held-out JSONL (or Parquet) dataset to evaluate on, read like `data.path` (`prompt`
    required, `task` optional, other fields go to the reward function); null = the built-in
    dataset's held-out rows (`data.generated.eval_rows`), and no evaluation when `data.path`
    is set."""


_REWARD_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_REWARD_EXPECTED = (
    "a `package.module:function` string (a module path, a colon, a function name, e.g. "
    "`my_rewards:score`), or a mapping of task names to such strings"
)


def _reward_spec(v: Any) -> str | dict[str, str] | None:
    """`reward.fn`: checked here in one piece (a union would report one error per member)."""
    from pydantic_core import PydanticCustomError

    def bad() -> PydanticCustomError:  # the error's line adds what was found
        return PydanticCustomError("reward_spec", _REWARD_EXPECTED)

    if v is None:
        return None
    if isinstance(v, str):
        if not _REWARD_SPEC.match(v):
            raise bad()
        return v
    if isinstance(v, dict) and v:
        for task, spec in v.items():
            if not isinstance(task, str) or not isinstance(spec, str) or not _REWARD_SPEC.match(spec):
                raise bad()
        return dict(v)
    raise bad()


RewardSpec = Annotated[str | dict[str, str] | None, PlainValidator(_reward_spec)]


def _one_reward_fn(v: Any) -> str:
    from pydantic_core import PydanticCustomError

    if isinstance(v, str) and _REWARD_SPEC.match(v):
        return v
    raise PydanticCustomError("reward_spec", "a `package.module:function` string (a module path, a colon, a "
                              "function name, e.g. `my_rewards:score`)")


class RewardFnConfig(_Section):
    """One entry of `reward.fns` (TRL's `reward_funcs` with its `reward_weights`)."""

    fn: Annotated[str, PlainValidator(_one_reward_fn)]
    """`"package.module:function"`, called per sample as `fn(completion, row) -> float` or,
    when it has a `completions` (or `prompts`) parameter, batched as TRL calls it:
    `fn(prompts=[...], completions=[...], **row_fields) -> list[float]` (each row field a
    list; None in the list: no reward from this function for that sample). `async def` too."""
    weight: float = Field(1.0, allow_inf_nan=False)
    """Its weight in the reward: the sum of weight x value over `reward.fns`."""
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")
    """The name of its metric `reward/<name>` (its mean per step); null = the function's name."""


class RewardConfig(_Section):
    """Reward functions from your own code, instead of the built-in ones looked up by each
    row's `task` (`rollkeep.tasks.REWARDS`)."""

    fn: RewardSpec = None
    """`"package.module:function"`: rewards every row with that function; or a mapping
    `{task: "package.module:function"}`: rewards the rows of each listed task with its
    function (other tasks keep the built-in reward). The function is called as
    `fn(completion: str, row: dict) -> float` (`row` is the dataset row, every field) and
    must return a finite number; an exception, a non-number or a call past `timeout_s` is
    a data failure of that attempt (within `rollout.max_data_attempts`); SystemExit or
    KeyboardInterrupt stops the run (final checkpoint, exit 2). It runs on a worker thread,
    several calls at once. The module is imported at start-up, from the current directory
    or the Python path; null = the built-in rewards."""
    fns: list[RewardFnConfig] | None = Field(None, min_length=1)
    """Several reward functions, as TRL users write them (`reward_funcs`, `reward_weights`):
    `[{fn: "mod:f", weight: 1.0}, ...]`; a completion's reward is the weighted sum, and each
    function is logged as its own metric `reward/<name>`. Every row is rewarded by them (not
    by the built-in rewards); not together with `reward.fn`. See docs/rewards.md."""
    timeout_s: float = Field(60.0, gt=0.0, le=86_400)
    """Deadline of one `reward.fn` call; past it, a data failure of the attempt, and the call
    is abandoned (its thread left to finish or hang; the run does not wait for it).
    `rollout.timeout_s` bounds the whole attempt, reward included."""
    max_concurrent: int = Field(64, ge=1, le=65_536)
    """The most `reward.fn` calls running at once (a judge over HTTP has its own limit):
    a completion waits for a slot, within `rollout.timeout_s`. A reward function may be
    `async def` (awaited on the run's loop, e.g. calling a judge through
    `rollkeep.effects.call`) or plain (run on a worker thread)."""

    @model_validator(mode="after")
    def _fn_or_fns(self) -> RewardConfig:
        from pydantic_core import PydanticCustomError

        if self.fn is not None and self.fns is not None:
            raise PydanticCustomError("reward_fn_and_fns", "`reward.fn` or `reward.fns`, not both (`reward.fns` "
                                      "can hold reward.fn's function as one of its entries)")
        return self


class EffectsConfig(_Section):
    """Calls to the outside made through `rollkeep.effects.call` (docs/effects.md): each
    one's intent is durable in the journal before it is made and its outcome after, so a
    resumed run answers it from the record instead of calling again."""

    max_result_bytes: int = Field(1 << 20, ge=1, le=16 << 20)
    """The most bytes of one call's result (its JSON); a larger result is recorded as the
    call's error (the attempt usually fails as data), so the journal stays bounded."""


def _env_factory(v: Any) -> str | None:
    from pydantic_core import PydanticCustomError

    if v is None or (isinstance(v, str) and _REWARD_SPEC.match(v)):
        return v
    raise PydanticCustomError("env_factory", "a `package.module:callable` string (a module path, a colon, a "
                              "class or function name, e.g. `my_env:GuessEnv`)")


class EnvConfig(_Section):
    """Multi-turn environments (docs/design.md §5.4): each sibling is an episode of model turns
    and environment responses. Unset (`name` and `factory` null): single-turn generation
    rewarded by `reward.fn` or the task's built-in reward."""

    name: str | None = None
    """A built-in environment: `calc` (a calculator tool: `CALC(expr)` turns are answered
    with the value, any other turn is the answer); null = none (single-turn), unless
    `factory` is set."""
    factory: Annotated[str | None, PlainValidator(_env_factory)] = None
    """`"package.module:callable"`: your own environment, called as `callable(**kwargs)` once
    per episode (a class works); imported at start-up from the current directory or the
    Python path. Set `name` or `factory`, not both."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments of the environment's constructor (`factory` or the built-in)."""
    max_turns: int = Field(4, ge=1, le=1024)
    """Most model turns per episode; the last one ends it whatever the environment says."""
    max_turn_tokens: int | None = Field(None, ge=1)
    """Most tokens the model writes in one turn (a turn ends at EOS or here); null = only
    the trajectory's budget (`engine.max_new_tokens`, environment tokens included) bounds it."""
    timeout_s: float = Field(30.0, gt=0.0)
    """Deadline of one environment call (the factory, reset, step, snapshot, restore); past it,
    a data failure of the attempt, and the call is abandoned (its thread left to finish or
    hang; later calls run on other threads)."""
    max_response_bytes: int = Field(65536, ge=1, le=16 << 20)
    """Longest environment response (a step's `response`, UTF-8 bytes), at most 16 MiB; a
    longer one is a data failure of the attempt. Within it, the trajectory's budget
    (`engine.max_new_tokens`; the toy engine's is 4096 tokens) ends an episode whose
    response would spend it."""
    max_snapshot_bytes: int = Field(65536, ge=0, le=16 << 20)
    """Largest environment snapshot (environments recovering by `snapshot`), at most 16 MiB;
    a larger one is a data failure of the attempt. Snapshots live in the journal's records
    (64 MiB at most each) and in the trace, so keep them small: a handle, not a database.
    The handles of environments recovering by `lease` are bounded by it too."""
    cut_timeout_s: float = Field(10.0, ge=0.0, le=3600.0)
    """The cut's environment phase (environments recovering by `lease`, docs/effects.md): at
    a checkpoint's step boundary no new environment step starts, and the steps in flight get
    this long to finish and commit their turns, so the checkpoint holds every live episode at
    its newest committed turn; a step still running then is retired from the cut (its turn
    goes into the journal, and into the next checkpoint). 0: the cut never waits."""


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
    wandb: bool = False
    """Also log metrics to Weights & Biases (needs the `wandb` extra). Set
    `WANDB_MODE=offline` to log without a network (`wandb sync` uploads later). A resumed
    run continues the same W&B run: its id is kept in `RUN_DIR/wandb_run_id`."""
    wandb_project: str = "rollkeep"
    """W&B project the run is logged to."""
    wandb_name: str | None = None
    """W&B run name; null = the last part of run_dir."""
    progress: Literal["auto", "bar", "lines", "none"] = "auto"
    """Live progress: a bar, one line per step, nothing, or `auto` (bar on a terminal,
    lines otherwise)."""
    verbose: bool = False
    """Print a full line per checkpoint (its size, how long the cut held the loop, the
    background write's time). Off: the bar shows the last checkpoint (`ckpt N`), and
    `progress: lines` prints one short line per checkpoint."""


# ------------------------------------------------------------------------------- Config


class Config(_Section):
    """A whole run. Build it with `load_config`; hand each component only its section."""

    run_dir: str = "runs/default"
    """Directory of the run: checkpoints, `trace.jsonl`, `metrics.jsonl`, `samples.jsonl`,
    `config.yaml` (and the journal, `rows/`). A run resumes from it."""
    seed: int = Field(0, ge=0, lt=2**63)
    """Seeds the dataset permutation, sampling and initial weights; 0 <= seed < 2**63."""
    deterministic: bool = False
    """Make every step a function of the config alone (needs `sampler.name: in_order`,
    `rollout.on_dropped_prompt: shrink`, no weight updates in flight): a killed-and-resumed
    run ends byte-identical to an unkilled one."""
    data: DataConfig = DataConfig()
    """Dataset."""
    engine: EngineConfig = ToyEngineConfig()
    """Generation backend, chosen by `engine.name`: toy, torch, hf, vllm."""
    trainer: TrainerConfig = ToyTrainerConfig()
    """Training backend, chosen by `trainer.name`: toy, torch, hf, custom."""
    rollout: RolloutConfig = RolloutConfig()
    """Groups, retries, drops."""
    recovery: RecoveryConfig = RecoveryConfig()
    """What a restart reuses."""
    train: TrainConfig = TrainConfig()
    """Steps."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoint cadence and retention."""
    journal: JournalConfig = JournalConfig()
    """Continuous durability between checkpoints."""
    effects: EffectsConfig = EffectsConfig()
    """Calls to the outside (judges, tools, sandboxes), recorded exactly once."""
    cluster: ClusterConfig = ClusterConfig()
    """Where engine replicas run: local or Ray."""
    sampler: SamplerConfig = SamplerConfig()
    """Admission and selection policy."""
    max_inflight_prompts: int | None = None
    """Most prompt groups being generated at once; null = the sampler's buffer capacity,
    `num_prompts_per_step` x (window + 1)."""
    max_buffered_rollouts: int | None = None
    """Most finished groups waiting for the trainer; null = the sampler's buffer capacity,
    `num_prompts_per_step` x (window + 1), which is also its maximum (a larger value is
    refused at start-up)."""
    reward: RewardConfig = RewardConfig()
    """Reward functions from your own code."""
    env: EnvConfig = EnvConfig()
    """Multi-turn environments."""
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

    @property
    def journaled(self) -> bool:
        """`journal.enabled`, except under `recovery.mode: cursor_only`, which stands for a
        system that keeps no custody between checkpoints (it is there to compare with)."""
        return self.journal.enabled and self.recovery.mode != "cursor_only"

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



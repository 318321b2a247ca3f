"""Which keys change what a run trains on (restore step 8), which may change on resume,
and which never may."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import (
    BaseModel,
)

from ..core.errors import ConfigError
from .problems import _is_model, _Problem, _under, _variants
from .sections import Config, _GRPOSection

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
    "engine.tokenizer_path",
    "engine.dtype",  # the behaviour policy's numerics: its log-probs enter the PPO ratio
    "trainer",
    "rollout.group_size",
    "train.num_prompts_per_step",
    "sampler",
    "warmup",
    "reward.fn",
    "reward.fns",
    "env.name",
    "env.factory",
    "env.kwargs",
    "env.max_turns",
    "env.max_turn_tokens",
)
_NOT_SEMANTIC = (
    "run_dir",
    "engine.latency_ms",
    "engine.latency_jitter_ms",
    "engine.infra_fail_rate",
    "engine.data_fail_rate",
    "engine.hang_rate",
    "engine.max_concurrent",
    "engine.token_ms",
    "engine.max_batch_size",
    "engine.replicas",
    "engine.update_weights_in_flight",
    "engine.gpu_memory_utilization",
    "engine.tensor_parallel_size",
    "engine.enforce_eager",  # compiled or eager: the same computation, at another speed
    "engine.flavor",
    "engine.servers",
    "engine.model",
    "engine.request_timeout_s",
    "engine.api_key_env",
    "engine.max_response_bytes",
    "engine.unavailable_timeout_s",
    "trainer.step_sleep_ms",
    "trainer.micro_batch_size",
    "trainer.world_size",
    "trainer.step_timeout_s",
    "rollout.timeout_s",
    "rollout.max_infra_attempts",
    "rollout.max_data_attempts",
    "rollout.backoff_ms",
    "rollout.backoff_max_ms",
    "rollout.on_dropped_prompt",
    "rollout.min_step_batch_fraction",
    "rollout.spare_prompts",
    "rollout.fail_fast_attempts",  # when a run stops, never what it trains on
    "train.total_steps",
    "recovery",
    "checkpoint",
    "journal",
    "cluster",
    "max_inflight_prompts",
    "max_buffered_rollouts",
    "eval",
    "logger",
    "env.timeout_s",
    "env.max_snapshot_bytes",
    "env.max_response_bytes",
    "env.cut_timeout_s",
    "reward.timeout_s",
    "reward.max_concurrent",
    "effects",
)


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

    The checkpoint stores it and restore step 8 (docs/design.md §5) refuses to resume a run whose
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
    "data.generated.tool_share": 1.0,
    "trainer.lr_warmup_steps": 0,
    "trainer.lr_decay_steps": 0,
    "trainer.lr_final_ratio": 0.1,
    "reward.fn": None,
    "reward.fns": None,
    "env.name": None,
    "env.factory": None,
    "env.kwargs": {},
    "env.max_turns": 4,
    "env.max_turn_tokens": None,
    "trainer.scale_rewards": "group_population",
    "trainer.loss_type": "dapo",
    "trainer.dual_clip": None,
    "data.chat_template": False,
    "engine.dtype": "auto",
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



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
are checked by `rollkeep.core.rollout.samplers.check_limits`, not here.

    sections   the models, one per section
    loading    YAML, dotted overrides, backend switches by override, validation
    semantic_keys  what changes what a run trains on, what a resume may change
    problems   the rules that tie keys together, and the wording of every error
    reference  docs/config.md, generated from the models' docstrings
"""

from __future__ import annotations

from .loading import load_config
from .sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    EngineConfig,
    EvalConfig,
    GeneratedDataConfig,
    HFEngineConfig,
    HFTrainerConfig,
    JournalConfig,
    LoggerConfig,
    RecoveryConfig,
    RewardConfig,
    RolloutConfig,
    SamplerConfig,
    TorchEngineConfig,
    TorchModelConfig,
    TorchTrainerConfig,
    ToyEngineConfig,
    ToyTrainerConfig,
    TrainConfig,
    TrainerConfig,
    VLLMEngineConfig,
    WarmupConfig,
    dump_yaml,
)
from .semantic_keys import ADDED_KEYS, check_allowed_changes, config_paths, is_semantic, semantic

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
    "JournalConfig",
    "SamplerConfig",
    "EvalConfig",
    "RecoveryConfig",
    "RewardConfig",
    "WarmupConfig",
    "LoggerConfig",
    "load_config",
    "dump_yaml",
    "semantic",
    "check_allowed_changes",
    "ADDED_KEYS",
    "config_paths",
    "is_semantic",
]



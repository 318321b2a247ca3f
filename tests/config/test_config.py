"""Config loading (`rollkeep.config`): defaults, YAML plus dotted overrides, every kind of
error reported at once as one `ConfigError`, and the semantic subset used by restore step 8."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollkeep.config import (
    Config,
    HFEngineConfig,
    HFTrainerConfig,
    SamplerConfig,
    TorchEngineConfig,
    TorchTrainerConfig,
    ToyEngineConfig,
    ToyTrainerConfig,
    VLLMEngineConfig,
    dump_yaml,
    is_semantic,
    load_config,
    semantic,
)
from rollkeep.core.errors import ConfigError, UserInputError
from rollkeep.core.restore.configdiff import diff, flatten

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(*overrides: str, path: Path | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value


# ------------------------------------------------------------------------ happy paths


def test_defaults_load_with_the_documented_values():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.run_dir == "runs/default" and cfg.seed == 0 and cfg.deterministic is False
    assert cfg.data.path is None and cfg.data.epochs == 1
    assert cfg.data.generated.task == "arith" and cfg.data.generated.n_rows == 512
    assert isinstance(cfg.engine, ToyEngineConfig) and isinstance(cfg.trainer, ToyTrainerConfig)
    assert cfg.rollout.group_size == 4 and cfg.recovery.mode == "sibling"
    assert cfg.rollout.on_dropped_prompt == "replace"
    assert cfg.train.num_prompts_per_step == 8 and cfg.train.total_steps == 20
    assert cfg.checkpoint.every_steps == 5 and cfg.checkpoint.keep_last == 3
    assert cfg.sampler.name == "in_order" and cfg.sampler.window == 1
    assert cfg.max_inflight_prompts is None and cfg.max_buffered_rollouts is None
    assert cfg.eval.every_steps == 10 and cfg.eval.n_rows is None and cfg.eval.num_samples == 4
    assert cfg.warmup.sft_steps == 0 and cfg.logger.progress == "auto"


def test_every_field_of_every_model_has_a_docstring():
    models = [Config]
    seen = set()
    while models:
        model = models.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
            for sub in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(sub, type) and issubclass(sub, Config.__mro__[1]):
                    models.append(sub)
    assert TorchTrainerConfig in seen and VLLMEngineConfig in seen


def test_models_are_frozen():
    cfg = Config()
    with pytest.raises(Exception, match="frozen"):
        cfg.seed = 3  # type: ignore[misc]


def test_yaml_then_overrides_applied_in_order(tmp_path):
    path = write(
        tmp_path,
        "seed: 3\ntrain:\n  total_steps: 7\nrollout:\n  group_size: 2\n",
    )
    cfg = load_config(path, ["train.total_steps=9", "train.total_steps=11", "run_dir=runs/x"])
    assert cfg.seed == 3
    assert cfg.train.total_steps == 11  # the last override wins
    assert cfg.train.num_prompts_per_step == 8  # untouched keys keep their defaults
    assert cfg.rollout.group_size == 2
    assert cfg.run_dir == "runs/x"


def test_override_values_are_parsed_as_yaml():
    cfg = load_config(
        None,
        [
            "seed=3",
            "deterministic=true", "rollout.on_dropped_prompt=shrink",
            "data.path=prompts.jsonl",
            "data.epochs=null",
            "max_inflight_prompts=12",
            "trainer.name=torch",
            "engine.name=torch",
            "trainer.betas=[0.8, 0.99]",
            "trainer.lr=3e-4",  # PyYAML alone would read this as a string
            "run_dir='2024'",  # quoted: a string, not an integer
        ],
    )
    assert cfg.seed == 3 and cfg.deterministic is True
    assert cfg.data.path == "prompts.jsonl" and cfg.data.epochs is None
    assert cfg.max_inflight_prompts == 12
    assert cfg.trainer.betas == (0.8, 0.99) and cfg.trainer.lr == 3e-4
    assert cfg.run_dir == "2024"


def test_exponent_floats_in_yaml_files_are_numbers(tmp_path):
    path = write(
        tmp_path, "engine:\n  name: torch\ntrainer:\n  name: torch\n  lr: 3e-4\nwarmup:\n  sft_lr: 1E-3\n"
    )
    cfg = load_config(path)
    assert cfg.trainer.lr == pytest.approx(3e-4) and cfg.warmup.sft_lr == pytest.approx(1e-3)


def test_override_switches_the_engine_variant(tmp_path):
    cfg = load_config(None, ["engine.name=torch", "engine.temperature=0.7", "trainer.name=torch"])
    assert isinstance(cfg.engine, TorchEngineConfig)
    assert cfg.engine.temperature == 0.7 and cfg.engine.max_batch_size == 64

    path = write(tmp_path, "engine:\n  name: toy\n  completion_tokens: 4\n")
    # the file's toy-only key is dropped, with a warning that names it
    warnings: list[str] = []
    cfg = load_config(path, ["engine.name=vllm", "engine.model_path=/m", "trainer.name=hf",
                             "trainer.model_path=/m"], warn=warnings.append)
    assert isinstance(cfg.engine, VLLMEngineConfig) and cfg.engine.model_path == "/m"
    assert len(warnings) == 1 and "`engine.completion_tokens`" in warnings[0]
    # a key of the old variant given on the command line stays an error, by name
    err = problems("engine.name=vllm", "engine.model_path=/m", "trainer.name=hf",
                   "trainer.model_path=/m", "engine.completion_tokens=4", path=path)
    assert "engine.completion_tokens" in err.field
    assert "is a setting of engine toy; this engine is `vllm`" in str(err)


def test_variant_switch_to_hf_with_model_path():
    cfg = load_config(None, ["engine.name=hf", "engine.model_path=/models/tiny", "trainer.name=hf",
                             "trainer.model_path=/models/tiny"])
    assert isinstance(cfg.engine, HFEngineConfig)
    assert cfg.engine.model_path == "/models/tiny" and cfg.engine.max_batch_size == 16


def test_nested_override_creates_sections(tmp_path):
    # `trainer:` is present but empty (null) in the file; the override builds under it
    path = write(tmp_path, "trainer:\n")
    cfg = load_config(path, ["trainer.name=torch", "trainer.model.n_layer=3", "engine.name=torch"])
    assert isinstance(cfg.trainer, TorchTrainerConfig) and cfg.trainer.model.n_layer == 3
    assert cfg.trainer.model.n_head == 4
    assert load_config(None, ["eval.n_rows=5"]).eval.n_rows == 5


def test_section_keys_without_name_mean_the_default_toy_backend():
    cfg = load_config(None, ["engine.latency_ms=5", "trainer.step_sleep_ms=1"])
    assert cfg.engine == ToyEngineConfig(latency_ms=5)
    assert cfg.trainer == ToyTrainerConfig(step_sleep_ms=1)


def test_sampler_window_is_lookahead_for_in_order_else_staleness():
    assert SamplerConfig(max_lookahead_versions=2, max_staleness_versions=5).window == 2
    for name in ("weight_fifo", "windowed"):
        s = SamplerConfig(name=name, max_lookahead_versions=2, max_staleness_versions=5)
        assert s.window == 5


def test_to_dict_is_plain_data_and_dump_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["trainer.name=torch", "engine.name=torch", "data.epochs=null"])
    d = cfg.to_dict()
    assert d["trainer"]["betas"] == [0.9, 0.95]  # tuple -> list: JSON-able
    assert d["engine"]["name"] == "torch" and d["data"]["epochs"] is None
    path = write(tmp_path, dump_yaml(cfg))
    assert load_config(path) == cfg


def test_toy_yaml_loads():
    cfg = load_config(REPO / "configs" / "toy.yaml")
    assert cfg.engine == ToyEngineConfig(
        latency_ms=10, latency_jitter_ms=10, infra_fail_rate=0.02, data_fail_rate=0.01
    )
    assert isinstance(cfg.trainer, ToyTrainerConfig)
    assert cfg.data.path is None and cfg.data.epochs == 3 and cfg.data.generated.n_rows == 96
    assert cfg.rollout.group_size == 4 and cfg.train.num_prompts_per_step == 8
    assert cfg.train.total_steps == 30 and cfg.checkpoint.every_steps == 3
    assert cfg.sampler.name == "in_order" and cfg.sampler.max_lookahead_versions == 1
    assert cfg.run_dir == "runs/toy" and cfg.eval.every_steps == 0


# -------------------------------------------------------------------------------- errors


def test_config_error_is_a_user_input_error():
    err = problems("seed=x")
    assert isinstance(err, UserInputError)


def test_unknown_top_level_key_suggests_the_closest():
    err = problems("sed=3")
    assert "unknown key `sed`; did you mean `seed`?" in str(err)
    assert err.field == "sed"


def test_unknown_nested_key_suggests_the_closest():
    err = problems("train.num_prompt_per_step=3")
    assert (
        "unknown key `train.num_prompt_per_step`; did you mean `train.num_prompts_per_step`?"
        in str(err)
    )
    err = problems("data.generated.nrows=3")
    assert "did you mean `data.generated.n_rows`?" in str(err)


def test_unknown_key_far_from_any_lists_the_valid_keys():
    err = problems("checkpoint.zzz=1")
    assert "unknown key `checkpoint.zzz`; valid keys here: every_steps, keep_last" in str(err)


def test_unknown_key_inside_a_variant_uses_that_variants_keys(tmp_path):
    path = write(tmp_path, "engine:\n  name: torch\n  temprature: 0.5\ntrainer:\n  name: torch\n")
    err = problems(path=path)
    assert "unknown key `engine.temprature`; did you mean `engine.temperature`?" in str(err)
    assert err.path == str(path)
    # `latency_ms` is valid for toy only
    err = problems("engine.name=torch", "engine.latency_ms=2", "trainer.name=torch")
    assert "unknown key `engine.latency_ms`" in str(err)
    assert "is a setting of engine toy; this engine is `torch`" in str(err)
    # and a key of the torch trainer is unknown on the toy trainer
    err = problems("trainer.lr=0.1")
    assert "unknown key `trainer.lr`" in str(err) and "trainer torch, hf" in str(err)


@pytest.mark.parametrize(
    "override, field, fragment",
    [
        ("seed='3'", "seed", 'expected an integer; found "3" (a string); remove the quotes'),
        ("seed=1.5", "seed", "expected an integer; found 1.5"),
        ("seed=true", "seed", "expected an integer; found true"),
        ("deterministic=1", "deterministic", "expected true or false; found 1"),
        ("run_dir=2024", "run_dir", "expected a string; found 2024; YAML reads it"),
        ("engine.latency_ms=fast", "engine.latency_ms", "expected a number"),
        ("data=3", "data", "expected a section"),
        ("recovery.mode=step", "recovery.mode", "one of sibling, prompt_group or cursor_only"),
        ("logger.progress=loud", "logger.progress", "expected one of auto, bar, lines or none"),
    ],
)
def test_wrong_types_are_refused(override, field, fragment):
    err = problems(override)
    assert err.field == field
    assert f"`{field}`: " in str(err) and fragment in str(err)


@pytest.mark.parametrize(
    "override, field, fragment",
    [
        ("rollout.group_size=0", "rollout.group_size", "expected a value >= 1; found 0"),
        ("engine.infra_fail_rate=1.5", "engine.infra_fail_rate", "<= 1.0; found 1.5"),
        ("data.epochs=0", "data.epochs", ">= 1; found 0"),
        ("train.total_steps=0", "train.total_steps", ">= 1"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last", ">= 1"),
        ("eval.every_steps=-1", "eval.every_steps", ">= 0"),
        ("eval.num_samples=-1", "eval.num_samples", ">= 0"),
        ("sampler.max_lookahead_versions=-1", "sampler.max_lookahead_versions", ">= 0"),
        ("rollout.min_step_batch_fraction=0", "rollout.min_step_batch_fraction", "> 0.0"),
        ("rollout.spare_prompts=-1", "rollout.spare_prompts", ">= 0"),
    ],
)
def test_out_of_range_values_are_refused(override, field, fragment):
    err = problems(override)
    assert err.field == field and fragment in str(err)


def test_out_of_range_inside_a_variant_names_the_path_without_the_tag():
    err = problems("engine.name=torch", "engine.top_p=0", "trainer.name=torch")
    assert err.field == "engine.top_p" and "expected a value > 0.0; found 0" in str(err)
    err = problems("trainer.name=torch", "trainer.betas=[0.9, 1.0]", "engine.name=torch")
    assert err.field == "trainer.betas[1]" and "< 1.0" in str(err)


@pytest.mark.parametrize("section", ["engine", "trainer"])
def test_hf_without_model_path_is_refused(section):
    other = "trainer" if section == "engine" else "engine"
    err = problems(f"{section}.name=hf", f"{other}.name=hf", f"{other}.model_path=/m")
    assert err.field == f"{section}.model_path"
    assert f"`{section}.model_path` is required" in str(err)


def test_vllm_without_model_path_is_refused():
    assert problems("engine.name=vllm", "trainer.name=hf", "trainer.model_path=/m").field == "engine.model_path"


def test_bad_variant_name_lists_the_valid_names():
    err = problems("engine.name=tpu")
    assert err.field == "engine.name"
    assert '`engine.name` must be one of toy, torch, hf, vllm, remote; found "tpu"' in str(err)
    err = problems("trainer.name=vllm")
    assert "`trainer.name` must be one of toy, torch, hf" in str(err)


def test_override_without_equals_is_refused():
    err = problems("train.total_steps")
    assert "override `train.total_steps` has no `=`" in str(err)


@pytest.mark.parametrize("bad", ["=3", "train..total_steps=3", ".seed=1"])
def test_override_with_an_empty_key_is_refused(bad):
    assert "has an empty key" in str(problems(bad))


def test_override_through_a_scalar_is_refused(tmp_path):
    err = problems("seed.value=3", path=write(tmp_path, "seed: 0\n"))
    assert err.field == "seed" and "`seed` is 0, not a section" in str(err)
    # not in the file: the override builds a section, which is the wrong type for `seed`
    err = problems("seed.value=3")
    assert err.field == "seed" and "`seed`: expected an integer; found {" in str(err)


def test_override_with_unparseable_value_is_refused():
    err = problems("trainer.betas=[0.9,")
    assert "override `trainer.betas=[0.9,`: the value is not valid YAML" in str(err)


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert info.value.path == str(missing)
    assert f"config file {missing} does not exist" in str(info.value)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "seed: 1\ntrain:\n  total_steps: 3\n  num_prompts_per_step: [8\nx: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert err.path == str(path)
    assert f"config file {path} is not valid YAML at line 5" in str(err)


def test_yaml_duplicate_key_is_refused_with_both_lines(tmp_path):
    path = write(tmp_path, "seed: 1\ntrain:\n  total_steps: 3\n  total_steps: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "at line 4" in str(info.value) and "first defined on line 3" in str(info.value)


def test_yaml_that_is_not_a_mapping_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(write(tmp_path, "- seed\n- 3\n"))


def test_empty_yaml_means_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing\n")) == Config()


def test_many_problems_are_all_reported_in_one_error(tmp_path):
    path = write(
        tmp_path,
        "sed: 1\n"
        "deterministic: true\n"
        "engine:\n  name: torch\n  temprature: 0.5\n"
        "rollout:\n  group_size: 0\n  on_dropped_prompt: shrink\n"
        "sampler:\n  name: weight_fifo\n",
    )
    err = problems("train.total_steps=zero", "checkpoint", "trainer.name=hf", path=path)
    text = str(err)
    expected = [
        "override `checkpoint` has no `=`",
        "unknown key `sed`; did you mean `seed`?",
        "unknown key `engine.temprature`; did you mean `engine.temperature`?",
        "`rollout.group_size`: expected a value >= 1; found 0",
        '`train.total_steps`: expected an integer; found "zero"',
        "`trainer.model_path` is required",
        "`deterministic: true` needs `sampler.name: in_order`; found `weight_fifo`",
        "`engine.name: torch` needs `trainer.name: torch or custom`; found `hf`",
    ]
    for fragment in expected:
        assert fragment in text, fragment
    assert text.startswith(f"8 problems in config file {path} with overrides")
    assert set(err.field.split(", ")) == {
        "checkpoint",
        "sed",
        "engine.temprature",
        "rollout.group_size",
        "train.total_steps",
        "trainer.model_path",
        "sampler.name",
        "trainer.name",
    }


# ------------------------------------------------------------------ cross-field rules


def test_deterministic_requires_in_order():
    err = problems("deterministic=true", "rollout.on_dropped_prompt=shrink", "sampler.name=weight_fifo")
    assert err.field == "sampler.name"
    assert "`deterministic: true` needs `sampler.name: in_order`" in str(err)
    assert problems("deterministic=true", "rollout.on_dropped_prompt=shrink", "sampler.name=windowed").field == "sampler.name"
    cfg = load_config(None, ["deterministic=true", "rollout.on_dropped_prompt=shrink", "sampler.name=in_order"])
    assert cfg.deterministic and cfg.sampler.name == "in_order"
    # without deterministic, any sampler is fine
    assert load_config(None, ["sampler.name=weight_fifo"]).sampler.name == "weight_fifo"


def test_deterministic_refuses_replacement_of_dropped_prompts():
    err = problems("deterministic=true")
    assert err.field == "rollout.on_dropped_prompt"
    assert "needs `rollout.on_dropped_prompt: shrink`" in str(err)


def test_deterministic_refuses_in_flight_weight_updates():
    err = problems(
        "deterministic=true", "rollout.on_dropped_prompt=shrink", "engine.name=torch",
        "engine.update_weights_in_flight=true", "trainer.name=torch",
    )
    assert err.field == "engine.update_weights_in_flight"
    cfg = load_config(None, ["engine.name=torch", "engine.update_weights_in_flight=true", "trainer.name=torch"])
    assert cfg.engine.update_weights_in_flight


def test_cross_field_rule_also_guards_direct_construction():
    with pytest.raises(ConfigError, match="needs `sampler.name: in_order`"):
        Config(deterministic=True, sampler=SamplerConfig(name="weight_fifo"))


def test_cross_field_rule_is_skipped_when_its_key_is_already_reported():
    err = problems("deterministic=true", "rollout.on_dropped_prompt=shrink", "sampler.name=fifo")
    assert err.field == "sampler.name"
    assert str(err).startswith("1 problem in")


def test_backoff_max_below_backoff_is_refused():
    err = problems("rollout.backoff_ms=100", "rollout.backoff_max_ms=50")
    assert err.field == "rollout.backoff_max_ms"
    assert load_config(None, ["rollout.backoff_ms=100", "rollout.backoff_max_ms=100"])


def test_torch_model_heads_must_divide_width():
    err = problems("trainer.name=torch", "trainer.model.n_embd=130", "engine.name=torch")
    assert err.field == "trainer.model.n_embd" and "multiple of `trainer.model.n_head`" in str(err)


# ----------------------------------------------------------------------------- semantic


def _leaves_of_every_variant() -> set[str]:
    trees = [
        Config(engine=engine, trainer=trainer).to_dict()
        for engine, trainer in (
            (ToyEngineConfig(), ToyTrainerConfig()),
            (TorchEngineConfig(), TorchTrainerConfig()),
            (HFEngineConfig(model_path="m"), HFTrainerConfig(model_path="m")),
            (VLLMEngineConfig(model_path="m"), HFTrainerConfig(model_path="m")),
        )
    ]
    return {path for tree in trees for path in flatten(tree)} | {"trainer.model_path"}


def test_every_key_is_classified_semantic_or_not():
    """A new key must be put in `_SEMANTIC` or `_NOT_SEMANTIC` on purpose."""
    from rollkeep.config import semantic_keys as config

    for path in _leaves_of_every_variant():
        sem = any(path == p or path.startswith(p + ".") for p in config._SEMANTIC)
        non = any(path == p or path.startswith(p + ".") for p in config._NOT_SEMANTIC)
        assert sem or non, f"{path} is in neither list"


@pytest.mark.parametrize(
    "path",
    [
        "seed",
        "deterministic",
        "data.path",
        "data.epochs",
        "data.generated.n_rows",
        "engine.name",
        "engine.temperature",
        "engine.top_p",
        "engine.max_new_tokens",
        "engine.completion_tokens",
        "engine.model_path",
        "trainer.name",
        "trainer.lr",
        "trainer.betas",
        "trainer.model.n_layer",
        "trainer.model_path",
        "rollout.group_size",
        "train.num_prompts_per_step",
        "sampler.name",
        "sampler.max_staleness_versions",
        "warmup.sft_steps",
    ],
)
def test_semantic_keys(path):
    assert is_semantic(path)


@pytest.mark.parametrize(
    "path",
    [
        "run_dir",
        "train.total_steps",
        "checkpoint.every_steps",
        "recovery.mode",
        "checkpoint.keep_last",
        "max_inflight_prompts",
        "max_buffered_rollouts",
        "eval.every_steps",
        "eval.num_samples",
        "logger.progress",
        "rollout.max_infra_attempts",
        "rollout.backoff_ms",
        "engine.latency_ms",
        "engine.infra_fail_rate",
        "engine.max_batch_size",
        "engine.gpu_memory_utilization",
        "trainer.step_sleep_ms",
        "trainer.micro_batch_size",
    ],
)
def test_non_semantic_keys(path):
    assert not is_semantic(path)


@pytest.mark.parametrize(
    "change",
    [
        "train.total_steps=40",
        "engine.latency_ms=50",
        "engine.infra_fail_rate=0.5",
        "checkpoint.every_steps=2",
        "run_dir=elsewhere",
        "max_inflight_prompts=4",
        "eval.every_steps=0",
        "eval.num_samples=0",
        "logger.tensorboard=true",
        "rollout.max_infra_attempts=9",
        "trainer.step_sleep_ms=3",
    ],
)
def test_semantic_ignores_operational_changes(change):
    assert semantic(load_config(None, [change])) == semantic(Config())


@pytest.mark.parametrize(
    "change, path",
    [
        ("rollout.group_size=8", "rollout.group_size"),
        ("seed=1", "seed"),
        ("data.generated.n_rows=64", "data.generated.n_rows"),
        ("train.num_prompts_per_step=4", "train.num_prompts_per_step"),
        ("sampler.max_lookahead_versions=2", "sampler.max_lookahead_versions"),
        ("engine.completion_tokens=3", "engine.completion_tokens"),
        ("warmup.sft_steps=5", "warmup.sft_steps"),
    ],
)
def test_semantic_sees_changes_that_change_training(change, path):
    before, after = semantic(Config()), semantic(load_config(None, [change]))
    assert [d[0] for d in diff(before, after)] == [path]


def test_semantic_of_torch_backends_keeps_sampling_and_optimizer_only():
    cfg = load_config(
        None,
        [
            "engine.name=torch",
            "engine.max_batch_size=3",
            "trainer.name=torch",
            "trainer.micro_batch_size=2",
        ],
    )
    sem = semantic(cfg)
    assert sem["engine"] == {"name": "torch", "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}
    assert "micro_batch_size" not in sem["trainer"] and sem["trainer"]["lr"] == 3e-4
    assert sem["trainer"]["model"]["n_embd"] == 128
    other = load_config(None, ["engine.name=torch", "trainer.name=torch"])
    assert semantic(other) == sem


# ------------------------------------------------------------- GRPO options (issue 15)

TORCH = ["engine.name=torch", "trainer.name=torch"]


@pytest.mark.parametrize(
    "change, path",
    [
        ("trainer.loss_type=grpo", "trainer.loss_type"),
        ("trainer.dual_clip=3.0", "trainer.dual_clip"),
        ("trainer.scale_rewards=group", "trainer.scale_rewards"),
    ],
)
def test_grpo_options_are_semantic(change, path):
    before, after = semantic(load_config(None, TORCH)), semantic(load_config(None, [*TORCH, change]))
    assert [d[0] for d in diff(before, after)] == [path]
    assert is_semantic(path)


def test_scale_rewards_is_a_semantic_key_of_every_trainer():
    # Advantages are computed at finalize and stored in the ledger, whatever the trainer.
    assert Config().trainer.scale_rewards == "group_population"
    before, after = semantic(Config()), semantic(load_config(None, ["trainer.scale_rewards=none"]))
    assert [d[0] for d in diff(before, after)] == ["trainer.scale_rewards"]


def test_micro_batch_size_is_semantic_under_bnpo_only():
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        over = [*TORCH, f"trainer.loss_type={loss_type}"]
        assert semantic(load_config(None, over)) == semantic(
            load_config(None, [*over, "trainer.micro_batch_size=2"]))
    bnpo = [*TORCH, "trainer.loss_type=bnpo"]
    before = semantic(load_config(None, bnpo))
    after = semantic(load_config(None, [*bnpo, "trainer.micro_batch_size=2"]))
    assert before["trainer"]["micro_batch_size"] == 64
    assert [d[0] for d in diff(before, after)] == ["trainer.micro_batch_size"]
    # Switching to bnpo is itself refused on resume (loss_type differs).
    assert "trainer.loss_type" in [d[0] for d in diff(semantic(load_config(None, TORCH)), before)]


def test_grpo_option_values_are_checked():
    err = problems(*TORCH, "trainer.loss_type=token_mean", "trainer.dual_clip=1.0",
                   "trainer.scale_rewards=group_sample")
    text = str(err)
    assert "`trainer.loss_type`: expected one of dapo, grpo, dr_grpo or bnpo" in text
    assert "`trainer.dual_clip`: expected a value > 1.0" in text
    assert "`trainer.scale_rewards`: expected one of group_population, group, batch or none" in text
    assert load_config(None, [*TORCH, "trainer.dual_clip=null"]).trainer.dual_clip is None


# ------------------------------------------------------------ switching backends by override


def test_switching_the_toy_config_to_torch_by_override_keeps_what_fits(capsys):
    """Regression: `rollkeep train configs/toy.yaml engine.name=torch trainer.name=torch`
    gave four "unknown key" errors from the toy sections of the file."""
    warnings: list[str] = []
    cfg = load_config(REPO / "configs" / "toy.yaml", ["engine.name=torch", "trainer.name=torch"],
                      warn=warnings.append)
    assert cfg.engine == TorchEngineConfig()  # the torch defaults: toy.yaml has no torch key
    assert isinstance(cfg.trainer, TorchTrainerConfig)
    assert cfg.train.total_steps == 30 and cfg.rollout.group_size == 4  # the rest of the file
    (line,) = warnings
    for key in ("engine.latency_ms", "engine.latency_jitter_ms", "engine.infra_fail_rate",
                "engine.data_fail_rate"):
        assert f"`{key}`" in line
    assert "engine.name=torch" in line and "toy.yaml" in line
    # the default sink is one `warning:` line on stderr
    load_config(REPO / "configs" / "toy.yaml", ["engine.name=torch", "trainer.name=torch"])
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and err.count("\n") == 1


def test_a_switched_section_keeps_the_file_keys_the_new_backend_accepts(tmp_path):
    path = write(tmp_path, "engine:\n  name: torch\n  temperature: 0.7\n  max_new_tokens: 5\n"
                           "  max_batch_size: 8\n  update_weights_in_flight: true\n"
                           "trainer:\n  name: torch\n  lr: 0.01\n  model:\n    n_layer: 3\n"
                           "  scale_rewards: group\n")
    warnings: list[str] = []
    cfg = load_config(path, ["engine.name=hf", "engine.model_path=/m", "trainer.name=hf",
                             "trainer.model_path=/m"], warn=warnings.append)
    assert cfg.engine == HFEngineConfig(model_path="/m", temperature=0.7, max_new_tokens=5, max_batch_size=8)
    assert cfg.trainer == HFTrainerConfig(model_path="/m", lr=0.01, scale_rewards="group")
    assert len(warnings) == 2
    assert "drops the file's `engine.update_weights_in_flight` (" in warnings[0]
    assert "`trainer.model`" in warnings[1] and "kept `trainer.lr`, `trainer.scale_rewards`" in warnings[1]


def test_an_override_of_the_same_backend_or_a_bad_name_switches_nothing(tmp_path):
    path = write(tmp_path, "engine:\n  name: toy\n  latency_ms: 2\n")
    warnings: list[str] = []
    assert load_config(path, ["engine.name=toy"], warn=warnings.append).engine.latency_ms == 2
    err = problems("engine.name=nope", path=path)
    assert "`engine.name` must be one of" in str(err)
    assert warnings == []


def test_a_multi_problem_config_error_prints_one_problem_per_line(tmp_path, capsys):
    from rollkeep.cli import main

    code = main(["train", str(REPO / "configs" / "toy.yaml"), "seed=-1", "train.total_steps=0",
                 "engine.nope=1", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    lines = err.splitlines()
    assert lines[0].startswith("error: 3 problems in config file") and lines[0].endswith(":")
    assert [line[:4] for line in lines[1:4]] == ["  - "] * 3
    assert lines[4].startswith("Nothing was run.") and len(lines) == 5
    assert all(len(line) < 400 for line in lines[1:4])
    assert not (tmp_path / "run").exists()

"""Optimizer backends, chosen by `trainer.name`: toy, torch, hf, or custom (the user's,
built by `trainer.factory`)."""

from __future__ import annotations

import inspect
from typing import Any

from ..core.errors import ConfigError
from .base import Batch, Trainer, TrainerSnapshot, TrainGroup

#: What `trainer.factory` must build (rollkeep.trainers.base.Trainer).
TRAINER_METHODS = ("train_step", "snapshot", "load", "weights", "weights_sha256")

__all__ = ["Batch", "TrainGroup", "Trainer", "TrainerSnapshot", "make_trainer"]


def make_trainer(cfg: Any, **context: Any) -> Trainer:
    """Build the trainer named by `cfg.name` from its own config section only. In
    `context`, for `world_size` > 1: `log_dir` (where the ranks write their logs) and `ray`
    (a `ranks.RayPlacement`: the ranks as Ray actors)."""
    log_dir = context.pop("log_dir", None)
    ray = context.pop("ray", None)
    if cfg.name == "toy":
        from .toy import ToyTrainer

        return ToyTrainer(step_sleep_ms=cfg.step_sleep_ms)
    if cfg.name in ("torch", "hf"):
        if cfg.name == "torch":
            from .grpo import TorchTrainer

            trainer: Trainer = TorchTrainer(cfg, **context)
        else:
            from .hf import HFTrainer

            trainer = HFTrainer(cfg, **context)
        return trainer if cfg.world_size == 1 else _sharded(cfg, trainer, context, log_dir, ray)
    if cfg.name == "custom":
        return _custom(cfg, context)
    raise ValueError(f"unknown trainer {cfg.name!r}")  # the config model already refuses it


def _custom(cfg: Any, context: dict[str, Any]) -> Trainer:
    """`trainer.factory(**context, scale_rewards=, **trainer.kwargs)`, checked: an import
    problem, a missing or uncallable attribute, arguments it does not take, a constructor
    that raises, or a result that is not a trainer is a ConfigError (exit 2)."""
    from ..tasks.custom import find

    field, spec = "trainer.factory", cfg.factory
    factory, _ = find(spec, field=field, what="trainer class or factory")
    # scale_rewards: under `batch` the ledger holds centred advantages the trainer divides.
    kwargs = {**context, "scale_rewards": cfg.scale_rewards, **cfg.kwargs}
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(
            f"{field} {spec!r} cannot be called with these arguments", field="trainer.kwargs",
            expected=f"it to accept {sorted(kwargs)} (rollkeep's, then trainer.kwargs)", found=str(e),
            remedy="change trainer.kwargs or the factory's parameters") from None
    except ValueError:
        pass  # no signature to check (a builtin): the call below tries it
    try:
        trainer = factory(**kwargs)
    except Exception as e:
        raise ConfigError(
            f"{field} {spec!r}: building the trainer failed", field=field,
            expected=f"{spec}(...) to return a trainer", found=f"{type(e).__name__}: {e}"[:300],
            remedy="fix the trainer's constructor or trainer.kwargs") from None
    missing = [m for m in TRAINER_METHODS if not callable(getattr(trainer, m, None))]
    if missing:
        raise ConfigError(
            f"{field} {spec!r} does not build a trainer", field=field,
            expected=f"an object with {', '.join(TRAINER_METHODS)} (rollkeep.trainers.base.Trainer)",
            found=f"no {', '.join(missing)} on {type(trainer).__name__}",
            remedy="see docs/library.md, 'Bring your own trainer', for the protocol")
    return trainer


def _sharded(cfg: Any, local: Any, context: dict[str, Any], log_dir: Any, ray: Any) -> Trainer:
    """`trainer.world_size` ranks (`ranks.ShardedTrainer`) around the one-process trainer
    `local`, which keeps the controller's whole copy of the model; `ray`: a
    `ranks.RayPlacement` (the ranks as Ray actors), None for child processes."""
    import dataclasses

    from .ranks import ShardedTrainer

    local.model.to("cpu")  # the controller's copy: the devices are the ranks'
    spec = {"trainer": cfg.model_dump(mode="json"), "seed": context["seed"], "temperature": context["temperature"],
            "max_completion_length": context.get("max_completion_length")}
    if cfg.name == "torch":
        spec["gpt"] = dataclasses.asdict(local.model.cfg)
    return ShardedTrainer(local, world_size=cfg.world_size, step_timeout_s=cfg.step_timeout_s, spec=spec,
                          log_dir=log_dir, ray=ray)

"""`rollkeep train [CONFIG] [key=value ...]`: run or resume the main job."""

from __future__ import annotations

import argparse
import gc

HELP = """\
Run the job CONFIG describes (default: configs/arith.yaml, the built-in arithmetic GRPO job
on a tiny GPT). If RUN_DIR/checkpoints/LATEST exists, the run resumes from it after the full
restore chain; a semantic config change is refused unless named with
--allow-config-change. A run directory whose checkpoints exist but whose LATEST is missing
is refused (never a silent fresh start): resume on purpose with --resume-from.

examples:
  rollkeep train                                   # the built-in job
  rollkeep train configs/toy.yaml                  # toy engine + toy trainer, seconds
  rollkeep train configs/toy.yaml train.total_steps=50 sampler.name=windowed
  rollkeep train configs/toy.yaml engine.name=torch trainer.name=torch   # switch backend:
                                                   # the file's toy-only keys are dropped, with a warning
  rollkeep train configs/toy.yaml 'reward.fn=my_rewards:score'   # your reward function
  rollkeep train configs/hf.yaml                   # the hf backend on models/arith (rollkeep export)
  rollkeep train configs/toy.yaml --allow-config-change train.num_prompts_per_step \\
      train.num_prompts_per_step=16
  rollkeep train configs/toy.yaml --resume-from step_000010   # newer ones move aside
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="run or resume a training job",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="YAML config file (optional)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    p.add_argument(
        "--allow-config-change",
        action="append",
        default=[],
        metavar="KEY",
        help="accept a change of this semantic key on resume (repeatable)",
    )
    p.add_argument(
        "--resume-from",
        metavar="NAME",
        help="resume from this checkpoint of RUN_DIR/checkpoints (e.g. step_000010) instead of "
        "LATEST; newer checkpoints are moved aside into checkpoints/abandoned-<time>/, "
        "nothing is deleted",
    )
    p.add_argument(
        "--allow-dataset-change",
        action="store_true",
        help="resume although rows no in-flight or buffered prompt reads were edited (those prompts' rows are still checked one by one)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    # Start-up allocates long-lived objects only (modules, torch's operator tables, the
    # config): the cyclic collector would walk them again and again for nothing, each
    # full pass over torch's objects costing ~0.1 s. So it is paused while the heavy
    # imports run, and what they made is then frozen out of every later collection
    # (`gc.freeze`); it collects as usual from there on, the run itself included.
    collecting = gc.isenabled()
    gc.disable()
    try:
        from ..config import load_config
        from ..controller import train

        config, overrides = args.config, list(args.overrides)
        if config is not None and "=" in config:  # `rollkeep train key=value` without a file
            overrides.insert(0, config)
            config = None
        if config is None:  # the main job: the packaged configs/arith.yaml
            from importlib.resources import files

            config = str(files("rollkeep") / "configs" / "arith.yaml")
        cfg = load_config(config, overrides)
        _import_backends(cfg)
    finally:
        gc.freeze()
        if collecting:
            gc.enable()
    result = train(
        cfg,
        allow_config_change=tuple(args.allow_config_change),
        allow_dataset_change=args.allow_dataset_change,
        resume_from=args.resume_from,
        config_file=config,
    )
    print(result.summary())
    return result.exit_code


def _import_backends(cfg) -> None:
    """Import now what building the run will (torch, the built-in model's modules)."""
    names = {cfg.engine.name, cfg.trainer.name}
    if names & {"torch", "hf"}:
        import torch  # noqa: F401
    if "torch" in names:
        from ..engines import torch_gpt  # noqa: F401
        from ..models import sampling  # noqa: F401
        from ..trainers import grpo  # noqa: F401

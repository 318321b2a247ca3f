"""What `rollkeep train` says before it starts: the job in a few plain lines (the config
file, the run directory, the data and the held-out set, the model, the steps, where the
outputs go), and on a resume one line that says where it picks up and whether anything was
lost, before the restore's detailed line (`startup.restore_banner`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import Config
from ..version import rollkeep_version


def start_banner(cfg: Config, *, config_file: str | None, dataset_rows: int | None, eval_rows: int | None,
                 evaluates: bool, trainer: Any, resume: str | None) -> list[str]:
    """The banner's lines. `resume`: the checkpoint the run restores (None: a fresh start,
    or a run directory with only a journal, which the restore then reports)."""
    run_dir = Path(cfg.run_dir)
    if resume is not None:
        state = f"resumes from checkpoint {resume}"
    elif (run_dir / "trace.jsonl").exists() or (run_dir / "journal").exists():
        state = "resumes from what it holds"
    else:
        state = "new"
    source = cfg.data.path if cfg.data.path is not None else f"built-in {cfg.data.generated.task}"
    data = f"{_count(dataset_rows)} rows ({source}), " + (f"{cfg.data.epochs} epoch(s)" if cfg.data.epochs else "no epoch limit")
    if evaluates and eval_rows:
        held = cfg.eval.path if cfg.eval.path is not None else "held out"
        data += f"; eval {eval_rows} rows ({held}) every {cfg.eval.every_steps} steps"
    else:
        data += "; no eval"
    engine = cfg.engine.name + (f" x{cfg.engine.replicas} on ray" if cfg.engine.replicas > 1 else "")
    r = cfg.rollout
    outputs = ["metrics.jsonl", *(["samples.jsonl"] if evaluates and eval_rows else []), "checkpoints/"]
    return [
        f"rollkeep {rollkeep_version()} train " + (config_file or "(defaults)"),
        f"  run_dir     {run_dir} ({state})",
        f"  data        {data}",
        f"  model       {model_text(trainer, cfg.trainer.name)}; engine {engine}, trainer {cfg.trainer.name}",
        f"  steps       {cfg.train.total_steps} x {cfg.train.num_prompts_per_step} prompts x "
        f"{r.group_size} completions; checkpoint every {cfg.checkpoint.every_steps}",
        f"  outputs     {run_dir}/ (" + ", ".join(outputs) + ")",
    ]


def model_text(trainer: Any, name: str) -> str:
    """`0.41M parameters`, or what the trainer is when it holds no model in this process."""
    model = getattr(trainer, "model", None) or getattr(getattr(trainer, "local", None), "model", None)
    params = getattr(model, "parameters", None)
    if params is None:
        return "no weights (a fake trainer)" if name == "toy" else f"a {name} trainer's model"
    return f"{_count(sum(p.numel() for p in params()))} parameters"


def _count(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= 1_000_000_000:
        return f"{n / 1e9:.2f}B"
    if n >= 100_000:
        return f"{n / 1e6:.2f}M"
    return str(n)


def resume_line(*, step: int, total_steps: int, source: str, steps_redone: list[int], groups_lost: int,
                regenerated: int = 0) -> str:
    """The plain line a resumed run prints first: where it picks up, and what was lost.
    `regenerated`: unfinished completions sent out again (work redone, nothing lost)."""
    line = f"resuming at step {step} of {total_steps} from {source}"
    if steps_redone:
        first, last = steps_redone
        span = f"step {first}" if first == last else f"steps {first}-{last}"
        line += f"; {span}: trained after it, lost with the process, trained again"
    if groups_lost:
        return line + f"; {groups_lost} prompt group(s) in flight were LOST (recovery.mode=cursor_only)"
    line += "; no prompt lost" if steps_redone else "; nothing lost"
    return line + (f" ({regenerated} unfinished completion(s) are generated again)" if regenerated else "")

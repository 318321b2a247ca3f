"""The single controller (the scheduler driven by the runner) and the entry point of
`rollkeep train`."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import Config, check_allowed_changes
from ..core.checkpoint.store import CheckpointStore
from ..core.errors import FilesystemError, RollkeepError
from ..core.restore.start import start_point
from ..progress import duration
from ..tasks import use_rewards
from ..trace import new_run_id, published_in_trace
from .banner import start_banner
from .build import Parts, build
from .episodes import bounded
from .metrics import MetricsLog, for_run
from .rundir import RunDir
from .runner import Runner, RunResult
from .startup import NothingToDo
from .summary import with_outputs
from .warmup import run_warmup

__all__ = ["RunResult", "Runner", "train"]


def train(
    cfg: Config,
    *,
    allow_config_change: tuple[str, ...] = (),
    allow_dataset_change: bool = False,
    resume_from: str | None = None,
    on_step: Callable[[int, dict[str, Any]], None] | None = None,
    config_file: str | None = None,
) -> RunResult:
    """Run (or resume) the job `cfg` describes until `train.total_steps`, the end of the
    data, or SIGINT/SIGTERM. Resumes from RUN_DIR/checkpoints/LATEST when it exists (or
    from `resume_from`, a checkpoint name, on purpose); a supervised warm start
    (`warmup.sft_steps`) runs first, as its own checkpointed phase.

    Errors: every `RollkeepError` propagates as itself; a filesystem error anywhere is a
    `FilesystemError` (the CLI's exit 5); user code that asked the process to stop
    (SystemExit, KeyboardInterrupt) or hangs too often stops the run with its final
    checkpoint, then raises `usercode.UserCodeError` (exit 2); anything else is a bug and
    propagates unchanged. `config_file`: the file `cfg` was read from, for the start-up
    banner.
    """
    check_allowed_changes(allow_config_change)
    try:
        parts = build(cfg)  # installs the run's reward.fn (rollkeep.tasks.use_rewards)
        try:
            for note in parts.notes:  # what the config asks for but will not happen, said once
                print(f"warning: {note}", file=sys.stderr, flush=True)
            with for_run(cfg):  # the metrics log of this run reads its logger settings here
                return _run(cfg, parts, allow_config_change=allow_config_change,
                            allow_dataset_change=allow_dataset_change, resume_from=resume_from, on_step=on_step,
                            config_file=config_file)
        finally:
            close = getattr(parts.trainer, "close", None)  # trainer ranks (trainer.world_size > 1) stop
            if close is not None:
                close()
    finally:
        use_rewards(None)  # the next run in this process starts from the built-in rewards


def _run(cfg: Config, parts: Parts, *, allow_config_change: tuple[str, ...], allow_dataset_change: bool,
         resume_from: str | None, on_step: Callable[[int, dict[str, Any]], None] | None,
         config_file: str | None = None) -> RunResult:
    run_dir = Path(cfg.run_dir)
    try:
        with RunDir(run_dir):  # held from before the warm start until the run has closed
            start = start_point(CheckpointStore(run_dir / "checkpoints"), resume_from,
                                published=lambda: published_in_trace(run_dir / "trace.jsonl"))
            if cfg.logger.progress != "none":
                print("\n".join(start_banner(cfg, config_file=config_file, dataset_rows=len(parts.dataset),
                                             eval_rows=None if parts.eval_rows is None else len(parts.eval_rows),
                                             evaluates=parts.evaluator is not None, trainer=parts.trainer,
                                             resume=start)), flush=True)
            runner = Runner(
                cfg,
                source=parts.source,
                engine=parts.engine,
                trainer=parts.trainer,
                resume=start,
                allow_config_change=allow_config_change,
                allow_dataset_change=allow_dataset_change,
                on_step=on_step,
                evaluator=parts.evaluator,
                env=parts.env,
            )
            warmup_seconds = 0.0
            if start is None:  # once RL has a checkpoint, the trainer state comes from it
                t0 = time.perf_counter()
                step, stopped_by = run_warmup(
                    cfg, dataset=parts.dataset, trainer=parts.trainer, tokenizer=parts.tokenizer,
                    make_env=None if parts.env is None else bounded(parts.env), chat=parts.chat,
                    log=lambda line: print(line, flush=True) if cfg.logger.progress != "none" else None,
                    # the run's metrics, W&B run included, under a run_id of the warm start's own
                    # (the trace, which names the RL phase's, opens only once RL starts)
                    metrics=lambda: MetricsLog(run_dir, new_run_id(), tensorboard=cfg.logger.tensorboard,
                                               logger=cfg.logger, config=cfg.to_dict()))
                warmup_seconds = time.perf_counter() - t0 if cfg.warmup.sft_steps else 0.0
                if stopped_by is not None:
                    return RunResult(step, parts.trainer.weights_sha256(), "signal", signal=stopped_by,
                                     checkpoint=f"warmup/checkpoints/step_{step}", phase="warmup",
                                     details=(f"  warm start  {step} of {cfg.warmup.sft_steps} steps; this "
                                              f"process ran it for {duration(warmup_seconds)}",))
            try:
                result = asyncio.run(runner.run(warmup_seconds=warmup_seconds))
            except BaseExceptionGroup as group:
                raise _primary(group) from group
            except NothingToDo as done:  # at train.total_steps already: nothing started, nothing written
                return AlreadyFinished(done.step, parts.trainer.weights_sha256(), "finished",
                                       checkpoint=runner.store.latest(), run_dir=str(done.run_dir))
            if runner.user_stop is not None:  # user code stopped it, after its final checkpoint: exit 2
                raise runner.user_stop.error(result.step, result.checkpoint)
            return with_outputs(result, str(run_dir), trainer=cfg.trainer.name)
    except OSError as e:
        raise FilesystemError.of(e, "running the job") from e


@dataclasses.dataclass(frozen=True)
class AlreadyFinished(RunResult):
    """The result of re-opening a run that reached train.total_steps: nothing ran (exit 0)."""

    run_dir: str = ""

    def summary(self) -> str:
        return (f"already finished at step {self.step}; nothing to do (weights_sha256 {self.weights_sha256}).\n"
                f"  to train longer, rerun with a larger train.total_steps; to start over, use a new "
                f"run_dir or remove {self.run_dir}")


def _primary(group: BaseExceptionGroup) -> BaseException:
    """The error a TaskGroup's group stands for: a rollkeep error first, then a filesystem
    error, then the first other error (a bug, raised with its own traceback)."""
    leaves = _leaves(group)
    for leaf in leaves:
        if isinstance(leaf, RollkeepError):
            return leaf
    for leaf in leaves:
        if isinstance(leaf, OSError):
            return FilesystemError.of(leaf, "running the job")
    others = [leaf for leaf in leaves if not isinstance(leaf, asyncio.CancelledError)]
    return others[0] if others else group


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out

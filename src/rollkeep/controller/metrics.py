"""Per-step metrics: `RUN_DIR/metrics.jsonl` always (one JSON object per line, with `t`,
`run_id` and `step`; every value but `run_id` a number), and, on request, the same numbers in

  - TensorBoard event files in `RUN_DIR/tensorboard` (`logger.tensorboard: true`, the `tb`
    extra: tensorboardX);
  - a Weights & Biases run (`logger.wandb: true`, the `wandb` extra), files under
    `RUN_DIR/wandb`. Offline with `WANDB_MODE=offline` (`wandb sync RUN_DIR/wandb/offline-run-*`
    uploads later). The W&B run id is kept in `RUN_DIR/wandb_run_id`, so a resumed run
    logs into the same W&B run. Every RL record carries `step` and W&B plots against it
    (`define_metric`), so the steps a resumed run does again after its checkpoint are
    logged again at their own step, not dropped as out of order. Closing the log ends
    the W&B run and wandb's session in this process (`wandb.teardown`), so what was logged
    is on disk when the run ends.

The warm start logs into the same file, on its own lines (`write_warmup`: `step` 0 and
`warmup/step`, plotted against `warmup/step`). Each evaluation's sample completions go to
`RUN_DIR/samples.jsonl` (`write_samples`), TensorBoard text and a W&B table, never to
`metrics.jsonl`.

Where the settings come from: `MetricsLog(..., logger=cfg.logger, config=cfg.to_dict())`,
or, when the caller passes only `tensorboard` (the run loop did, before W&B), the run that
`rollkeep.controller.train` declares for its duration with `for_run(cfg)`.
`check_logger(cfg.logger)` refuses a missing extra at start-up, before anything runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
import secrets
import string
import sys
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import ConfigError, ExternalError, UserInputError
from ..core.io.untrusted import end_torn_line, open_append, read_prefix

WANDB_ID_FILE = "wandb_run_id"
SAMPLES_FILE = "samples.jsonl"
WARMUP_PREFIX = "warmup/"
THROUGHPUT_WINDOW = 10  # committed steps `tokens_generated_per_s` is measured over
_WANDB_ID = re.compile(r"^[a-z0-9]{8,64}$")

# (logger settings, the resolved config as data) of the run in progress; see `for_run`.
_RUN: contextvars.ContextVar[tuple[Any, dict[str, Any]] | None] = contextvars.ContextVar(
    "rollkeep_metrics_run", default=None
)


@contextlib.contextmanager
def for_run(cfg: Any) -> Iterator[None]:
    """Declare `cfg`'s logger settings for the `MetricsLog` a run opens inside this block
    (also inside `asyncio.run` and worker threads, which copy the context)."""
    token = _RUN.set((cfg.logger, cfg.to_dict()))
    try:
        yield
    finally:
        _RUN.reset(token)


def check_logger(logger: Any, run_dir: str | Path) -> None:
    """Start-up check, before anything runs: the extras the logger settings need are
    installed, and a kept W&B run id is readable (exit 2 if not)."""
    if logger.tensorboard:
        _import_tensorboard()
    if logger.wandb:
        _import_wandb()
        _kept_wandb_id(Path(run_dir))


class MetricsLog:
    def __init__(
        self,
        run_dir: Path,
        run_id: str,
        *,
        tensorboard: bool,
        logger: Any = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.run_id = run_id
        self._tb = None
        self._wandb = None
        self._file = open_append(self.path)  # a FIFO or a symlink is refused, never waited on
        end_torn_line(self._file)
        if logger is None and (declared := _RUN.get()) is not None:
            logger, config = declared
        if tensorboard or (logger is not None and logger.tensorboard):
            # One event file per log, named by its run_id: two logs opened in the same second
            # (the warm start's, then the RL phase's) would otherwise write one file name.
            self._tb = _import_tensorboard()(str(Path(run_dir) / "tensorboard"), filename_suffix=f".{run_id}")
        if logger is not None and logger.wandb:
            self._wandb = _open_wandb(Path(run_dir), logger, dict(config or {}))
        self._samples = None  # RUN_DIR/samples.jsonl, opened by the first evaluation's samples
        self._wandb_warmup_keys: set[str] = set()

    def write(self, step: int, record: dict[str, Any]) -> None:
        self._append(self._file, {"t": time.time(), "run_id": self.run_id, "step": step, **record})
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({"step": step, **numbers})

    def write_warmup(self, warmup_step: int, record: Mapping[str, float]) -> None:
        """One warm-start line: `step` 0 (no RL step exists yet; readers that key on `step`
        keep working), `warmup/step` and the record's `warmup/*` numbers. TensorBoard and
        W&B plot them against `warmup/step`."""
        if not all(k.startswith(WARMUP_PREFIX) for k in record):
            raise ValueError(f"warm-start keys start with {WARMUP_PREFIX!r}: {sorted(record)}")
        self._append(self._file, {"t": time.time(), "run_id": self.run_id, "step": 0,
                                  "warmup/step": warmup_step, **record})
        if self._tb is not None:
            for key, value in record.items():
                self._tb.add_scalar(key, value, warmup_step)
            self._tb.flush()
        if self._wandb is not None:
            # By name, not only by the `warmup/*` glob: wandb picks any one of the globs a
            # key matches, and `*` (against `step`) matches these too.
            for key in sorted(record.keys() - self._wandb_warmup_keys):
                self._wandb.define_metric(key, step_metric="warmup/step")
                self._wandb_warmup_keys.add(key)
            self._wandb.log({"warmup/step": warmup_step, **record})

    def write_eval(self, step: int, metrics: Mapping[str, float], samples: Sequence[Mapping[str, Any]],
                   seconds: float) -> None:
        """A held-out evaluation at `step`: its metrics with `eval/seconds`, its samples."""
        self.write(step, {**metrics, "eval/seconds": seconds})
        self.write_samples(step, samples)  # samples.jsonl: text stays out of metrics

    def write_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """An evaluation's sample completions (`prompt`, `completion`, `reward`, `answer`):
        one `samples.jsonl` line, the TensorBoard text `eval/samples` and the W&B table
        `eval/samples`, at `step`. The file is opened on first use, with the same care as
        metrics.jsonl (a FIFO or a symlink is refused)."""
        if not samples:
            return
        if self._samples is None:
            self._samples = open_append(self.path.with_name(SAMPLES_FILE))
            end_torn_line(self._samples)
        self._append(self._samples, {"t": time.time(), "run_id": self.run_id, "step": step,
                                     "samples": [dict(s) for s in samples]})
        if self._tb is not None:
            self._tb.add_text("eval/samples", samples_markdown(samples), step)
            self._tb.flush()
        if self._wandb is not None:
            columns = ["prompt", "completion", "reward", "answer"]
            table = _import_wandb().Table(columns=columns, data=[[s.get(c) for c in columns] for s in samples])
            self._wandb.log({"step": step, "eval/samples": table})

    @staticmethod
    def _append(file: Any, obj: dict[str, Any]) -> None:
        file.write((json.dumps(obj) + "\n").encode())
        file.flush()

    def close(self) -> None:
        try:
            self._file.close()
            if self._samples is not None:
                self._samples.close()
            if self._tb is not None:
                self._tb.close()
        finally:
            if self._wandb is not None:
                run, self._wandb = self._wandb, None
                try:
                    run.finish()
                finally:
                    # `finish` can return before wandb's service has written everything
                    # (offline: the run file under RUN_DIR/wandb); `teardown` waits for it,
                    # and wandb's atexit hook that would otherwise do it does not run in
                    # every setup.
                    teardown = getattr(sys.modules.get("wandb"), "teardown", None)
                    if teardown is not None:
                        teardown()


# ------------------------------------------------------------------------------ sinks


def _import_tensorboard() -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ConfigError(
            "logger.tensorboard is true but tensorboardX is not installed",
            field="logger.tensorboard",
            remedy="pip install 'rollkeep[tb]', or set logger.tensorboard=false",
        ) from None
    return SummaryWriter


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(
            "logger.wandb is true but wandb is not installed",
            field="logger.wandb",
            expected="the wandb package importable",
            found=f"ImportError: {e}",
            remedy="pip install 'rollkeep[wandb]', or set logger.wandb=false",
        ) from None
    return wandb


def _open_wandb(run_dir: Path, logger: Any, config: dict[str, Any]) -> Any:
    """Start (or, with `RUN_DIR/wandb_run_id`, continue) the run's W&B run."""
    wandb = _import_wandb()
    run_id = _kept_wandb_id(run_dir)
    if run_id is None:
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        id_path = run_dir / WANDB_ID_FILE
        tmp = id_path.with_name(f".{WANDB_ID_FILE}.tmp")
        tmp.write_text(run_id + "\n")
        os.replace(tmp, id_path)  # the id is there before anything is logged under it
    (run_dir / "wandb").mkdir(exist_ok=True)
    try:
        run = wandb.init(
            project=logger.wandb_project,
            name=logger.wandb_name or Path(run_dir).resolve().name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
        )
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        run.define_metric("warmup/step")  # the warm start's lines: see `write_warmup`
        run.define_metric("warmup/*", step_metric="warmup/step")
    except Exception as e:  # wandb's own errors: no network, no login, a bad project
        raise ExternalError(
            "Weights & Biases could not start the run's W&B run",
            field="logger.wandb",
            found=f"{type(e).__name__}: {e}",
            remedy="log in (`wandb login`), or log offline with WANDB_MODE=offline, or set "
            "logger.wandb=false; the run resumes from its checkpoint",
        ) from None
    return run


def _kept_wandb_id(run_dir: Path) -> str | None:
    """The W&B run id an earlier run of this run_dir kept, or None."""
    id_path = run_dir / WANDB_ID_FILE
    if not (id_path.exists() or id_path.is_symlink()):
        return None
    try:
        run_id = read_prefix(id_path, 100).decode("ascii", "replace").strip()
    except OSError as e:
        raise UserInputError(
            f"{id_path} cannot be read", path=str(id_path),
            expected="a regular file holding the run's W&B run id", found=e.strerror or str(e),
            remedy=f"remove {id_path} to log into a new W&B run",
        ) from None
    if not _WANDB_ID.match(run_id):
        raise UserInputError(
            f"{id_path} does not hold a W&B run id", path=str(id_path),
            expected="8 to 64 lowercase letters and digits, written by an earlier run",
            found=repr(run_id[:80]),
            remedy=f"remove {id_path} to log into a new W&B run",
        )
    return run_id


# ------------------------------------------------------------------------------ records


class Throughput:
    """Generation throughput: completion tokens sealed per second over the last `window`
    committed steps (`tokens_generated_per_s`), and since the RL phase of this process
    started (`tokens_generated_per_s_run`).

    Pure: the caller passes the time and the tokens sealed so far. The first mark is the
    start of the RL loop, so right after a (re)start the window holds the steps there are;
    a resumed run reads the same as a fresh one at the same rate (neither counts the warm
    start, the restore, or the tokens an earlier process sealed)."""

    def __init__(self, now: float, tokens: int = 0, *, window: int = THROUGHPUT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"the throughput window is at least one step, not {window}")
        self._start = (now, tokens)
        self._marks: deque[tuple[float, int]] = deque([self._start], maxlen=window + 1)

    def step(self, now: float, tokens: int) -> tuple[float, float]:
        """Mark a committed step: (tokens/s over the window, tokens/s since the start)."""
        self._marks.append((now, tokens))
        return _rate(self._marks[0], (now, tokens)), _rate(self._start, (now, tokens))


class ReplicaRates:
    """`cluster.backend: ray`: the replicas live, and per replica the attempts it finished
    and its tokens per second over the last step, from the engine pool's cumulative counts
    (`EnginePool.stats`). Pure, like `Throughput`: the caller passes the counts and the time."""

    def __init__(self) -> None:
        self._marks: list[tuple[int, int, int]] | None = None  # (attempts, tokens, failures) at the last step

    def step(self, stats: dict[str, Any], seconds: float) -> dict[str, Any]:
        per = [(*at, f) for at, f in zip(stats["per_replica"], stats.get("failures") or [0] * len(stats["per_replica"]),
                                         strict=True)]
        marks = self._marks or [(0, 0, 0)] * len(per)
        # server mode: the same per server, by its index in engine.servers
        kind = "server" if stats.get("servers") else "replica"
        out: dict[str, Any] = {f"engine/{kind}s_live": stats["live"], f"engine/{kind}s": stats["replicas"]}
        for i, ((attempts, tokens, failures), (a0, t0, f0)) in enumerate(zip(per, marks, strict=True)):
            out[f"{kind}/{i}/attempts"] = attempts - a0
            out[f"{kind}/{i}/tokens_per_s"] = (tokens - t0) / seconds if seconds > 0 else 0.0
            out[f"{kind}/{i}/failures"] = failures - f0
        self._marks = per
        return out


class StepMeter:
    """The clocks of the per-step metrics: a step's `step_seconds` and the throughput count
    from the start of the RL loop in this process (after the warm start and the restore)."""

    def __init__(self, now: float, tokens: int) -> None:
        self.start = self._last = now
        self._throughput, self._rates = Throughput(now, tokens), ReplicaRates()

    def record(self, batch: Any, metrics: dict[str, float], *, began: float, now: float, tokens: int,
               counts: dict[str, int], pool: dict[str, Any] | None = None) -> dict[str, Any]:
        """The step's `metrics.jsonl` record: trained from `began` to `now`, `tokens`
        sealed so far; `pool`: an engine pool's `stats()` (per-replica rates)."""
        record = step_record(batch, metrics, train_seconds=now - began, step_seconds=now - self._last,
                             generated_per_s=self._throughput.step(now, tokens), counts=counts)
        if pool is not None:
            record.update(self._rates.step(pool, now - self._last))
        self._last = now
        return record


def _rate(a: tuple[float, int], b: tuple[float, int]) -> float:
    return (b[1] - a[1]) / (b[0] - a[0]) if b[0] > a[0] else 0.0


def step_record(batch: Any, metrics: dict[str, float], *, train_seconds: float, step_seconds: float,
                generated_per_s: tuple[float, float], counts: dict[str, int]) -> dict[str, Any]:
    """One `metrics.jsonl` line for a committed step (the keys are listed in docs/metrics.md);
    `generated_per_s` is `Throughput.step`'s (windowed, since the start)."""
    rows = [r for g in batch.groups for r in g.rows]
    tokens = sum(r.tokens for r in rows)
    lengths = [r.tokens for r in rows]  # completion tokens per sibling
    trainer_version = batch.step - 1
    # Token-weighted over the model's tokens (an episode's environment tokens have no version).
    # A token newer than the trainer's weights can only be a kept token of a lost version,
    # claimed by a re-done step earlier than the killed process claimed it (weight_fifo,
    # windowed; docs/design.md §5.1): its age counts as 0, never negative.
    model = [r.versions[r.versions >= 0] for r in rows]
    n_model = sum(len(v) for v in model)
    age = float(sum(int(np.maximum(trainer_version - v, 0).sum()) for v in model) / n_model) if n_model else 0.0
    return {
        "weight_version": batch.step,
        "groups": len(batch.groups),
        "tokens": tokens,
        "reward_mean": float(np.mean([r.reward for r in rows])) if rows else 0.0,
        "batch_age": age,
        "response_length/mean": float(np.mean(lengths)) if rows else 0.0,
        "response_length/max": max(lengths, default=0),
        "response_length/min": min(lengths, default=0),
        "response_length/clip_ratio": (sum(r.finish_reason == "length" for r in rows) / len(rows)
                                       if rows else 0.0),
        "train_seconds": train_seconds,
        "step_seconds": step_seconds,
        "tokens_generated_per_s": generated_per_s[0],
        "tokens_generated_per_s_run": generated_per_s[1],
        # A trainer's metric with a namespace of its own (`off_policy/...`) keeps it.
        **{(k if "/" in k else f"trainer/{k}"): float(v) for k, v in metrics.items()},
        **{f"custody/{k}": v for k, v in counts.items()},
    }


def samples_markdown(samples: Sequence[Mapping[str, Any]]) -> str:
    """An evaluation's samples as a Markdown table (TensorBoard's text plugin renders it)."""

    def cell(value: Any) -> str:
        text = "" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n") or " "

    columns = ["prompt", "completion", "reward", "answer"]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(s.get(c)) for c in columns) + " |" for s in samples]
    return "\n".join(lines)


def progress_fields(record: dict[str, Any], last_eval: dict[str, float]) -> dict[str, Any]:
    """What the progress bar shows of a step record."""
    return {
        "reward": record["reward_mean"],
        "acc": last_eval.get("eval/accuracy"),
        "age": record["batch_age"],
        "tok/s": round(record["tokens_generated_per_s"]),
        "gen": record["custody/generating"] + record["custody/reserved"],
        "ready": record["custody/ready"],
        "trained": record["custody/trained"],
        "dropped": record["custody/dropped"],
        **{kind: f"{record[f'engine/{kind}_live']}/{record[f'engine/{kind}']}"
           for kind in ("replicas", "servers") if f"engine/{kind}_live" in record},
    }

"""The end of a run: what `train` returns (`RunResult`: the step, the weights, why it
stopped, the exit code a scheduler reads) and its summary in a few lines: steps, wall
time, the final eval, prompts trained and dropped, and the restarts of the run directory
with what they cost.

The restarts come from the trace by a byte search for its few `run_started` and
`restored` lines (`rollkeep.trace.scan_trace`), so the summary costs milliseconds however
long the run was; `rollkeep report RUN_DIR` measures each restart's cost in full (tokens
thrown away, generation time lost).
"""

from __future__ import annotations

import dataclasses
import mmap
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.custody.trace_schema import RESTORED, RUN_STARTED, CheckpointPublished
from ..core.io.untrusted import loads_json
from ..progress import duration
from ..trace import event_lines, scan_trace


@dataclass(frozen=True)
class RunResult:
    step: int
    weights_sha256: str
    reason: str  # "finished", "data exhausted", "signal"
    signal: str | None = None  # "SIGTERM" / "SIGINT" for a graceful stop
    checkpoint: str | None = None  # what a rerun resumes from (LATEST when the run ended)
    phase: str = "rl"  # "warmup" when a signal stopped the warm start
    details: tuple[str, ...] = ()  # the summary's lines under the first (`summary.summary_lines`)
    failure: str | None = None  # an external failure stopped it (no engine replica left): exit 5

    @property
    def exit_code(self) -> int:
        """0 when the run finished or its data ran out; 128 + signal after a graceful stop,
        so a scheduler (SLURM --requeue, Kubernetes) requeues it instead of calling it done;
        5 after a stop for an external failure (its final checkpoint is written)."""
        if self.failure is not None:
            return 5
        return 128 + signal.Signals[self.signal] if self.signal else 0

    def summary(self) -> str:
        return "\n".join((self._headline(), *self.details))

    def _headline(self) -> str:
        if self.failure is not None:
            return (f"stopped at step {self.step}: {self.failure}; a rerun resumes from checkpoint "
                    f"{self.checkpoint} (on any number of replicas: engine.replicas, cluster.* may change)")
        if self.signal is None:
            return f"done: step {self.step} ({self.reason}), weights_sha256 {self.weights_sha256}"
        if self.phase == "warmup":
            return (f"stopped at warm-start step {self.step} by {self.signal}; a rerun resumes the warm "
                    f"start from {self.checkpoint}; run the same command to resume")
        resume = (f"a rerun resumes from checkpoint {self.checkpoint}" if self.checkpoint
                  else "no RL checkpoint exists yet, so a rerun starts RL over "
                  "(after the warm start, which is kept)")
        return f"stopped at step {self.step} by {self.signal}; {resume}; run the same command to resume"


@dataclass(frozen=True)
class Restarts:
    """What the trace says about the processes of a run directory (warm-start-only
    processes write no trace lines and are not counted)."""

    count: int = 0  # processes after the first
    steps_redone: int = 0  # steps trained again (committed after the checkpoint a restart restored)
    siblings_regenerated: int = 0  # siblings sent out again for restored groups
    groups_lost: int = 0  # recovery.mode=cursor_only: groups in flight a restart dropped
    down_seconds: float = 0.0  # from each process's last trace line to the next one's start
    first_t: float | None = None  # when the first process started


def restarts_in_trace(trace_path: Path) -> Restarts:
    return scan_trace(trace_path, _restarts) or Restarts()


def _restarts(m: mmap.mmap | None) -> Restarts:
    starts = list(event_lines(m, RUN_STARTED))
    if not starts:
        return Restarts()
    down = 0.0
    for offset, line in starts[1:]:
        before = _line_before(m, offset)
        if before is not None and isinstance(line.get("t"), (int, float)):
            down += max(0.0, line["t"] - before)
    redone = regenerated = lost = 0
    for _, r in event_lines(m, RESTORED):
        span = r.get("steps_redone") or []
        if len(span) == 2 and all(type(s) is int for s in span):
            redone += span[1] - span[0] + 1
        regenerated += _int(r.get("siblings_regenerated"))
        lost += _int(r.get("groups_lost"))
    first_t = starts[0][1].get("t")
    return Restarts(count=len(starts) - 1, steps_redone=redone, siblings_regenerated=regenerated,
                    groups_lost=lost, down_seconds=down,
                    first_t=first_t if isinstance(first_t, (int, float)) else None)


def _line_before(m: mmap.mmap, offset: int, *, tries: int = 8) -> float | None:
    """`t` of the last readable line before `offset` (the previous process's last event;
    a line it tore when it was killed is passed over)."""
    end = offset - 1
    for _ in range(tries):
        if end <= 0:
            return None
        start = m.rfind(b"\n", 0, end) + 1
        try:
            obj = loads_json(m[start:end], strict=False)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("t"), (int, float)):
            return float(obj["t"])
        end = start - 1
    return None


def _int(v: Any) -> int:
    return v if type(v) is int else 0


def summary_lines(*, step: int, total_steps: int, first_step: int, rl_seconds: float, warmup_seconds: float,
                  final_eval: tuple[int | None, dict[str, float]], counts: dict[str, int],
                  restarts: Restarts, now: float, run_dir: str) -> list[str]:
    """The lines under `done: ...` / `stopped at ...` (indented, one fact each).
    `final_eval`: (step, metrics) of the last eval; `counts`: the scheduler's owner counts."""
    (eval_step, final_eval), trained, dropped = final_eval, counts["trained"], counts["dropped"]
    this = (f"trained {first_step + 1}-{step}" if step > first_step else "trained no step") + \
        f" in {duration(rl_seconds)}"
    if warmup_seconds:
        this += f" (+ {duration(warmup_seconds)} warm start)"
    lines = [f"  steps       {step} of {total_steps}; this process {this}"]
    if final_eval:
        lines.append(f"  final eval  step {eval_step}: "
                     + ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in final_eval.items()))
    lines.append(f"  prompts     {trained} trained, {dropped} dropped")
    if restarts.count:
        cost = [f"{restarts.steps_redone} step(s) trained again",
                f"{restarts.siblings_regenerated} sibling(s) generated again",
                f"{duration(restarts.down_seconds)} down between processes"]
        if restarts.groups_lost:
            cost.append(f"{restarts.groups_lost} group(s) LOST (recovery.mode=cursor_only)")
        lines.append(f"  restarts    {restarts.count}: " + ", ".join(cost)
                     + f"; `rollkeep report {run_dir}` itemizes them")
        if restarts.first_t is not None:
            lines.append(f"  wall time   {duration(now - restarts.first_t)} since the first start")
    else:
        lines.append("  restarts    none")
    return lines


def with_outputs(result: RunResult, run_dir: str, *, trainer: str) -> RunResult:
    """`result` with the summary's last lines, `outputs_lines`."""
    return dataclasses.replace(result, details=(*result.details, *outputs_lines(
        run_dir, checkpoint=result.checkpoint, trainer=trainer)))


def outputs_lines(run_dir: str, *, checkpoint: str | None, trainer: str) -> list[str]:
    """The summary's last lines: where the run's outputs are and the commands that read
    them (`rollkeep export` only for the torch and hf trainers' models, the ones it exports)."""
    root = Path(run_dir)
    files = [f"{name} ({what})" for name, what in (("metrics.jsonl", "per step"), ("samples.jsonl", "eval samples"))
             if (root / name).exists()]
    if checkpoint is not None:
        files.append(f"checkpoints/{checkpoint}")
    lines = [f"  outputs     {run_dir}/: " + (", ".join(files) or "nothing yet")]
    lines.append(f"  report      rollkeep report {run_dir}   (writes report/report.md and plots there)")
    if trainer in ("torch", "hf") and checkpoint is not None:
        lines.append(f"  export      rollkeep export {run_dir} --out DIR   (a Hugging Face model directory)")
    return lines


def checkpoint_note(ev: CheckpointPublished, *, short: bool = False) -> str:
    """The progress line of a published checkpoint (`short`: its name and size only; the
    full line is logger.verbose's)."""
    if short:
        size = f"{ev.bytes / 1e6:.2f} MB" if ev.bytes >= 1e6 else f"{ev.bytes / 1e3:.1f} KB"
        return f"checkpoint {ev.name} ({size})"
    return (f"checkpoint {ev.name}: {ev.bytes / 1e6:.2f} MB; the cut held the loop "
            f"{ev.cut_hold_seconds * 1e6:.0f} us (+{ev.trainer_snapshot_seconds * 1e3:.1f} ms trainer copy); "
            f"written in the background in {ev.write_seconds:.2f} s")


def error_text(e: BaseException) -> str:
    """What `run_failed` says of the error that stopped a run (each leaf of a group)."""
    leaves = e.exceptions if isinstance(e, BaseExceptionGroup) else (e,)
    return "; ".join(f"{type(x).__name__}: {x}" for x in leaves)[:2000]

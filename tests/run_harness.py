"""Running the controller in a child process that can really be killed.

The child is forked from the test process (rollkeep and its imports are already loaded,
so a run starts in milliseconds), sets `ROLLKEEP_CRASH_AT`, runs `train`, and leaves
with `os._exit`. A crash point kills it with SIGKILL: no cleanup, no flush, no atexit.
"""

from __future__ import annotations

import os
import signal
import traceback
from pathlib import Path

from rollkeep.chaos import ChaosReport, verify
from rollkeep.config import Config, load_config
from rollkeep.core import crashpoints
from rollkeep.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = str(ROOT / "tests" / "data" / "defaults.yaml")  # all defaults, for the CLI

FAST = [
    "engine.name=toy",
    "trainer.name=toy",
    "data.generated.n_rows=60",
    "data.epochs=1",
    "rollout.group_size=3",
    "train.num_prompts_per_step=4",
    "train.total_steps=12",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=2",
    "logger.progress=none",
    "eval.every_steps=0",
]


def config(run_dir: Path, *overrides: str) -> Config:
    return load_config(None, [*FAST, f"run_dir={run_dir}", *overrides])


def run_child(cfg: Config, crash_at: str | None = None, *, crash_signal: str = "KILL") -> int:
    """Run `train(cfg)` in a forked child. Returns its wait status as a signal number
    (negative) or exit code. `crash_signal="TERM"` makes the crash point a graceful stop."""
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        signal.alarm(120)  # a run that hangs dies of SIGALRM, which fails the test
        try:
            if crash_at is None:
                os.environ.pop("ROLLKEEP_CRASH_AT", None)
            else:
                os.environ["ROLLKEEP_CRASH_AT"] = crash_at
            os.environ["ROLLKEEP_CRASH_SIGNAL"] = crash_signal
            crashpoints._reload_from_env()
            from rollkeep.controller import train

            code = train(cfg).exit_code  # as `rollkeep train` exits: 128 + signal after a graceful stop
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


STOPPED = 128 + signal.SIGTERM  # how `rollkeep train` exits after a graceful stop (SIGTERM)


def run_to_end(cfg: Config) -> None:
    code = run_child(cfg)
    assert code == 0, f"run failed with {code}"


def killed(code: int) -> bool:
    return code == -signal.SIGKILL


def trace_lines(cfg: Config) -> list[dict]:
    return read_trace(Path(cfg.run_dir) / "trace.jsonl")[0]


def events(cfg: Config, name: str) -> list[dict]:
    """The trace's events called `name`, in order."""
    return [x for x in trace_lines(cfg) if x["event"] == name]


def event_counts(cfg: Config) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in trace_lines(cfg):
        counts[line["event"]] = counts.get(line["event"], 0) + 1
    return counts


def final_sha(cfg: Config) -> str:
    return [x for x in trace_lines(cfg) if x["event"] == "run_finished"][-1]["weights_sha256"]


def check(cfg: Config, reference_sha: str | None = None) -> ChaosReport:
    """Exactly-once from the trace and the final checkpoint (the chaos verifier)."""
    report = ChaosReport(deterministic=reference_sha is not None, reference_sha256=reference_sha)
    verify(cfg, Path(cfg.run_dir), report)
    assert report.passed, "\n".join(report.lines())
    return report

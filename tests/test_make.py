"""`make run` under a signal (issue 28), through a real GNU make: a SIGTERM sent to make (a
scheduler) or a Ctrl-C (SIGINT to the terminal's process group) reaches rollkeep, which
stops at a checkpoint; make then dies by the same signal, so a shell reports 143 / 130, and
the same `make run` resumes the run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollkeep.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("make") is None, reason="no make")]


def make_run(run_dir: Path) -> subprocess.Popen:
    # -o: never (re)install from here, whatever the stamp's age; VENV: this interpreter's.
    args = f"run_dir={run_dir} engine.latency_ms=200 logger.progress=lines"
    return subprocess.Popen(["make", "-s", "-C", str(ROOT), "-o", f"{VENV}/.installed", f"VENV={VENV}", "run",
                             f"CONFIG={ROOT / 'configs' / 'toy.yaml'}", f"ARGS={args}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_checkpoint(proc: subprocess.Popen) -> list[str]:
    """Read the run's lines until it has written a checkpoint (so the stop lands mid-run)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("checkpoint step_"):
            return lines
    raise AssertionError("the run ended before its first checkpoint:\n" + "".join(lines))


@pytest.mark.parametrize(("sig", "to_group"), [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["sigterm-to-make", "ctrl-c"])
def test_make_run_passes_the_signal_through_and_resumes(tmp_path, sig: signal.Signals, to_group: bool) -> None:
    run_dir = tmp_path / "run"
    proc = make_run(run_dir)
    wait_for_checkpoint(proc)
    os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == -sig, out  # make died by the signal: a shell reports 128 + sig
    assert f"by {sig.name}; a rerun resumes from checkpoint" in out
    again = make_run(run_dir)
    out2, _ = again.communicate(timeout=120)
    assert again.returncode == 0, out2
    assert "done: step 30 (finished)" in out2
    started = [e for e in read_trace(run_dir / "trace.jsonl")[0] if e["event"] == "run_started"]
    assert len(started) == 2 and started[1]["resumed_from_step"] > 0

"""What `rollkeep train` imports on the default job: nothing its first step does not need.

A restart's first trained step is meant to come within 0.5 s of `import torch` (`rollkeep
bench --suite restart`, first_step_overhead_s), so the heavy optional packages (plotting,
Hugging Face, Ray, wandb, torch's compiler) must stay off that path unless the config asks
for them. Checked on `sys.modules` of fresh interpreters, never by timing (a loaded CI
machine would make a timed assertion flaky).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.resources import files

import pytest

#: Never imported by the default job: each is for an option it leaves off (report plots,
#: the hf backend, cluster.backend ray, logger.wandb, the progress bar on a terminal) or, for
#: torch's compiler stack, for nothing rollkeep runs (trainers/adamw.py says why).
HEAVY = ("matplotlib", "transformers", "ray", "wandb", "rich", "scipy", "pandas", "sympy",
         "torch._dynamo", "torch._inductor")

ARITH = str(files("rollkeep") / "configs" / "arith.yaml")
# The default job at a test's size; nothing that picks modules differs from the default
# (both runs evaluate: after the warm start, and at the resumed run's last step).
SMALL = ["warmup.sft_steps=2", "trainer.model.n_layer=1", "trainer.model.n_embd=32",
         "checkpoint.every_steps=2", "eval.every_steps=3", "eval.n_rows=20", "logger.progress=none"]

_MODULES = "import json, sys; print(json.dumps(sorted(sys.modules)))"


def _python(code: str, *, timeout: float = 120) -> list[str]:
    """`sorted(sys.modules)` that `code` printed as its last line in a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "ROLLKEEP_CRASH_AT"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m in HEAVY or m.startswith(tuple(h + "." for h in HEAVY))]


def test_the_train_entry_point_and_its_start_up_imports_load_nothing_heavy() -> None:
    # What `rollkeep train` imports before it builds the run (cli/train.py `run`): the
    # config, the controller, and the default backends' modules (torch included).
    code = (
        "from rollkeep.cli import main, train as cli_train\n"
        "from rollkeep.config import load_config\n"
        "from rollkeep.controller import train\n"
        f"cli_train._import_backends(load_config({ARITH!r}, []))\n"
        + _MODULES
    )
    modules = _python(code)
    assert "torch" in modules and "rollkeep.trainers.grpo" in modules  # it did import the backends
    assert _heavy(modules) == []


def test_rollkeep_help_does_not_import_torch() -> None:
    code = (
        "import contextlib, io\n"
        "from rollkeep.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--help']) == 0\n"
        + _MODULES
    )
    modules = _python(code)
    assert [m for m in modules if m == "torch" or m.startswith("torch.")] == []
    assert _heavy(modules) == []


@pytest.mark.slow
def test_a_resumed_default_job_trains_without_loading_anything_heavy(tmp_path) -> None:
    # The path: the default job restarted from an RL checkpoint, through the
    # command line, in a fresh process; the modules are read after it has trained past
    # its first step (and finished), so the first step loaded none of them either.
    run = f"run_dir={tmp_path / 'run'}"
    first = _python(
        "from rollkeep.cli import main\n"
        f"assert main(['train', {ARITH!r}, *{SMALL!r}, 'train.total_steps=2', {run!r}]) == 0\n"
        + _MODULES
    )
    assert _heavy(first) == []
    resumed = _python(
        "from rollkeep.cli import main\n"
        f"assert main(['train', {ARITH!r}, *{SMALL!r}, 'train.total_steps=3', {run!r}]) == 0\n"
        + _MODULES
    )
    assert "rollkeep.core.restore.chain" in resumed and "torch" in resumed
    assert _heavy(resumed) == []
    # The sharded trainer's machinery is for trainer.world_size > 1 only.
    assert "rollkeep.trainers.ranks" not in resumed
    trace = [json.loads(line) for line in (tmp_path / "run" / "trace.jsonl").read_text().splitlines()]
    started = [e for e in trace if e["event"] == "run_started"]
    assert [s["resumed_from_step"] for s in started] == [None, 2]
    assert [e["step"] for e in trace if e["event"] == "step_committed"][-1] == 3
    assert [e["step"] for e in trace if e["event"] == "eval"] == [0, 3]  # after the warm start, step 3

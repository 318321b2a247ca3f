"""User code is contained (issue 30; defects D1, D2, D11, D16 of
../shared/findings/hostile-inputs-2.md): a reward function, an environment or a custom
trainer that hangs, busy-loops, answers without end, calls `sys.exit` or fails to save
never hangs the run, never starves later calls, and never ends it with a traceback.

The hang, SIGTERM and SystemExit cases run `python -m rollkeep train` as a real
subprocess (a hostile plug-in module written into tmp_path, on PYTHONPATH): only a process
boundary shows that the run exits although threads of user code are still hanging."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from run_harness import DEFAULTS, FAST, ROOT, config, events

from rollkeep.cli import main
from rollkeep.controller import train
from rollkeep.controller.usercode import Overdue, UserCode, UserCodeError, UserStop
from rollkeep.core.errors import ExternalError
from rollkeep.engines.toy import TRAJECTORY_TOKENS
from rollkeep.trace import read_trace

HOSTILE = '''
import os, threading
from rollkeep.envs import Step

def _hang():
    mark = os.environ.get("RK_MARK")
    if mark:
        open(mark, "a").close()
    threading.Event().wait()  # never returns

class Env:  # two turns, ignores the text
    recovery = "replay"
    def reset(self, row, seed):
        self.seed, self.n = seed, 0
    def step(self, text):
        self.n += 1
        return Step(response="=1;", done=self.n == 2, reward=1.0)

class HangsSometimes(Env):  # one episode in eight hangs in step(), one in eight in reset()
    def reset(self, row, seed):
        super().reset(row, seed)
        if seed % 8 == 1:
            _hang()
    def step(self, text):
        if self.seed % 8 == 0:
            _hang()
        return super().step(text)

class Talkative(Env):  # answers RK_RESPONSE characters every turn, for four turns
    def step(self, text):
        self.n += 1
        return Step(response="=" * int(os.environ["RK_RESPONSE"]), done=self.n == 4, reward=1.0)

CALLS = [0]

def _later(exc):
    CALLS[0] += 1
    if CALLS[0] == 40:
        raise exc

class StepExits(Env):
    def step(self, text):
        _later(SystemExit(3))
        return super().step(text)

def factory_exits():  # the start-up check builds one too: that one is fine
    _later(SystemExit(4))
    return Env()

def reward_exits(completion, row):
    _later(SystemExit(7))
    return 1.0

def reward_interrupts(completion, row):
    _later(KeyboardInterrupt())
    return 1.0

def reward_sleeps_forever(completion, row):
    _hang()

def reward_hangs_on_sevens(completion, row):
    if str(row["answer"]).endswith("7"):
        _hang()
    return 1.0
'''


@pytest.fixture
def plugin(tmp_path) -> str:
    (tmp_path / "rk_hostile.py").write_text(HOSTILE)
    return "rk_hostile"


def rollkeep_train(tmp_path: Path, *overrides: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollkeep", *train_args(tmp_path, *overrides)],
                          capture_output=True, text=True, timeout=timeout, env=child_env(tmp_path, **env))


def train_args(tmp_path: Path, *overrides: str) -> list[str]:
    return ["train", DEFAULTS, *FAST, f"run_dir={tmp_path / 'run'}", *overrides]


def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLKEEP_CRASH")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def trace(tmp_path: Path) -> list[dict]:
    return read_trace(tmp_path / "run" / "trace.jsonl")[0]


def named(lines: list[dict], event: str) -> list[dict]:
    return [x for x in lines if x["event"] == event]


def one_paragraph(err: str) -> str:
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1, err
    return err


# -- the mechanism, in-process ----------------------------------------------------------------


def test_d1_a_call_past_its_deadline_is_abandoned_and_never_blocks_the_next() -> None:
    """More hung calls than the loop's default executor has threads (min(32, CPUs + 4)):
    every later call still starts at once, and each hung thread is a daemon."""
    gate = threading.Event()
    code = UserCode()

    async def scenario() -> list[str]:
        hung = [code.call("hangs", 0.05, gate.wait) for _ in range(40)]
        outcomes = await asyncio.gather(*hung, return_exceptions=True)
        assert all(isinstance(o, Overdue) for o in outcomes), outcomes
        assert code.hung == 40
        return [await code.call("quick", 5.0, lambda i=i: f"ok {i}") for i in range(3)]

    try:
        assert asyncio.run(scenario()) == ["ok 0", "ok 1", "ok 2"]
        workers = [t for t in threading.enumerate() if t.name.startswith("rollkeep-user-code")]
        assert len(workers) >= 41 and all(t.daemon for t in workers)
    finally:
        gate.set()
        code.close()
    for t in workers:  # released, each abandoned call ends its thread; closed, the idle one ends
        t.join(10)
    assert code.hung == 0


def test_d1_a_busy_loop_is_abandoned_and_the_loop_goes_on() -> None:
    """`while True: pass` holds the GIL 5 ms at a time only: a thread can be left to it."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    code = UserCode()

    async def scenario() -> str:
        with pytest.raises(Overdue):
            await code.call("spins", 0.05, spin)
        return await code.call("quick", 5.0, str.upper, "done")

    try:
        assert asyncio.run(scenario()) == "DONE"
    finally:
        stop.set()
        code.close()


def test_d1_past_max_hung_abandoned_calls_the_run_is_told_to_stop() -> None:
    gate, stops = threading.Event(), []
    code = UserCode(stops.append, max_hung=3)

    async def scenario() -> None:
        for i in range(5):
            with pytest.raises(Overdue):
                await code.call(f"environment e (step {i})", 0.02, gate.wait)

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
        code.close()
    (why,) = stops  # once
    assert why.what == "3 calls of user code are still running past their deadlines (the latest: environment e (step 2))"


@pytest.mark.parametrize("exc", [SystemExit(7), KeyboardInterrupt()])
def test_d11_system_exit_from_user_code_unwinds_the_call_and_asks_for_a_stop(exc) -> None:
    stops: list = []
    code = UserCode(stops.append)

    def leave() -> None:
        raise exc

    async def scenario() -> None:
        with pytest.raises(UserStop):
            await code.call("reward function m:f", 5.0, leave)
        with pytest.raises(TimeoutError, match="its own"):  # the code's own TimeoutError is no deadline
            await code.call("reward function m:f", 5.0, _raises_timeout)

    try:
        asyncio.run(scenario())
    finally:
        code.close()
    (why,) = stops
    assert why.what.startswith(f"reward function m:f raised {type(exc).__name__}(")
    assert "asked the process to stop" in why.what


def _raises_timeout() -> None:
    raise TimeoutError("its own")


# -- D1: environments that hang, through the real command line ----------------------------


def test_d1_environment_calls_that_never_return_fail_their_attempts_and_the_run_finishes(tmp_path, plugin) -> None:
    """The red team's case: some episodes hang forever in step() or reset(). Before, six
    hung calls filled the loop's executor, every later call (building the environment
    included) timed out in its queue, nothing trained and the process never exited."""
    r = rollkeep_train(tmp_path, f"env.factory={plugin}:HangsSometimes", "env.max_turns=2", "env.timeout_s=0.3",
                       "rollout.max_data_attempts=3")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = trace(tmp_path)
    late = [x["error"] for x in named(lines, "failed") if "took longer than env.timeout_s=0.3 s" in x["error"]]
    assert len(late) > 8, late  # more hung threads than the old shared executor had
    assert {e.split(": ")[1].split(" took")[0] for e in late} == {"step of turn 0", "reset"}
    assert not [e for e in late if "building the environment" in e], "a later call waited behind a hung one"
    assert len(named(lines, "step_committed")) == 12
    assert named(lines, "run_finished")[-1]["reason"] == "finished"


def test_d1_an_environment_factory_that_never_returns_at_start_up_is_exit_2(tmp_path) -> None:
    (tmp_path / "rk_stuck.py").write_text("import threading\ndef make():\n    threading.Event().wait()\n")
    r = rollkeep_train(tmp_path, "env.factory=rk_stuck:make", "env.timeout_s=0.2")
    assert r.returncode == 2, r.stderr
    err = one_paragraph(r.stderr)
    assert "building an environment took longer than env.timeout_s=0.2 s" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_d1_d2_past_the_bound_of_hung_calls_the_run_stops_with_its_checkpoint_and_exit_2(tmp_path, plugin) -> None:
    """A reward that never returns, cut off by the attempt's own deadline
    (rollout.timeout_s, the reward's thread abandoned): the hung threads grow until
    MAX_HUNG, and then the run stops as for a signal instead of leaking more."""
    r = rollkeep_train(tmp_path, f"reward.fn={plugin}:reward_sleeps_forever", "rollout.timeout_s=0.3",
                       "rollout.max_infra_attempts=50")
    assert r.returncode == 2, r.stderr[-3000:]
    err = one_paragraph(r.stderr)
    assert "64 calls of user code are still running past their deadlines (the latest: reward function " \
           f"{plugin}:reward_sleeps_forever)" in err
    lines = trace(tmp_path)
    assert all(x["kind"] == "infra" and "rollout.timeout_s=0.3" in x["error"] for x in named(lines, "failed"))
    assert named(lines, "run_finished") and (tmp_path / "run" / "checkpoints" / "LATEST").exists()


# -- D2: reward functions off the loop ---------------------------------------------------------


def test_d2_sigterm_stops_a_run_whose_reward_function_never_returns(tmp_path, plugin) -> None:
    """The reward ran on the loop thread: it froze the run, and SIGTERM (handled on the
    loop) did nothing. Now SIGTERM, sent once the reward is running, stops the run with
    its final checkpoint and exit 143, however long the reward would take."""
    mark = tmp_path / "reward-started"
    proc = subprocess.Popen([sys.executable, "-m", "rollkeep",
                             *train_args(tmp_path, f"reward.fn={plugin}:reward_sleeps_forever")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(tmp_path, RK_MARK=str(mark)))
    try:
        deadline = time.monotonic() + 60
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # waiting for the event: the reward function has started
        assert mark.exists(), proc.communicate(timeout=5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)  # a generous bound, not a measurement
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "stopped at step 0 by SIGTERM" in out and "Traceback" not in err
    assert (tmp_path / "run" / "checkpoints" / "LATEST").exists()
    assert named(trace(tmp_path), "run_finished")[-1]["reason"] == "signal"


def test_d2_a_reward_past_reward_timeout_s_is_a_data_failure_naming_the_function(tmp_path, plugin) -> None:
    r = rollkeep_train(tmp_path, f"reward.fn={plugin}:reward_hangs_on_sevens", "reward.timeout_s=0.3",
                       "engine.data_fail_rate=0")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = trace(tmp_path)
    failed = named(lines, "failed")
    assert failed and all(x["kind"] == "data" and x["error"] == f"reward function {plugin}:reward_hangs_on_sevens "
                          "took longer than reward.timeout_s=0.3 s" for x in failed), failed
    dropped = named(lines, "dropped")
    assert dropped and all("took longer than reward.timeout_s" in x["reason"] for x in dropped)
    assert len(named(lines, "step_committed")) == 12


# -- D11: SystemExit and KeyboardInterrupt from user code ------------------------------------


@pytest.mark.parametrize("overrides, who, raised", [
    (["reward.fn={p}:reward_exits"], "reward function {p}:reward_exits", "SystemExit(7)"),
    (["reward.fn={p}:reward_interrupts"], "reward function {p}:reward_interrupts", "KeyboardInterrupt()"),
    (["env.factory={p}:StepExits"], "environment {p}:StepExits (step of turn ", "SystemExit(3)"),
    (["env.factory={p}:factory_exits"], "environment {p}:factory_exits (building the environment)",
     "SystemExit(4)"),
])
def test_d11_user_code_raising_system_exit_stops_the_run_cleanly_with_exit_2(tmp_path, capsys, plugin, overrides,
                                                                             who, raised) -> None:
    """Before: exit 7 (or 130, which means "stopped by SIGINT") with a CancelledError
    traceback and no checkpoint. Now: a graceful stop, its final checkpoint, one paragraph
    naming the function and the exception, exit 2 (the user's code is at fault)."""
    over = [o.format(p=plugin) for o in overrides]
    r = rollkeep_train(tmp_path, *over, "env.max_turns=2" if "env" in over[0] else "reward.timeout_s=60")
    assert r.returncode == 2, r.stderr[-3000:]
    err = one_paragraph(r.stderr)
    who = who.format(p=plugin)
    assert who in err and f"raised {raised}: user code asked the process to stop, so the run stopped at step" in err
    latest = (tmp_path / "run" / "checkpoints" / "LATEST").read_text().strip()
    assert f"checkpoint {latest} (LATEST) stands" in err
    lines = trace(tmp_path)
    assert named(lines, "run_finished")[-1]["reason"] == "user code"
    assert named(lines, "checkpoint_published")[-1]["name"] == latest
    assert main(["audit", str(tmp_path / "run" / "checkpoints")]) == 0, capsys.readouterr()


# -- D16 and env.max_response_bytes: bounded responses ---------------------------------------


def test_d16_the_toy_engines_trajectory_budget_counts_environment_tokens(tmp_path, monkeypatch) -> None:
    """An environment answering 5000 characters a turn grew toy trajectories without end
    (the red team's 5 MB a turn wrote 229 MiB of rows for one step): the toy engine has a
    budget now, and a response that would spend it ends the episode."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rk_hostile.py").write_text(HOSTILE)
    monkeypatch.setenv("RK_RESPONSE", "1500")
    cfg = config(tmp_path / "run", "env.factory=rk_hostile:Talkative", "env.max_turns=4", "train.total_steps=2",
                 "engine.data_fail_rate=0", "engine.infra_fail_rate=0")
    train(cfg)
    sealed = events(cfg, "sealed")
    assert sealed and all(x["tokens"] < TRAJECTORY_TOKENS for x in sealed)
    assert max(x["tokens"] for x in sealed) > 2 * 1500, "two responses fit the budget, the third ends the episode"
    turns = events(cfg, "turn_sealed")
    assert turns and max(x["turn"] for x in turns) == 1  # (without the budget: turns 0, 1 and 2)


def test_a_response_over_env_max_response_bytes_is_a_data_failure(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "rk_hostile.py").write_text(HOSTILE)
    monkeypatch.setenv("RK_RESPONSE", str(5 << 20))  # the red team's 5 MB a turn
    # By default an environment that fails every episode alike stops the run first (exit 2,
    # nothing dropped: rollout.fail_fast_attempts, issue 28) ...
    first = config(tmp_path / "ff", "env.factory=rk_hostile:Talkative", "env.max_turns=4", "train.total_steps=1")
    with pytest.raises(UserCodeError, match="environment rk_hostile:Talkative: step.. returned a response of"):
        train(first)
    assert events(first, "dropped") == []
    # ... and with that check off, every prompt fails: the run runs out of them (exit 5).
    cfg = config(tmp_path / "run", "env.factory=rk_hostile:Talkative", "env.max_turns=4", "train.total_steps=1",
                 "rollout.fail_fast_attempts=0")
    with pytest.raises(ExternalError, match="lost"):
        train(cfg)
    failed = events(cfg, "failed")
    assert failed and all("returned a response of 5242880 bytes, over env.max_response_bytes=65536" in x["error"]
                          for x in failed if x["kind"] == "data" and "toy engine" not in x["error"])
    rows = sum(p.stat().st_size for p in (Path(cfg.run_dir) / "rows").rglob("*") if p.is_file())
    assert rows < 1 << 20, f"{rows} bytes of rows"


# -- a custom trainer whose save() raises --------------------------------------------------------

FAILING_TRAINER = '''
from examples.dcp_trainer import make as _make

class _Failing:
    def __init__(self, inner):
        self.inner, self.step = inner, inner.step
    def save(self, dir):
        if self.step >= 4:
            raise {exc}
        self.inner.save(dir)

def make(**kw):
    trainer = _make(**kw)
    snapshot = trainer.snapshot
    trainer.snapshot = lambda: _Failing(snapshot())
    return trainer
'''

TINY_CUSTOM = [
    "engine.name=torch", "trainer.name=custom", "engine.max_new_tokens=4", "trainer.model.n_layer=1",
    "trainer.model.n_head=2", "trainer.model.n_embd=32", "trainer.model.block_size=16",
    "trainer.kwargs.micro_batch_size=8", "rollout.group_size=2", "train.num_prompts_per_step=2",
    "train.total_steps=6", "checkpoint.every_steps=2", "data.generated.n_rows=32",
]


@pytest.mark.slow
@pytest.mark.parametrize("exc", ["ValueError('the quota service said no')", "SystemExit(9)"])
def test_a_custom_trainer_whose_save_raises_is_exit_2_and_the_previous_checkpoint_stands(
        tmp_path, monkeypatch, capsys, exc) -> None:
    """Before: `_write` caught OSError only, so anything else from save() was a traceback
    (exit 1). The store undoes the unpublished checkpoint on any exception."""
    monkeypatch.chdir(ROOT)  # `examples` is imported from the current directory
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"rk_failing_trainer_{exc.split('(')[0].lower()}"  # a module of its own: imports are cached
    (tmp_path / f"{name}.py").write_text(FAILING_TRAINER.format(exc=exc))
    run = tmp_path / "run"
    code = main(["train", DEFAULTS, *FAST, f"run_dir={run}", *TINY_CUSTOM, f"trainer.factory={name}:make"])
    err = one_paragraph(capsys.readouterr().err)
    assert code == 2, err
    assert f"the custom trainer {name}:make failed to save the checkpoint of step 4" in err
    assert "Field: trainer.factory" in err and f"Found: {exc.split('(')[0]}" in err
    ck = run / "checkpoints"
    assert (ck / "LATEST").read_text() == "step_000002\n"
    assert sorted(p.name for p in ck.iterdir()) == ["LATEST", "step_000002"], "nothing half-written is left"
    lines = [json.loads(x) for x in (run / "trace.jsonl").read_text().splitlines()]
    assert [x["name"] for x in lines if x["event"] == "checkpoint_published"] == ["step_000002"]


FAILING_STEP = '''
from examples.dcp_trainer import make as _make

def make(**kw):
    trainer = _make(**kw)
    step, taken = trainer.train_step, []
    def train_step(batch):
        if len(taken) == 3:
            raise {exc}
        taken.append(1)
        return step(batch)
    trainer.train_step = train_step
    return trainer
'''


@pytest.mark.slow
@pytest.mark.parametrize("exc", ["RuntimeError('CUDA error: an illegal memory access')", "SystemExit(9)"])
def test_a_custom_trainer_whose_train_step_raises_is_exit_2_and_the_run_resumes_once_fixed(
        tmp_path, monkeypatch, capsys, exc) -> None:
    """Before: the exception went through the train pump as a traceback (exit 1)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"rk_failing_step_{exc.split('(')[0].lower()}"
    (tmp_path / f"{name}.py").write_text(FAILING_STEP.format(exc=exc))
    run = tmp_path / "run"
    code = main(["train", DEFAULTS, *FAST, f"run_dir={run}", *TINY_CUSTOM, f"trainer.factory={name}:make"])
    err = one_paragraph(capsys.readouterr().err)
    assert code == 2, err
    assert f"the custom trainer {name}:make failed to take step 4 (train_step)" in err
    assert "Traceback" not in err and f"Found: {exc.split('(')[0]}" in err
    assert (run / "checkpoints" / "LATEST").read_text() == "step_000002\n"
    # Fixed (the example's own trainer): the same command resumes and finishes.
    (tmp_path / f"{name}.py").write_text("from examples.dcp_trainer import make  # noqa: F401\n")
    sys.modules.pop(name, None)
    importlib.invalidate_caches()
    code = main(["train", DEFAULTS, *FAST, f"run_dir={run}", *TINY_CUSTOM, f"trainer.factory={name}:make"])
    assert code == 0, capsys.readouterr().err
    assert (run / "checkpoints" / "LATEST").read_text() == "step_000006\n"

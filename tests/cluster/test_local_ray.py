"""The run's own local Ray (`cluster.backend: ray` without `cluster.address`) does not
outlive the run: not when it ends, not when it fails, not when it is SIGKILLed.

A run's Ray processes are found by a marker in their environment that only this test's
`rollkeep train` subprocess and its descendants carry: the session's shared Ray head
(conftest.py) and any other Ray on the machine are neither counted nor touched."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from run_harness import DEFAULTS, FAST

from rollkeep.cluster import reaper

MARK = "ROLLKEEP_TEST_RUN"
LOCAL_RAY = ["cluster.backend=ray", "engine.replicas=1", "cluster.num_cpus=1", "cluster.replica_cpus=0.5"]


def _stat(pid: int) -> tuple[int, str, int]:
    """(parent pid, state, start time in clock ticks) from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    return int(fields[1]), fields[0].decode(), int(fields[19])


def alive_with(mark: str, also: frozenset[tuple[int, int]] = frozenset()) -> dict[int, str]:
    """pid -> command line of every live process (not a zombie) whose environment has
    MARK=mark, or that is one of `also` ((pid, start time) pairs: a pid reused since is not).
    (Ray's agents overwrite most of the memory /proc/PID/environ reads when they set their
    process title, so the environment misses some of them: `descendants` finds them.)"""
    entry = f"{MARK}={mark}".encode()
    held = dict(also)
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            pid = int(name)
            try:
                _, state, start = _stat(pid)
                environ = Path(f"/proc/{name}/environ").read_bytes()  # (a zombie's is empty)
                if state != "Z" and (entry in environ.split(b"\0") or held.get(pid) == start):
                    out[pid] = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            except (OSError, ValueError, IndexError):
                pass  # gone meanwhile, or another user's
    return out


def descendants(pid: int) -> frozenset[tuple[int, int]]:
    """(pid, start time) of every live descendant of `pid`."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                parent, state, start = _stat(int(name))
            except (OSError, ValueError, IndexError):
                continue
            if state != "Z":
                parents[int(name)] = (parent, start)
    found, frontier = {}, {pid}
    while frontier:
        frontier = {p for p, (parent, _) in parents.items() if parent in frontier and p not in found}
        found.update({p: parents[p][1] for p in frontier})
    return frozenset(found.items())


def gone_within(mark: str, seconds: float, also: frozenset[tuple[int, int]] = frozenset()) -> dict[int, str]:
    """Wait until no process carries the mark (or is one of `also`), at most `seconds`; what is left."""
    end = time.monotonic() + seconds
    while (left := alive_with(mark, also)) and time.monotonic() < end:
        threading.Event().wait(0.05)
    return left


def train(run_dir: Path, mark: str, *overrides: str, out: Path) -> subprocess.Popen:
    """`rollkeep train` on a local Ray of its own, its output in the file `out`."""
    env = {**os.environ, MARK: mark, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    with open(out, "w") as f:  # (a file: a pipe nobody reads could fill and block the run)
        return subprocess.Popen([sys.executable, "-m", "rollkeep", "train", DEFAULTS, *FAST, f"run_dir={run_dir}",
                                 *LOCAL_RAY, *overrides], env=env, stdout=f, stderr=subprocess.STDOUT)


def first(run_dir: Path, event: str, proc: subprocess.Popen, out: Path) -> dict:
    """The first `event` in the run's trace, waiting for it while the run lives."""
    trace = run_dir / "trace.jsonl"
    while True:
        ended = proc.poll() is not None
        for line in trace.read_text().splitlines() if trace.exists() else []:
            try:
                x = json.loads(line)
            except ValueError:
                break  # a line still being written
            if x["event"] == event:
                return x
        assert not ended, f"the run ended (exit {proc.returncode}) before {event}: {out.read_text()[-2000:]}"
        threading.Event().wait(0.01)  # polling a file another process writes


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize("end", ["finished", "failed"])
def test_d_ray_a_run_that_ends_leaves_no_process_of_its_local_ray(tmp_path, end) -> None:
    pytest.importorskip("ray")
    mark = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    if end == "failed":  # exit 2 once its Ray is up: the run dir cannot be created
        (tmp_path / "a_file").touch()
        run_dir = tmp_path / "a_file" / "run"
    out = tmp_path / "out.txt"
    proc = train(run_dir, mark, "train.total_steps=2", out=out)
    try:
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == (0 if end == "finished" else 2), out.read_text()[-2000:]
    assert alive_with(mark) == {}  # at once: the run waits until none of its Ray is left


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_d_ray_a_run_stopped_or_killed_mid_run_leaves_no_process_of_its_local_ray(tmp_path, sig) -> None:
    pytest.importorskip("ray")
    mark = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    out = tmp_path / "out.txt"
    proc = train(run_dir, mark, "train.total_steps=1000", "data.epochs=null", "trainer.step_sleep_ms=20", out=out)
    try:
        replica = first(run_dir, "engine_replica_started", proc, out)["pid"]
        first(run_dir, "sealed", proc, out)
        tree = descendants(proc.pid)  # (the agents, found by their parent, the raylet)
        before = alive_with(mark, tree)
        # The controller, its watchdog, gcs_server, raylet, the agents, the replica's worker...
        assert {proc.pid, replica} <= before.keys() and len(before) >= 5, before
        assert sum("Agent" in cmd for cmd in before.values()) == 2, before
        os.kill(proc.pid, sig)  # the controller alone
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    if sig == signal.SIGTERM:  # a graceful stop: the run waits until none of its Ray is left
        assert code == 128 + signal.SIGTERM, out.read_text()[-2000:]
        assert alive_with(mark, tree) == {}
    else:
        left = gone_within(mark, 30, tree)  # (a bound, not a timing: Ray's own agents took 60 s)
        assert left == {}, f"still alive 30 s after the controller's SIGKILL: {left}\n{out.read_text()[-2000:]}"


def test_the_watchdog_kills_the_marked_processes_once_its_pipe_closes_and_no_others() -> None:
    mark = uuid.uuid4().hex
    sleeper = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    marked = subprocess.Popen(sleeper, stdin=subprocess.PIPE, env={**os.environ, reaper.VAR: mark})
    other = subprocess.Popen(sleeper, stdin=subprocess.PIPE, env={**os.environ, reaper.VAR: uuid.uuid4().hex})
    watchdog = subprocess.Popen([sys.executable, "-I", reaper.__file__, mark], stdin=subprocess.PIPE)
    try:
        watchdog.stdin.close()  # as when the controller exits or dies
        assert watchdog.wait(timeout=60) == 0
        assert marked.wait(timeout=5) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for p in (marked, other, watchdog):
            p.kill()
            p.wait()


def test_the_watchdog_holds_the_children_of_a_marked_process_whose_environment_lost_the_mark() -> None:
    # As Ray's agents: started by a marked raylet, their environ unreadable as marked (here:
    # an environment without the mark), orphaned when the raylet dies with the controller.
    mark = uuid.uuid4().hex
    spawn = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
             "env={}); print(c.pid, flush=True); sys.stdin.read()")
    parent = subprocess.Popen([sys.executable, "-c", spawn], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**os.environ, reaper.VAR: mark})
    child = int(parent.stdout.readline())
    tracker = reaper.Tracker(f"{reaper.VAR}={mark}".encode())
    try:
        tracker.scan()
        assert set(tracker.procs) == {parent.pid, child}
        parent.kill()  # the child is orphaned: no longer anyone's child in the run
        parent.wait()
        tracker.scan()
        assert set(tracker.procs) == {child}
        assert reaper.sweep(tracker, deadline_s=30) == []
        assert not Path(f"/proc/{child}").exists() or _stat(child)[1] == "Z"
    finally:
        parent.kill()
        parent.wait()
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)

"""Kill/resume torture runs: the proof of the promise, from the outside.

`run_chaos` runs `rollkeep train` as a subprocess, kills it N times, resumes it each time
until it finishes, and then checks, from the trace and the final checkpoint alone:

  - no prompt was trained twice in the surviving lineage (`lineage.py`);
  - every prompt of every completed epoch was trained or dropped, exactly once;
  - the final checkpoint passes the restore chain and the custody audit;
  - with `deterministic: true`, the final `weights_sha256` equals that of a run of the
    same config that was never killed.

With engine replicas on Ray (`cluster.backend: ray`), `replica_kills` also SIGKILLs a
replica's process in that many of the runs, once it has sealed an attempt, before the
controller's own kill: the pool fails its attempts as infra, Ray restarts it, and the
checks above must hold all the same.

With trainer ranks (`trainer.world_size` > 1), `rank_kills` SIGKILLs one rank process at
a random instant in that many of the runs (instead of the controller): the controller
stops with exit 5 naming the rank, and the next run resumes as after any kill.

Kills alternate between two kinds: SIGKILL at a random instant, and a named crash point
(`ROLLKEEP_CRASH_AT`): a ledger transition after a random number of occurrences, or a step
of checkpoint publication (deliberately mid-write), chosen at random. Each kill is sized
from the uninterrupted reference run so that every one lands and the run still moves
forward: it aims one to two checkpoint intervals past the last checkpoint (more when many
checkpoints are left for few kills), and short of the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Config, load_config
from .core import crashpoints
from .core.checkpoint.store import CheckpointStore
from .core.custody.events import (
    ALL_EVENTS,
    Abandoned,
    Configured,
    EffectDone,
    EffectIntent,
    Evicted,
    Released,
    Spared,
    event_name,
)
from .core.custody.trace_schema import (
    CHECKPOINT_PUBLISHED,
    ENGINE_REPLICA_STARTED,
    RUN_FINISHED,
    RUN_STARTED,
    SEALED,
)
from .core.errors import RollkeepError, UserInputError
from .core.journal.segments import JOURNAL_AFTER_FSYNC, JOURNAL_BEFORE_FSYNC
from .core.restore.chain import restore_chain
from .core.rollout.source import PromptSource
from .core.rowlog.segments import ROWLOG_AFTER_FSYNC, ROWLOG_BEFORE_FSYNC
from .lineage import exactly_once, lineage
from .trace import last_committed_in_trace, read_trace

# Where a crash-point kill lands: mid-publication (the retention step needs old checkpoints
# to delete, so it is left out) or right after the cut, and the ledger's transitions.
#: Inside the journal's group commit: before and after the row log's and the journal's fsync.
JOURNAL_POINTS = (ROWLOG_BEFORE_FSYNC, ROWLOG_AFTER_FSYNC, JOURNAL_BEFORE_FSYNC, JOURNAL_AFTER_FSYNC)
PUBLISH_POINTS = (*(p for p in crashpoints.PUBLISH_POINTS if p != crashpoints.PUBLISH_RETENTION),
                  "checkpoint.after_cut")
LEDGER_POINTS = tuple(event_name(e) for e in ALL_EVENTS if e not in (Configured, Released, Evicted, Abandoned,
                                                                      Spared, EffectIntent, EffectDone))


@dataclass
class Kill:
    kind: str  # "timer" or "crash point"
    detail: str  # "after 1.23 s" or "ledger.sealed:140"
    killed: bool  # False if the run finished before the kill landed
    resumed_from: int | None  # the step the killed run had resumed from (None: it started fresh)


@dataclass
class ChaosReport:
    kills: list[Kill] = field(default_factory=list)
    restarts: int = 0
    steps: int = 0
    trained: int = 0
    dropped: int = 0
    duplicates: list[tuple[int, int]] = field(default_factory=list)
    lost: list[tuple[int, int]] = field(default_factory=list)
    completed_epochs: list[int] = field(default_factory=list)
    weights_sha256: str | None = None
    reference_sha256: str | None = None
    deterministic: bool = False
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    unspent: int = 0  # kills not attempted: the run had its final checkpoint already
    replica_kills: int = 0  # engine replica processes SIGKILLed (cluster.backend: ray)
    rank_kills: int = 0  # trainer rank processes SIGKILLed (trainer.world_size > 1)

    @property
    def passed(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        landed = sum(k.killed for k in self.kills)
        out = [
            f"kills: {landed} landed of {len(self.kills)} attempted "
            f"({sum(k.kind == 'timer' and k.killed for k in self.kills)} at random instants, "
            f"{sum(k.kind == 'crash point' and k.killed for k in self.kills)} at crash points)"
            + (f"; {self.unspent} not attempted: the run had reached its final checkpoint" if self.unspent else "")
            + (f"; and {self.replica_kills} engine replica(s) killed" if self.replica_kills else "")
            + (f"; {self.rank_kills} of them trainer ranks" if self.rank_kills else ""),
        ]
        out += [f"  - {k.kind:11} {k.detail:32} {'killed' if k.killed else 'finished first'}"
                f" ({'a fresh start' if k.resumed_from is None else f'resumed from step {k.resumed_from}'})"
                for k in self.kills]
        out.append(f"lineage: {self.steps} steps, {self.trained} prompts trained, {self.dropped} dropped, "
                   f"{self.restarts} restarts")
        out.append(f"completed epochs checked: {self.completed_epochs or 'none'}")
        out.append(f"duplicates: {len(self.duplicates)}   lost: {len(self.lost)}")
        if self.deterministic:
            same = self.weights_sha256 == self.reference_sha256
            out.append(f"weights_sha256: {self.weights_sha256} ({'==' if same else '!='} uninterrupted run)")
        out += [f"PROBLEM: {p}" for p in self.problems]
        out.append("PASS" if self.passed else "FAIL")
        return out


def _train_cmd(config: str | None, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "rollkeep", "train", *([config] if config else []), *overrides]


def _env(crash_at: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("ROLLKEEP_CRASH_AT", None)
    if crash_at:
        env["ROLLKEEP_CRASH_AT"] = crash_at
    return env


def _trace_mark(trace: Path) -> int:
    """Where the trace ends now; a run launched afterwards traces its start past here."""
    return trace.stat().st_size if trace.exists() else 0


def _last_checkpoint(trace: Path) -> int:
    """The step of the newest checkpoint the run's trace records (0: none yet)."""
    lines, _ = read_trace(trace) if trace.exists() else ([], 0)
    return max((x["step"] for x in lines if x["event"] == CHECKPOINT_PUBLISHED), default=0)


def _wait_started(proc: subprocess.Popen, trace: Path, mark: int, timeout: float) -> bool:
    """Poll (a supervisor, not a test) until the child has traced `run_started` after
    `mark`, reading only what was appended since."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if trace.exists():
            with open(trace, "rb") as f:
                f.seek(mark)
                if b'"event":"run_started"' in f.read():
                    return True
        if proc.poll() is not None:
            return False
        time.sleep(0.01)
    return False


def _kill_a_replica(proc: subprocess.Popen, trace: Path, mark: int, rng: random.Random, timeout: float) -> bool:
    """Poll (a supervisor) the trace after `mark` until some engine replica of this run has
    sealed an attempt; SIGKILL that replica's process. False if the run ended first."""
    deadline = time.monotonic() + timeout
    pids: dict[int, int] = {}
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(FileNotFoundError):
            with open(trace, "rb") as f:
                f.seek(mark)
                for raw in f.read().splitlines():
                    try:
                        x = json.loads(raw)
                    except ValueError:
                        continue  # a line still being written
                    if x.get("event") == ENGINE_REPLICA_STARTED:
                        pids[x["replica"]] = x["pid"]
                    elif x.get("event") == SEALED and x.get("replica") in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pids[rng.choice(sorted(pids))], signal.SIGKILL)
                        return True
        time.sleep(0.01)
    return False


def _ranks_of(controller: int) -> list[int]:
    """The pids of `controller`'s trainer rank processes (its children running
    rollkeep.trainers.rank), from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == controller and b"rollkeep.trainers.rank" in (entry / "cmdline").read_bytes():
                out.append(int(entry.name))
    return sorted(out)


def _kill_a_rank(proc: subprocess.Popen, delay: float, rng: random.Random, timeout: float) -> int | None:
    """Poll (a supervisor) until the run's trainer ranks are up, let it run `delay` more
    seconds, then SIGKILL one rank at random; its pid, or None if the run ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if _ranks_of(proc.pid):
            try:
                proc.wait(timeout=delay)
                return None  # it ended first
            except subprocess.TimeoutExpired:
                pass
            ranks = _ranks_of(proc.pid)
            if not ranks:
                return None
            pid = rng.choice(ranks)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return pid
        time.sleep(0.01)
    return None


def run_chaos(
    config: str | None,
    overrides: list[str],
    *,
    kills: int,
    replica_kills: int = 0,
    rank_kills: int = 0,
    seed: int = 0,
    workdir: Path | None = None,
    timeout: float = 600.0,
    log: Any = print,
) -> ChaosReport:
    t0 = time.monotonic()
    rng = random.Random(seed)
    _check_counts(kills, replica_kills, rank_kills)
    cfg = load_config(config, overrides)
    if rank_kills and getattr(cfg.trainer, "world_size", 1) < 2:
        raise UserInputError(
            f"--rank-kills {rank_kills} needs trainer ranks", field="trainer.world_size",
            expected="2 or more (each rank its own process, which chaos kills)",
            found=f"{getattr(cfg.trainer, 'world_size', 1)}: the trainer runs inside the controller's process",
            remedy="add trainer.world_size=2 (torch or hf trainer), or leave --rank-kills out")
    if rank_kills and cfg.cluster.backend == "ray":
        raise UserInputError(
            f"--rank-kills {rank_kills} kills rank processes of the controller", field="cluster.backend",
            expected="local (the ranks are the controller's children)", found="ray (the ranks are Ray actors)",
            remedy="use --replica-kills for Ray, or cluster.backend=local")
    if replica_kills and cfg.cluster.backend != "ray":
        raise UserInputError(
            f"--replica-kills {replica_kills} needs engine replicas on Ray",
            field="cluster.backend",
            expected="ray (each engine replica its own process, which chaos kills)",
            found=f"{cfg.cluster.backend}: the engine runs inside the controller's process, there "
            "is no replica to kill",
            remedy="add cluster.backend=ray engine.replicas=2 (see `rollkeep chaos --help`), or "
            "leave --replica-kills out",
        )
    root = Path(workdir) if workdir is not None else Path(cfg.run_dir) / "chaos"
    _check_workdir(root, given=workdir is not None)
    ref_dir, run_dir = root / "reference", root / "killed"
    for d in (ref_dir, run_dir):
        shutil.rmtree(d, ignore_errors=True)
    report = ChaosReport(deterministic=cfg.deterministic)
    quiet = ["logger.progress=none"]

    # 1. The uninterrupted reference run: its duration sizes the kill instants, its event
    #    counts size the crash points, its weights are the deterministic yardstick.
    log(f"chaos: reference run in {ref_dir}")
    ref = subprocess.run(_train_cmd(config, [*overrides, f"run_dir={ref_dir}", *quiet]),
                         env=_env(None), capture_output=True, text=True, timeout=timeout)
    if ref.returncode != 0:
        raise RollkeepError("the uninterrupted reference run failed",
                            found=(ref.stderr or ref.stdout)[-2000:],
                            remedy="run `rollkeep train` with this config and fix the error first")
    ref_lines, _ = read_trace(ref_dir / "trace.jsonl")
    started = next(x["t"] for x in ref_lines if x["event"] == RUN_STARTED)
    finished = next(x for x in ref_lines if x["event"] == RUN_FINISHED)
    duration = max(0.05, finished["t"] - started)
    report.reference_sha256 = finished["weights_sha256"]
    counts = Counter(x["event"] for x in ref_lines)
    total_steps = max(1, finished["step"])
    interval = min(1.0, cfg.checkpoint.every_steps / total_steps)
    # Transitions every run goes through many times (not the rare failure paths, which a
    # resumed run may never meet again), so a crash point sized below lands.
    common = [p for p in LEDGER_POINTS if counts[p] >= 2 * (kills + 1)] or ["taken"]

    # 2. Kill and resume.
    trace = run_dir / "trace.jsonl"
    cmd = _train_cmd(config, [*overrides, f"run_dir={run_dir}", *quiet])
    for i in range(kills):
        # The share of the reference run this kill aims at, counted from the last checkpoint:
        # one to two checkpoint intervals (so each kill moves the run forward) or ½ to 1½
        # times the work left divided among the kills left, whichever is more, and always
        # short of the end (so it lands).
        checkpointed = _last_checkpoint(trace)
        if checkpointed >= total_steps:  # the last kill landed after the final checkpoint: nothing is left to kill
            report.unspent = kills - i
            break
        # With the journal a resumed run starts where the killed one was (its generation is
        # kept; only its training since the checkpoint is redone, from rows already there).
        done = max(checkpointed, (last_committed_in_trace(trace) or 0) if cfg.journaled else 0)
        left = max(1 - done / total_steps, 1 / total_steps)
        share = min(0.5 * left, max(interval * rng.uniform(1, 2), left / (kills - i + 1) * rng.uniform(0.5, 1.5)))
        crash_at = None
        by_rank = report.rank_kills < rank_kills and rng.random() < (rank_kills - report.rank_kills) / (kills - i)
        if i % 2 == 1 and not by_rank:  # every other kill is a named crash point
            flushes = finished.get("journal_flushes") or 0
            if flushes >= 4 and rng.random() < 1 / 3:  # inside a group commit
                crash_at = f"{rng.choice(JOURNAL_POINTS)}:{max(1, round(0.5 * left * rng.random() * flushes))}"
            elif counts[CHECKPOINT_PUBLISHED] and rng.random() < 0.5:
                n = max(1, round(share * counts[CHECKPOINT_PUBLISHED]))
                crash_at = f"{rng.choice(PUBLISH_POINTS)}:{n}"
            else:
                point = rng.choice(common)
                # A resumed run meets a transition fewer times than its share of the run:
                # the groups admitted ahead of its restore (up to the sampler's window plus
                # the step in training) went through the early ones before the kill.
                fresh = min(share, 0.5 * (left - (cfg.sampler.window + 1) / total_steps))
                if fresh > 0:
                    crash_at = f"ledger.{point}:{max(1, round(fresh * counts[point]))}"
        mark = _trace_mark(trace)
        proc = subprocess.Popen(cmd, env=_env(crash_at), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if report.replica_kills < replica_kills and _kill_a_replica(proc, trace, mark, rng, timeout):
            report.replica_kills += 1
            log(f"chaos: run {i + 1}: killed an engine replica")
        rank_pid = None
        if by_rank:
            delay = share * duration
            rank_pid = _kill_a_rank(proc, delay, rng, timeout)
            detail = f"pid {rank_pid} after {delay:.3f} s"
        elif crash_at is None:
            delay = share * duration
            if _wait_started(proc, trace, mark, timeout):
                try:
                    proc.wait(timeout=delay)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGKILL)
            detail = f"after {delay:.3f} s"
        else:
            detail = crash_at
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        killed = proc.returncode == -signal.SIGKILL or (rank_pid is not None and proc.returncode == 5)
        report.rank_kills += rank_pid is not None and killed
        if not killed and proc.returncode != 0:
            raise RollkeepError(f"run {i + 1} failed with exit code {proc.returncode}",
                                found=err.decode(errors="replace")[-2000:],
                                remedy="this is a bug unless the config is wrong")
        lines, _ = read_trace(trace) if trace.exists() else ([], 0)
        runs = [x for x in lines if x["event"] == RUN_STARTED]
        report.kills.append(Kill("rank" if by_rank else "timer" if crash_at is None else "crash point", detail, killed,
                                 runs[-1].get("resumed_from_step") if runs else None))
        log(f"chaos: kill {i + 1}/{kills}: {report.kills[-1].kind} {detail}: "
            f"{'killed' if killed else 'finished first'}")
        if not killed:  # the run finished: there is nothing left to kill or resume
            break
    else:
        final = subprocess.run(cmd, env=_env(None), capture_output=True, text=True, timeout=timeout)
        if final.returncode != 0:
            report.problems.append(f"the final resume failed (exit {final.returncode}): {final.stderr[-1000:]}")
            report.seconds = time.monotonic() - t0
            return report

    # 3. Verify from the trace and the final checkpoint alone.
    verify(cfg, run_dir, report)
    report.seconds = time.monotonic() - t0
    return report


def _check_counts(kills: int, replica_kills: int, rank_kills: int = 0) -> None:
    for flag, n in (("--kills", kills), ("--replica-kills", replica_kills), ("--rank-kills", rank_kills)):
        if n < 0:
            raise UserInputError(
                f"{flag} {n} is negative",
                field=flag,
                expected="a number of kills, 0 or more",
                found=str(n),
                remedy=f"pass {flag} 0 or more",
            )
    if rank_kills > kills:
        raise UserInputError(f"--rank-kills {rank_kills} is more than --kills {kills}", field="--rank-kills",
                             expected=f"at most --kills ({kills}): a rank kill is one of the kills",
                             found=str(rank_kills), remedy="raise --kills or lower --rank-kills")


def _check_workdir(root: Path, *, given: bool) -> None:
    """Refuse, before any run, a working directory chaos could not run in: a file, under a
    file, or not writable. Creates it (and its parents) if missing."""
    flag = "--workdir" if given else "run_dir/chaos (the default --workdir)"
    problem = None
    if root.exists() and not root.is_dir():
        problem = "a file, not a directory"
    else:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            problem = f"it cannot be created: {e.strerror or e} (errno {e.errno})"
        else:
            if not os.access(root, os.W_OK | os.X_OK):
                problem = "a directory this user cannot write to"
    if problem is not None:
        raise UserInputError(
            f"{flag} {root} is not a directory chaos can run in",
            path=str(root),
            field="--workdir",
            expected="a writable directory (created if missing) for the runs reference/ and killed/",
            found=problem,
            remedy="pass --workdir DIR with a writable directory, or leave it out to use run_dir/chaos",
        )


def verify(cfg: Config, run_dir: Path, report: ChaosReport) -> None:
    from .controller.build import build_data

    lines, _ = read_trace(run_dir / "trace.jsonl")
    lin = lineage(lines)
    report.restarts = max(0, len(lin.runs) - 1)
    report.steps = len(lin.steps)
    report.trained = sum(lin.trained().values())
    report.duplicates = lin.duplicates()
    if lin.finished is not None:
        report.weights_sha256 = lin.finished["weights_sha256"]
    dataset, _ = build_data(cfg)
    source = PromptSource(dataset, seed=cfg.seed, epochs=cfg.data.epochs)
    try:
        restored = restore_chain(CheckpointStore(Path(run_dir) / "checkpoints"), source=source, config=None)
    except RollkeepError as e:
        report.problems.append(f"the final checkpoint fails the restore chain: {e}")
        return
    found = exactly_once(lin, restored.ledger, source)
    report.problems.extend(found.problems)
    report.dropped, report.lost = found.dropped, found.lost
    report.completed_epochs = found.completed_epochs
    if report.deterministic and report.weights_sha256 != report.reference_sha256:
        report.problems.append("deterministic run: final weights differ from the uninterrupted run's")

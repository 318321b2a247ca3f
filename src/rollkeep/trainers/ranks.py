"""Data-parallel training on `trainer.world_size` ranks, seen from the controller: the
`ShardedTrainer` (the Trainer protocol over the ranks), the `RankGroup` (their processes
and the ops sent to them), and how a step's batch is split across them.

The controller stays the single custody owner: the ranks see a batch only as the rows the
controller hands them, and never touch the ledger. The controller also keeps a whole,
unsharded copy of the model (`local`, an ordinary `GRPOTrainer` that never steps): the
ranks' gathered weights are copied into it after every step, so engines, evaluation and
`weights_sha256` read it exactly as they read a one-process trainer, and a checkpoint is
verified against it (every shard read and checked) before any rank loads.

Splitting a step's batch (so that the loss is the one-process loss)
-------------------------------------------------------------------
Every loss part is normalised by whole-batch counts (N sequences, Σ L_i tokens, M
micro-batches; `grpo_loss`) and the ranks' gradients are summed (`rank.RankTrainer`), so a
rank's part is its share of the one-process loss whatever rows it holds. For `dapo`, `grpo`
and `dr_grpo` the batch's rows are split into `world_size` contiguous runs of about equal
model tokens, each run cut into micro-batches of `micro_batch_size`; for `bnpo`, whose loss
is a mean per micro-batch, the one-process micro-batches are kept whole and dealt out
contiguously by tokens (M stays the one-process count). The ranks' losses, gradients and
token statistics then add up to the one-process ones, to round-off (the summation order
differs: equal, not bit-identical, to one process; bit-identical between runs of the same
world size). Every rank runs as many forward/backward passes as the busiest one (FSDP's
collectives pair up); the extra passes weigh nothing.

Failures: a rank that dies, or answers no op within `trainer.step_timeout_s`, is
`TrainerRankFailed` (exit 5, naming the rank): every rank is stopped, nothing is written,
the last checkpoint stands, and any world size resumes from it. A rank that raises is a
bug (`RankRaised`, exit 1), never retried.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from ..core import crashpoints
from ..core.checkpoint.cut import STEP_KEY, step_metadata
from ..core.errors import ExternalError
from .base import Batch
from .batching import model_tokens
from .grpo import GRPOTrainer, flatten, micro_chunks, step_metrics
from .grpo_snapshot import REFERENCE_FILE, RNG_FILE, STATE_FILE, _optimizer_state, _unique_state
from .rankwire import Closed, Overdue, pack_row, pack_tensor, recv, send, unpack_tensor
from .shards import FORMAT

__all__ = ["RankGroup", "RankRaised", "RayPlacement", "ShardedSnapshot", "ShardedTrainer", "TrainerRankFailed", "split_rows"]


class TrainerRankFailed(ExternalError):
    """A trainer rank died or hung (exit 5): the run stops, its last checkpoint intact."""


class RankRaised(RuntimeError):
    """A trainer rank raised: a bug (exit 1), never retried."""


# ---------------------------------------------------------------------------------------
# 1. Splitting a batch
# ---------------------------------------------------------------------------------------


def _runs(weights: Sequence[int], n: int) -> list[range]:
    """`n` contiguous runs of the items whose weights add up to about a share each (an item
    goes to the run its weight's midpoint falls in); a run may be empty."""
    total, acc, start, out = sum(weights), 0.0, 0, []
    for r in range(n):
        end = start
        while end < len(weights) and (r == n - 1 or acc + weights[end] / 2 <= total * (r + 1) / n):
            acc += weights[end]
            end += 1
        out.append(range(start, end))
        start = end
    return out


def split_rows(rows: Sequence[Any], advs: Sequence[float], *, world_size: int, micro_batch_size: int,
               keep_micro_batches: bool) -> list[list[tuple[Sequence[Any], Sequence[float]]]]:
    """Each rank's micro-batches of (rows, advantages) (module docstring)."""
    if keep_micro_batches:
        chunks = micro_chunks(rows, advs, micro_batch_size)
        tokens = [sum(model_tokens(r.versions) for r in c) for c, _ in chunks]
        return [[chunks[i] for i in run] for run in _runs(tokens, world_size)]
    tokens = [model_tokens(r.versions) for r in rows]
    return [micro_chunks(rows[run.start:run.stop], advs[run.start:run.stop], micro_batch_size)
            for run in _runs(tokens, world_size)]


# ---------------------------------------------------------------------------------------
# 2. The rank processes
# ---------------------------------------------------------------------------------------


@dataclass
class _Rank:
    rank: int
    proc: Any  # subprocess.Popen, or an _Actor: poll(), wait(timeout), kill()
    sock: socket.socket
    pid: int = 0


class _Actor:
    """A Ray actor rank seen as a process: alive while its pid is (it runs on this node)."""

    def __init__(self, ray: Any, handle: Any) -> None:
        self._ray, self._handle, self.pid = ray, handle, 0
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.pid:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = -1  # (Ray reaped it: how it ended is Ray's to say)
            except PermissionError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout or 0.0)
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("ray actor", timeout or 0.0)
            time.sleep(0.05)  # (a bounded wait for the kernel, not a synchronisation)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self._ray.kill(self._handle, no_restart=True)
            self.returncode = -signal.SIGKILL


@dataclass(frozen=True)
class RayPlacement:
    """`cluster.backend: ray`: each rank a Ray actor with these resources, on the
    controller's node (the ranks meet over loopback)."""

    cpus: float
    gpus: float


class RankGroup:
    """`world_size` rank processes (`python -m rollkeep.trainers.rank`) on this machine,
    each with a socket to the controller. `call` sends every rank one op and waits for
    every reply; one op at a time (the lock), so the ranks' collectives pair up."""

    def __init__(self, spec: dict[str, Any], *, world_size: int, timeout_s: float,
                 log_dir: Path | None = None, ray: RayPlacement | None = None) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self.backend, self.placement = "gloo", "process"
        self._lock = threading.Lock()
        self._failed: Exception | None = None
        self._ranks: list[_Rank] = []
        threads = max(1, (os.cpu_count() or 1) // world_size) if ray is None else max(1, int(ray.cpus))
        port = _free_port()  # rank 0's, for the process group's rendezvous
        specs = [{**spec, "rank": r, "world_size": world_size, "port": port, "threads": threads,
                  "parent": os.getpid(), "timeout_s": max(60.0, timeout_s), "crash": _crash(r)}
                 for r in range(world_size)]
        try:
            if ray is None:
                for s in specs:
                    self._ranks.append(self._process(s, log_dir))
            else:
                self._ranks = self._actors(specs, ray)
            hello = self._collect("start", max(120.0, timeout_s))
            for rk, msg in zip(self._ranks, hello, strict=True):
                rk.pid = int(msg["pid"])
                if isinstance(rk.proc, _Actor):
                    rk.proc.pid = rk.pid
            self.backend = str(hello[0].get("backend", "gloo"))
            self.placement = "process" if ray is None else "ray"
        except BaseException:
            self.kill()
            raise

    @staticmethod
    def _process(spec: dict[str, Any], log_dir: Path | None) -> _Rank:
        """Rank `spec["rank"]` as a child process, talking over a socket pair."""
        ours, theirs = socket.socketpair()
        log: Any = subprocess.DEVNULL
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            log = open(log_dir / f"rank{spec['rank']}.log", "ab")  # noqa: SIM115 (the child holds it)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rollkeep.trainers.rank", json.dumps(spec), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=_rank_env(), start_new_session=True)  # a terminal's Ctrl-C is the controller's to handle
        finally:
            theirs.close()
            if log is not subprocess.DEVNULL:
                log.close()
        return _Rank(spec["rank"], proc, ours)

    def _actors(self, specs: list[dict[str, Any]], placement: RayPlacement) -> list[_Rank]:
        """The ranks as Ray actors on this node, each connecting back to a loopback
        listener and naming itself with a token."""
        from ..cluster.ray_actors import import_ray
        from .rank import RankActor

        ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        token = os.urandom(16).hex()
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        cls = ray.remote(num_cpus=placement.cpus, num_gpus=placement.gpus, max_restarts=0,
                         max_task_retries=0)(RankActor)
        ranks: dict[int, _Rank] = {}
        with socket.create_server(("127.0.0.1", 0)) as listener:
            address = ["127.0.0.1", listener.getsockname()[1], token]
            handles = [cls.options(scheduling_strategy=here).remote({**s, "connect": address}) for s in specs]
            deadline = time.monotonic() + max(120.0, self.timeout_s)
            while len(ranks) < len(specs):
                listener.settimeout(max(0.0, deadline - time.monotonic()))
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    for h in handles:
                        ray.kill(h, no_restart=True)
                    raise TrainerRankFailed(
                        f"{len(specs) - len(ranks)} of {len(specs)} trainer ranks did not start as Ray actors",
                        field="cluster.trainer_cpus", expected=f"{len(specs)} actors of {placement.cpus:g} CPUs, "
                        f"{placement.gpus:g} GPUs on this node", found=f"{len(ranks)} started",
                        remedy="give the Ray node the resources (or lower cluster.trainer_cpus / trainer_gpus)") from None
                conn.settimeout(None)
                hello = recv(conn, time.monotonic() + 30)
                if hello.get("token") != token or hello.get("rank") not in range(len(specs)):
                    conn.close()  # not one of ours
                    continue
                r = int(hello["rank"])
                ranks[r] = _Rank(r, _Actor(ray, handles[r]), conn)
        return [ranks[r] for r in range(len(specs))]

    @property
    def pids(self) -> list[int]:
        return [rk.pid for rk in self._ranks]

    def call(self, op: str, payloads: dict[str, Any] | Sequence[dict[str, Any]] | None = None, *,
             on_frame: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Send `op` to every rank (`payloads`: one for all, or one per rank) and return the
        replies in rank order; `on_frame` gets the extra frames a rank streams first."""
        with self._lock:
            if self._failed is not None:
                raise self._failed
            per = [payloads or {}] * self.world_size if not isinstance(payloads, Sequence) else list(payloads)
            for rk, payload in zip(self._ranks, per, strict=True):
                try:
                    send(rk.sock, {"op": op, **payload})
                except OSError:
                    self._died(rk, op)
            return self._collect(op, self.timeout_s, on_frame)

    def _collect(self, op: str, timeout_s: float, on_frame: Callable | None = None) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        replies: dict[int, dict[str, Any]] = {}
        while len(replies) < self.world_size:
            pending = [rk for rk in self._ranks if rk.rank not in replies]
            left = deadline - time.monotonic()
            ready = select.select([rk.sock for rk in pending], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                self._hung(pending, op)
            for rk in pending:
                if rk.sock not in ready:
                    continue
                try:
                    msg = recv(rk.sock, deadline)
                except Closed:
                    self._died(rk, op)
                except Overdue:
                    self._hung([rk], op)
                except ValueError as e:
                    self._fail(RankRaised(f"trainer rank {rk.rank} sent a malformed frame during {op}: {e}"))
                if msg.get("more"):  # a streamed frame before the reply
                    try:
                        if on_frame is not None:
                            on_frame(msg)
                    except Exception as e:
                        self._fail(e if isinstance(e, RankRaised) else RankRaised(f"{op}: {type(e).__name__}: {e}"))
                    continue
                if not msg.get("ok") and msg.get("errno"):  # a full disk, a failed fsync: the run's exit 5
                    self._fail(OSError(int(msg["errno"]), f"trainer rank {rk.rank} during {op}: {msg.get('strerror')}",
                                       msg.get("filename")))
                if not msg.get("ok"):
                    dead = self._dead_peer(rk)  # a peer's death surfaces in the others as a gloo error
                    if dead is not None:
                        self._died(dead, op)
                    self._fail(RankRaised(f"trainer rank {rk.rank} raised during {op}: {msg.get('error')}\n"
                                          f"--- the rank's traceback ---\n{msg.get('traceback', '')}"))
                replies[rk.rank] = msg
        return [replies[r] for r in range(self.world_size)]

    def _dead_peer(self, raised: _Rank, wait_s: float = 2.0) -> _Rank | None:
        """A rank other than `raised` that has died, waiting up to `wait_s` for one to be
        reaped (a SIGKILLed peer's process ends within moments of its sockets closing)."""
        deadline = time.monotonic() + wait_s
        others = [rk for rk in self._ranks if rk is not raised]
        while others:
            for rk in others:
                if rk.proc.poll() is not None:
                    return rk
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                others[0].proc.wait(timeout=min(0.2, left))
            except subprocess.TimeoutExpired:
                pass
        return None

    def _died(self, rk: _Rank, op: str) -> None:
        try:
            code = rk.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = ("still running but closed its socket" if code is None else
               "its Ray actor's process ended" if isinstance(rk.proc, _Actor) else
               f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}")
        self._fail(TrainerRankFailed(
            f"trainer rank {rk.rank} (pid {rk.pid or rk.proc.pid}) died during {op}: {how}",
            field="trainer.world_size", expected="every rank to answer", found=how,
            remedy="run the same command again: it resumes from the last checkpoint, on any trainer.world_size"))

    def _hung(self, pending: list[_Rank], op: str) -> None:
        names = ", ".join(f"rank {rk.rank} (pid {rk.pid or rk.proc.pid}{_state(rk.proc.pid)})" for rk in pending)
        self._fail(TrainerRankFailed(
            f"trainer {names} did not finish {op} within trainer.step_timeout_s = {self.timeout_s:g} s",
            field="trainer.step_timeout_s", expected=f"{op} within {self.timeout_s:g} s", found="no answer",
            remedy="run the same command again (it resumes from the last checkpoint); raise "
                   "trainer.step_timeout_s if a step honestly takes longer"))

    def _fail(self, err: Exception) -> None:
        self._failed = err
        self.kill()
        raise err

    def kill(self) -> None:
        for rk in self._ranks:
            if rk.proc.poll() is None:
                rk.proc.kill()
        for rk in self._ranks:
            try:
                rk.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass  # (nothing more to do for it: the error being raised stays the run's)
            finally:
                rk.sock.close()

    def close(self) -> None:
        """Ask every rank to exit; kill what has not within a few seconds."""
        if self._failed is None:
            try:
                with self._lock:
                    for rk in self._ranks:
                        send(rk.sock, {"op": "exit"})
                    for rk in self._ranks:
                        rk.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def _state(pid: int) -> str:
    """", stopped" for a process the kernel says is stopped (SIGSTOP, a debugger), which
    tells the rank that hangs from the ranks waiting for it in a collective."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return {"T": ", stopped", "t": ", stopped", "Z": ", exited", "D": ", in uninterruptible I/O"}.get(state, "")


def _rank_env() -> dict[str, str]:
    """A rank process's environment: the controller's, gloo on loopback, and the
    controller's crash point never armed in a rank (`_crash` arms a rank's own)."""
    env = {k: v for k, v in os.environ.items() if k not in (crashpoints.ENV_VAR, crashpoints.SIGNAL_VAR)}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _crash(rank: int) -> list[str] | None:
    """The crash point tests arm in one rank: ROLLKEEP_RANK_CRASH_AT (a `rank.{op}` point,
    `rank.train:3`) with ROLLKEEP_RANK_CRASH_SIGNAL (KILL, or STOP for a rank that hangs) in
    rank ROLLKEEP_RANK_CRASH_RANK (default 1)."""
    if os.environ.get("ROLLKEEP_RANK_CRASH_AT") and rank == int(os.environ.get("ROLLKEEP_RANK_CRASH_RANK", "1")):
        return [os.environ["ROLLKEEP_RANK_CRASH_AT"], os.environ.get("ROLLKEEP_RANK_CRASH_SIGNAL", "KILL")]
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------
# 3. The trainer over the ranks
# ---------------------------------------------------------------------------------------


@dataclass
class ShardedSnapshot:
    """A sharded step boundary: each rank holds copies of its shards (`snapshot` op); `save`
    has them written, then writes trainer.json, rng.safetensors and the reference."""

    step: int
    ranks: RankGroup
    meta: dict[str, Any]
    rngs: list[Tensor]
    reference: dict[str, Tensor] | None
    shard_bytes: list[int] = field(default_factory=list)
    write_seconds: list[float] = field(default_factory=list)

    def save(self, dir: Path) -> None:
        dir = Path(dir)
        replies = self.ranks.call("save", {"dir": str(dir), "step": self.step})
        self.shard_bytes = [int(r["bytes"]) for r in replies]
        self.write_seconds = [float(r["seconds"]) for r in replies]
        bound = step_metadata(self.step)
        save_file({f"rank{r}": t for r, t in enumerate(self.rngs)}, dir / RNG_FILE, metadata=bound)
        if self.reference is not None:
            save_file(self.reference, dir / REFERENCE_FILE, metadata=bound)
        (dir / STATE_FILE).write_bytes(json.dumps(self.meta, indent=1, sort_keys=True).encode())


class ShardedTrainer:
    """The Trainer protocol (`base.Trainer`, plus the warm start's `sft_step`) over
    `world_size` ranks (module docstring). The ranks start on first use."""

    def __init__(self, local: GRPOTrainer, *, world_size: int, step_timeout_s: float,
                 spec: dict[str, Any], log_dir: Path | None = None, ray: RayPlacement | None = None) -> None:
        self.local, self.world_size, self.timeout_s = local, world_size, step_timeout_s
        self.name = local.name
        self.tokenizer = getattr(local, "tokenizer", None)
        self._spec, self._log_dir, self._ray = spec, log_dir, ray
        self._group: RankGroup | None = None
        self.last_step_seconds: list[float] = []
        self.publish_peak_extra_bytes = 0
        self._stale = False  # the ranks stepped since the last pull

    @property
    def model(self) -> Any:
        """The controller's whole copy of the model, holding the ranks' current weights."""
        self._fresh()
        return self.local.model

    @property
    def sft_steps(self) -> int:
        return self.local.sft_steps

    @property
    def rl_steps(self) -> int:
        return self.local.rl_steps

    @property
    def ranks(self) -> RankGroup:
        if self._group is None:
            self._group = RankGroup(self._spec, world_size=self.world_size, timeout_s=self.timeout_s,
                                    log_dir=self._log_dir, ray=self._ray)
            self._pull(check=True)  # the ranks built the controller's initial weights
        return self._group

    def info(self) -> dict[str, Any]:
        """`trainer_started`'s fields (the ranks start if they have not)."""
        group = self.ranks
        return {"world_size": self.world_size, "pids": group.pids, "backend": group.backend,
                "placement": group.placement}

    # -- steps ---------------------------------------------------------------------------

    def train_step(self, batch: Batch) -> dict[str, float]:
        local = self.local
        if local.kl_coef > 0 and local._reference is None:
            self.set_reference()  # as one process does: the weights before the first RL step
        rows, advs = flatten(batch, local.scale_rewards)
        n_tokens = sum(model_tokens(r.versions) for r in rows)
        parts = split_rows(rows, advs, world_size=self.world_size, micro_batch_size=local.micro_batch_size,
                           keep_micro_batches=local.loss_type == "bnpo")
        n_micro = -(-len(rows) // local.micro_batch_size)
        passes = max(len(p) for p in parts)
        payloads = [{"chunks": [[[pack_row(r) for r in c], [float(a) for a in a_]] for c, a_ in part],
                     "n_rows": len(rows), "n_tokens": n_tokens, "n_micro": n_micro, "passes": passes}
                    for part in parts]
        replies = self.ranks.call("train", payloads)
        local.rl_steps += 1
        local._set_lr()
        self._pull()
        self.last_step_seconds = [float(r["seconds"]) for r in replies]
        metrics = step_metrics(replies[0]["totals"], rows, advs, n_tokens, replies[0]["lr"],
                               local.ppo_epochs if n_tokens else 1)
        return metrics | self._rank_metrics()

    def sft_step(self, sequences: Sequence[tuple[list[int], list[int]]], *, lr: float) -> dict:
        local = self.local
        n_tokens = sum(len(t) for _, t in sequences)
        if n_tokens == 0:
            raise ValueError("sft_step needs at least one target token")
        mbs = local.micro_batch_size
        parts = [[[[list(p), list(t)] for p, t in sequences[i:min(i + mbs, run.stop)]]
                  for i in range(run.start, run.stop, mbs)]
                 for run in _runs([len(t) for _, t in sequences], self.world_size)]
        passes = max(len(p) for p in parts)
        replies = self.ranks.call("sft", [{"chunks": p, "n_tokens": n_tokens, "lr": lr, "passes": passes}
                                          for p in parts])
        if local._sft_optimizer is None:  # (its hyper-parameters go into trainer.json; the ranks hold its state)
            local._sft_optimizer = local._adamw(lr)
        for group in local._sft_optimizer.param_groups:
            group["lr"] = lr
        local.sft_steps += 1
        self._stale = True  # pulled when read: a warm start's weights are read at its end only
        self.last_step_seconds = [float(r["seconds"]) for r in replies]
        return {"loss": replies[0]["total"] / n_tokens, "tokens": float(n_tokens),
                "grad_norm": replies[0]["grad_norm"], "lr": float(lr)}

    def set_reference(self) -> None:
        if self.local.kl_coef > 0:
            self._fresh()
            self.local.set_reference()
            self.ranks.call("set_reference")

    def _rank_metrics(self) -> dict[str, float]:
        """Step time per rank (`rank{r}_step_s`), the slowest rank and its time (the metrics
        log prefixes them `trainer/`)."""
        secs = self.last_step_seconds
        slowest = max(range(len(secs)), key=secs.__getitem__)
        return {**{f"rank{r}_step_s": s for r, s in enumerate(secs)},
                "slowest_rank": float(slowest), "slowest_rank_step_s": secs[slowest]}

    # -- weights --------------------------------------------------------------------------

    def _pull(self, *, check: bool = False) -> None:
        """Copy the ranks' gathered weights into the controller's model, one whole tensor
        at a time as rank 0 streams them. `check`: they must equal it already."""
        target = self.local.model.state_dict()
        before = self.local.weights_sha256() if check else None
        got: set[str] = set()

        def each(msg: dict[str, Any]) -> None:
            name = msg["name"]
            if name not in target:
                raise RankRaised(f"trainer rank 0 sent a tensor {name!r} the model does not have")
            with torch.no_grad():
                target[name].copy_(unpack_tensor(msg["tensor"]))
            got.add(name)

        replies = self.ranks.call("weights", on_frame=each)
        self._stale = False
        self.publish_peak_extra_bytes = int(replies[0].get("peak_extra_bytes", 0))  # rank 0's, over the gather
        missing = set(_unique_state(target)[0]) - got
        if missing:
            raise RankRaised(f"trainer rank 0 gathered no {sorted(missing)[:3]}")
        if check and self.local.weights_sha256() != before:
            raise RankRaised("the trainer ranks built other initial weights than the controller's model "
                             f"(ties {replies[0].get('ties')})")

    def _fresh(self) -> None:
        """The controller's copy holds the ranks' weights (after warm-start steps, which
        do not pull each time)."""
        if self._stale:
            self._pull()

    def weights(self) -> dict[str, Tensor]:
        self._fresh()
        return self.local.weights()

    def weights_sha256(self) -> str:
        self._fresh()
        return self.local.weights_sha256()

    # -- checkpoint -----------------------------------------------------------------------

    def snapshot(self) -> ShardedSnapshot:
        self._fresh()
        local = self.local
        replies = self.ranks.call("snapshot")
        unique, ties = _unique_state(local.model.state_dict())
        optimizers = {"rl": local.optimizer}
        if local._sft_optimizer is not None:
            optimizers["sft"] = local._sft_optimizer
        reference = None
        if local._reference is not None:
            reference = {k: v.detach().clone() for k, v in _unique_state(local._reference.state_dict())[0].items()}
        meta = {
            "format": FORMAT, STEP_KEY: local.rl_steps, "rl_steps": local.rl_steps, "sft_steps": local.sft_steps,
            "ties": ties, "reference": reference is not None, "world_size": self.world_size,
            "optimizers": {name: {"param_groups": _optimizer_state(opt).param_groups, "scalars": {}}
                           for name, opt in optimizers.items()},  # (the state itself is the ranks')
        }
        return ShardedSnapshot(local.rl_steps, self.ranks, meta, [unpack_tensor(r["rng"]) for r in replies],
                               reference)

    def load(self, dir: Path, *, step: int | None = None) -> None:
        """Verify every file (the shards assembled and checked) against the controller's
        model, then have each rank load its part, then restore the controller's copy and
        check that the ranks hold the same weights."""
        local = self.local
        v = local.verify(dir, step=step)
        sharded = v.meta["format"] == FORMAT
        keys = [f"{opt}.state.{i}.{name}" for opt, per in v.optimizers.items() for i, names in per.items()
                for name in names]
        sft = v.meta["optimizers"].get("sft")
        payloads = [{"dir": str(dir), "sharded": sharded, "optimizer_keys": keys,
                     "rng": pack_tensor(v.rng.get(f"rank{r}", v.rng["rank0"])), "rl_steps": v.meta["rl_steps"],
                     "sft_steps": v.meta["sft_steps"], "has_sft": sft is not None,
                     "sft_lr": sft["param_groups"][0]["lr"] if sft else 0.0, "reference": v.meta["reference"],
                     "ties": v.meta["ties"]} for r in range(self.world_size)]
        self.ranks.call("load", payloads)
        local.restore(v)
        expected = local.weights_sha256()
        self._pull()
        if local.weights_sha256() != expected:
            raise RankRaised("the trainer ranks loaded other weights than the checkpoint holds")

    def close(self) -> None:
        if self._group is not None:
            self._group.close()

"""One data-parallel trainer rank (`trainer.world_size` > 1): a process of its own, started
by the controller (`ranks.RankGroup`) as `python -m rollkeep.trainers.rank SPEC FD`, or a
Ray actor (`RankActor`, `cluster.backend: ray`) that connects back to the controller.

It joins the gloo (CPU) or nccl (GPU) process group, builds the same model the controller
builds (same seed: the same initial weights, which the controller checks), shards it with
FSDP2 (`fully_shard` per transformer block, then the root; AdamW state lives on the
shards), and serves the controller's ops (`rankwire`) one at a time until `exit` or until
the controller's socket closes. It dies with the controller (PR_SET_PDEATHSIG): a rank
never outlives the custody owner.

Ops: `train` / `sft` (its part of a step: `GRPOTrainer.update` / `sft_update` with the
whole batch's counts), `set_reference`, `weights` (rank 0 streams each whole tensor to the
controller as the ranks gather it: one whole tensor at a time, never the whole model twice),
`snapshot` (copies of the local shards at the step boundary), `save` (those copies through
`torch.distributed.checkpoint` into the checkpoint's `trainer/shards/`), `load` (a sharded
checkpoint through DCP's resharding, or a one-process one by slicing its whole tensors),
`exit`.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from ..core import crashpoints
from .grpo import GRPOTrainer, hyperparameters
from .rankwire import Closed, pack_tensor, recv, send, unpack_row, unpack_tensor
from .shards import MODEL_PREFIX, OPTIMIZER_PREFIX, SHARD_DIR, step_key

__all__ = ["RANK_POINTS", "RankActor", "RankTrainer", "main", "run"]

# The crash points of a rank: one before each op it serves.
RANK_POINTS = tuple(crashpoints.register(f"rank.{op}") for op in
                    ("train", "sft", "set_reference", "weights", "snapshot", "save", "load"))


class RankTrainer(GRPOTrainer):
    """GRPO on one rank's shards. The batch arrives split (`ranks.split_rows`); each loss
    part is normalised by the whole batch's counts, and FSDP's reduce-scatter averages the
    ranks' gradients, so each part is backpropagated times world_size: the ranks' gradients
    then sum to the one-process gradient of the whole batch."""

    def __init__(self, *, model: nn.Module, make_plain: Any, rank: int, world_size: int, **kw: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            model = model.cuda()
        self.mesh = init_device_mesh(device, (world_size,))
        for layer in _layers(model):
            fully_shard(layer, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        self.rank, self.world_size = rank, world_size
        self._make_plain = make_plain  # an unsharded model of the same shape (the KL reference)
        self._snap: dict[str, Tensor] | None = None
        super().__init__(model=model, **kw)

    # -- the seams of GRPOTrainer ---------------------------------------------------------

    def _backward(self, loss: Tensor) -> None:
        (loss * self.world_size).backward()

    def _idle_loss(self) -> Tensor:
        """A pass that weighs nothing: this rank has fewer micro-batches than the busiest,
        and FSDP's collectives need every rank in every forward and backward."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        return self.logits_fn(self.model, ids, torch.ones_like(ids)).sum() * 0.0

    def _clip_grad_norm(self) -> float:
        norm = nn.utils.clip_grad_norm_(self._params, self.grad_clip)
        return float(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())

    def set_reference(self) -> None:
        """The KL reference: a whole, unsharded frozen copy on every rank (no collectives
        in its forward; it costs one model's memory per rank)."""
        if self.kl_coef > 0:
            self._reference = self._frozen(self.gather())

    def _frozen(self, state: dict[str, Tensor]) -> nn.Module:
        ref = self._make_plain()
        ref.load_state_dict(state, strict=True)
        ref.requires_grad_(False)
        return ref.to(self.device).eval()

    # -- whole tensors, snapshot, save, load ------------------------------------------------

    def unique_state(self) -> tuple[dict[str, Tensor], dict[str, str]]:
        """The model's state dict, each tensor once (a tied weight is one parameter object
        under two names), and the ties."""
        unique: dict[str, Tensor] = {}
        ties: dict[str, str] = {}
        seen: dict[int, str] = {}
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, t in self.model.state_dict().items():
            t = params.get(name, t)  # (the state dict's tensors are fresh views: not identical when tied)
            if id(t) in seen:
                ties[name] = seen[id(t)]
            else:
                seen[id(t)] = name
                unique[name] = t
        return unique, ties

    def gather(self, each: Any = None) -> dict[str, Tensor]:
        """Every whole tensor (a collective: all ranks call it). With `each(name, tensor)`,
        each whole tensor is handed over and dropped (rank 0 streams); else returned."""
        unique, ties = self.unique_state()
        out: dict[str, Tensor] = {}
        for name, t in unique.items():
            whole = t.full_tensor() if hasattr(t, "full_tensor") else t
            if each is not None:
                each(name, whole)
            else:
                out[name] = whole.detach().cpu()
        for name, to in ties.items():
            if each is None:
                out[name] = out[to]
        return out

    def optimizer_tensors(self) -> dict[str, Tensor]:
        """Every optimizer state tensor under its checkpoint name."""
        out = {}
        for opt_name, opt in (("rl", self.optimizer), ("sft", self._sft_optimizer)):
            if opt is None:
                continue
            for i, p in enumerate(self._params):
                for k, v in opt.state.get(p, {}).items():
                    out[f"{OPTIMIZER_PREFIX}{opt_name}.state.{i}.{k}"] = v
        return out

    def take_snapshot(self) -> None:
        unique, _ = self.unique_state()
        state = {MODEL_PREFIX + n: t for n, t in unique.items()} | self.optimizer_tensors()
        self._snap = {k: v.detach().clone() for k, v in state.items()}

    def save_shard(self, dir: Path, step: int) -> int:
        """This rank's shard of the last snapshot into dir/shards/ (DCP, safetensors)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        if self._snap is None:
            raise RuntimeError("save without a snapshot")
        state = dict(self._snap)
        state[step_key(self.rank)] = torch.tensor([step], dtype=torch.int64)
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(Path(dir) / SHARD_DIR), save_distributed=True))
        self._snap = None
        return sum(p.stat().st_size for p in (Path(dir) / SHARD_DIR).glob(f"shard-{self.rank + 1:05d}-*"))

    def load_state(self, msg: dict[str, Any]) -> None:
        """Restore from a checkpoint the controller has verified (`ShardedTrainer.load`)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        dir = Path(msg["dir"])
        if msg["has_sft"] and self._sft_optimizer is None:
            self._sft_optimizer = self._adamw(msg["sft_lr"])
        elif not msg["has_sft"]:
            self._sft_optimizer = None
        unique, _ = self.unique_state()
        template: dict[str, Tensor] = {MODEL_PREFIX + n: t for n, t in unique.items()}
        fresh: dict[Any, dict[str, Tensor]] = {}
        for key in msg["optimizer_keys"]:  # "{opt}.state.{i}.{name}", as verified
            opt_name, _, i, name = key.split(".")
            p = self._params[int(i)]
            t = torch.zeros((), dtype=torch.float32) if name == "step" else torch.zeros_like(p)  # (step: 0-d, CPU)
            fresh.setdefault((opt_name, int(i)), {})[name] = t
            template[OPTIMIZER_PREFIX + key] = t
        with torch.no_grad():
            if msg["sharded"]:
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint import HuggingFaceStorageReader

                dcp.load(template, storage_reader=HuggingFaceStorageReader(str(dir / SHARD_DIR)))
            else:
                from safetensors import safe_open

                with safe_open(str(dir / "model.safetensors"), "pt") as fm, \
                        safe_open(str(dir / "optimizer.safetensors"), "pt") as fo:
                    for key, t in template.items():
                        f, name = (fm, key[len(MODEL_PREFIX):]) if key.startswith(MODEL_PREFIX) else \
                            (fo, key[len(OPTIMIZER_PREFIX):])
                        whole = f.get_tensor(name).to(t.device)
                        if isinstance(t, DTensor):  # this rank's slice, computed here (no communication)
                            whole = distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None)
                            t.to_local().copy_(whole.to_local())
                        else:
                            t.copy_(whole)
        for opt_name, opt in (("rl", self.optimizer), ("sft", self._sft_optimizer)):
            if opt is not None:
                opt.state.clear()  # (torch's optimizers keep a defaultdict: kept, refilled)
                opt.state.update({p: fresh[(opt_name, i)] for i, p in enumerate(self._params) if (opt_name, i) in fresh})
        torch.set_rng_state(unpack_tensor(msg["rng"]))
        self.rl_steps, self.sft_steps = msg["rl_steps"], msg["sft_steps"]
        self._set_lr()
        self._reference = None
        if msg["reference"]:
            from safetensors.torch import load_file

            saved = load_file(str(dir / "reference.safetensors"))
            names = self.model.state_dict().keys()
            self._reference = self._frozen({k: saved[msg["ties"].get(k, k)] for k in names})


def _layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, each its own FSDP unit (the built-in GPT's `blocks`, a
    transformers model's decoder `layers`); the root holds the rest (embeddings, tied head)."""
    for path in ("blocks", "model.layers", "transformer.h", "gpt_neox.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, nn.ModuleList):
            return list(obj)
    return []


def _build(spec: dict[str, Any]) -> RankTrainer:
    if spec["trainer"]["name"] == "hf":
        from ..config import HFTrainerConfig
        from ..models.hf import load_pretrained

        cfg: Any = HFTrainerConfig.model_validate(spec["trainer"])
        tok, model = load_pretrained(cfg.model_path, field="trainer.model_path", dtype=cfg.dtype)

        def make_plain() -> nn.Module:
            return load_pretrained(cfg.model_path, field="trainer.model_path", dtype=cfg.dtype)[1]

        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        logits_fn = lambda m, ids, mask: m(input_ids=ids, attention_mask=mask).logits  # noqa: E731
    else:
        from ..config import TorchTrainerConfig
        from ..models.gpt import GPT, GPTConfig
        from ..models.tokenizer import PAD

        cfg = TorchTrainerConfig.model_validate(spec["trainer"])
        gpt = GPTConfig(**spec["gpt"])

        def make_plain() -> nn.Module:
            return GPT(gpt)

        torch.manual_seed(spec["seed"])  # as the controller builds it: the same initial weights
        model = GPT(gpt)
        pad, logits_fn = PAD, (lambda m, ids, mask: m(ids))
    return RankTrainer(model=model, make_plain=make_plain, rank=spec["rank"], world_size=spec["world_size"],
                       logits_fn=logits_fn, pad_id=pad, temperature=spec["temperature"], seed=spec["seed"],
                       max_completion_length=spec["max_completion_length"], **hyperparameters(cfg))


def _serve(trainer: RankTrainer, sock: socket.socket) -> None:
    rank = trainer.rank

    def summed(values: list[float], op: Any = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return t.tolist()

    while True:
        try:
            msg = recv(sock)
        except Closed:
            return
        op, t0 = msg.get("op"), time.perf_counter()
        crashpoints.hit(f"rank.{op}")  # (tests kill or stop a rank here: ranks._rank_env)
        try:
            reply: dict[str, Any] = {"ok": True}
            if op == "train":
                chunks = [([unpack_row(r) for r in rows], advs) for rows, advs in msg["chunks"]]
                totals, lr = trainer.update(chunks, n_rows=msg["n_rows"], n_tokens=msg["n_tokens"],
                                            n_micro=msg["n_micro"], passes=msg["passes"])
                # Parts add up across ranks, maxima are maxima; the norm is global already.
                # (Every rank has the same keys: `update` starts from a fixed set.)
                keys = [k for k in totals if k != "grad_norm" and not k.endswith("_max")]
                maxed = [k for k in totals if k.endswith("_max")]
                reply |= {"totals": dict(zip(keys, summed([totals[k] for k in keys]), strict=True))
                          | dict(zip(maxed, summed([totals[k] for k in maxed], dist.ReduceOp.MAX), strict=True))
                          | {"grad_norm": totals["grad_norm"]}, "lr": lr}
            elif op == "sft":
                total, norm = trainer.sft_update(msg["chunks"], n_tokens=msg["n_tokens"], lr=msg["lr"],
                                                 passes=msg["passes"])
                reply |= {"total": summed([total])[0], "grad_norm": norm}
            elif op == "set_reference":
                trainer.set_reference()
            elif op == "weights":
                def stream(name: str, whole: Tensor) -> None:
                    if rank == 0:
                        send(sock, {"ok": True, "more": True, "name": name, "tensor": pack_tensor(whole)})
                base = _rss_peak(reset=True)
                trainer.gather(stream)
                reply |= {"ties": trainer.unique_state()[1], "peak_extra_bytes": max(0, _rss_peak() - base)}
            elif op == "snapshot":
                trainer.take_snapshot()
                reply["rng"] = pack_tensor(torch.get_rng_state())
            elif op == "save":
                reply["bytes"] = trainer.save_shard(Path(msg["dir"]), msg["step"])
            elif op == "load":
                trainer.load_state(msg)
            elif op == "exit":
                send(sock, reply)
                return
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:
            reply = _error(e)
        except BaseException as e:  # DCP reports a failed save or load as a CheckpointException (a BaseException)
            if isinstance(e, SystemExit | KeyboardInterrupt):
                raise
            reply = _error(e)
        reply["seconds"] = time.perf_counter() - t0
        send(sock, reply)


def _error(e: BaseException) -> dict[str, Any]:
    """The reply for an op that raised; with the OSError behind it (a full disk, a failed
    fsync: `errno`, `strerror`, `filename`), which the controller raises as an OSError."""
    reply: dict[str, Any] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                             "traceback": traceback.format_exc()[-8000:]}
    cause = _os_error(e)
    if cause is not None and cause.errno is not None:
        reply |= {"errno": cause.errno, "strerror": cause.strerror or str(cause),
                  "filename": None if cause.filename is None else str(cause.filename)}
    return reply


def _os_error(e: BaseException | None, depth: int = 0) -> OSError | None:
    """The OSError `e` is, wraps (`__cause__`, `__context__`) or, for DCP's
    CheckpointException, one of its ranks' failures holds."""
    if e is None or depth > 8:
        return None
    if isinstance(e, OSError):
        return e
    failures = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]  # (exc, stack)
    for inner in (*failures, e.__cause__, e.__context__):
        if isinstance(inner, BaseException) and (found := _os_error(inner, depth + 1)) is not None:
            return found
    return None


def _rss_peak(*, reset: bool = False) -> int:
    """This process's peak resident bytes since the last reset (Linux: VmHWM; reset by
    writing 5 to clear_refs, after which the peak is the current size); 0 elsewhere."""
    try:
        if reset:
            Path("/proc/self/clear_refs").write_text("5")
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the controller dies (Linux); a rank never outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the call took effect
        os._exit(1)


def run(spec: dict[str, Any], sock: socket.socket) -> None:
    """Join the process group, build, say hello, serve until `exit` or the socket closes."""
    if spec.get("crash"):  # a crash point armed in this rank by a test (ranks._crash)
        os.environ[crashpoints.ENV_VAR], os.environ[crashpoints.SIGNAL_VAR] = spec["crash"]
        crashpoints._reload_from_env()
    torch.set_num_threads(spec["threads"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{spec['port']}", rank=spec["rank"],
                            world_size=spec["world_size"], timeout=timedelta(seconds=spec["timeout_s"]))
    try:
        try:
            trainer = _build(spec)
        except Exception as e:
            send(sock, {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                        "traceback": traceback.format_exc()[-8000:]})
            return
        send(sock, {"ok": True, "pid": os.getpid(), "backend": backend})
        _serve(trainer, sock)
    finally:
        sock.close()
        dist.destroy_process_group()


class RankActor:
    """A rank as a Ray actor (`cluster.backend: ray`): its process is Ray's worker; the rank
    runs on a thread of it, connected to the controller over loopback TCP (the controller
    listens, the rank connects and names itself with the group's token). Ray ends it with
    the driver."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import threading

        host, port, token = spec["connect"]
        sock = socket.create_connection((host, port), timeout=60)
        sock.settimeout(None)
        send(sock, {"token": token, "rank": spec["rank"]})
        self._thread = threading.Thread(target=self._run, args=(spec, sock), name="rollkeep-rank", daemon=True)
        self._thread.start()

    @staticmethod
    def _run(spec: dict[str, Any], sock: socket.socket) -> None:
        try:
            run(spec, sock)
        finally:
            os._exit(0)  # the rank is done: so is its worker (Ray would otherwise reuse it)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv if argv is None else argv
    spec = json.loads(argv[1])
    _die_with_parent(spec["parent"])
    run(spec, socket.socket(fileno=int(argv[2])))


if __name__ == "__main__":
    main()

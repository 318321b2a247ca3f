"""The GRPO trainer's checkpoint: `GRPOSnapshot` (what `GRPOTrainer.snapshot` copies), the
files it writes, and the checks `GRPOTrainer.load` runs on reading them back before it
changes anything.

Checkpoint files (`snapshot().save(dir)`; docs/design.md §4: no pickle)
-----------------------------------------------------------------------
    model.safetensors      the model's state dict, each storage once: a tied tensor (GPT's
                           `head.weight` is `wte.weight`) is saved under its first name in
                           state-dict order only; `trainer.json` lists the ties and `load`
                           checks them against the model
    optimizer.safetensors  every optimizer state tensor as `{opt}.state.{param_index}.{name}`
                           with opt `rl` (the GRPO AdamW) or `sft` (the warm-start AdamW)
    trainer.json           format, step counters, ties, and per optimizer its param_group
                           hyper-parameters (recorded; the config, not the file, sets them
                           on load: the restore chain's config check guards changes) and
                           any non-tensor state
    rng.safetensors        `cpu`: the torch CPU generator state (uint8); it drives dropout.
                           (CUDA generators are not captured: this trainer's models run
                           on CPU; a GPU subclass must add them.)
    reference.safetensors  the KL reference's weights, when one exists

Every file declares the step its state is of (`rollkeep_step`: in trainer.json, and in
each safetensors file's metadata), which is `rl_steps`, the weight version; `load(dir,
step=N)` refuses a file of another step, so trainer files copied from another checkpoint
never load under a ledger of a different version.

`load` checks every file and tensor (presence, parse, names, dtypes, shapes, ties) before
it changes anything, then restores model, optimizers (moments and step counts), RNG,
counters and reference bit-exactly. Any problem raises CheckpointError naming the file
and the tensor.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file
from torch import Tensor

from ..core.checkpoint.cut import STEP_KEY, declared_step_of, step_metadata
from ..core.errors import CheckpointError
from ..core.io.untrusted import loads_json, read_regular
from .base import check_step
from .shards import FORMAT as SHARDED_FORMAT

MAX_WORLD_SIZE = 64  # trainer.world_size's bound

__all__ = ["GRPOSnapshot", "OptimizerState", "TrainerFiles"]


# ---------------------------------------------------------------------------------------
# 1. The snapshot and its files
# ---------------------------------------------------------------------------------------

FORMAT = "rollkeep.grpo/1"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer.json"
RNG_FILE = "rng.safetensors"
REFERENCE_FILE = "reference.safetensors"
ALL_FILES = (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, RNG_FILE, REFERENCE_FILE)
SHARDED_FILES = (STATE_FILE, RNG_FILE, REFERENCE_FILE)  # and shards/*: `shards`
OPTIMIZER_NAMES = ("rl", "sft")


@dataclass(frozen=True)
class OptimizerState:
    """One optimizer's state: tensors keyed `state.{param_index}.{name}`, the non-tensor
    state values under the same keys, and the hyper-parameters of its param groups."""

    tensors: dict[str, Tensor]
    scalars: dict[str, float | int | bool]
    param_groups: list[dict[str, Any]]


@dataclass(frozen=True)
class GRPOSnapshot:
    model: dict[str, Tensor]  # unique tensors only (see ties)
    ties: dict[str, str]  # tied name -> the saved name it shares storage with
    optimizers: dict[str, OptimizerState]  # "rl", and "sft" once the warm start ran
    rl_steps: int
    sft_steps: int
    rng: Tensor  # torch.get_rng_state(), uint8
    reference: dict[str, Tensor] | None

    @property
    def step(self) -> int:
        """The weight version this state is of: RL steps taken (the warm start is step 0)."""
        return self.rl_steps

    def save(self, dir: Path) -> None:
        """Write the files into `dir` (on the checkpoint writer's thread): safetensors and
        JSON only, each tensor file straight to disk (no second copy in memory)."""
        optimizer_tensors = {
            f"{opt}.{key}": t for opt, s in self.optimizers.items() for key, t in s.tensors.items()
        }
        meta = {
            "format": FORMAT,
            STEP_KEY: self.rl_steps,
            "rl_steps": self.rl_steps,
            "sft_steps": self.sft_steps,
            "ties": self.ties,
            "reference": self.reference is not None,
            "optimizers": {
                opt: {"param_groups": s.param_groups, "scalars": s.scalars}
                for opt, s in self.optimizers.items()
            },
        }
        bound = step_metadata(self.rl_steps)  # each file says which step it is of
        dir = Path(dir)
        st_save_file(self.model, dir / MODEL_FILE, metadata=bound)
        st_save_file(optimizer_tensors, dir / OPTIMIZER_FILE, metadata=bound)
        (dir / STATE_FILE).write_bytes(json.dumps(meta, indent=1, sort_keys=True).encode())
        st_save_file({"cpu": self.rng}, dir / RNG_FILE, metadata=bound)
        if self.reference is not None:
            st_save_file(self.reference, dir / REFERENCE_FILE, metadata=bound)


@dataclass(frozen=True)
class Verified:
    """What `GRPOTrainer.verify` read and checked: trainer.json, the model's unique tensors,
    the optimizer states ({opt: {param_index: {name: value}}}), the generator state of each
    rank that wrote it (`rank0`, … ; a one-process checkpoint's is `rank0`) and the
    reference's tensors."""

    meta: dict[str, Any]
    model: dict[str, Tensor]
    optimizers: dict[str, dict[int, dict[str, Any]]]
    rng: dict[str, Tensor]
    reference: dict[str, Tensor] | None


class TrainerFiles:
    """The files of a trainer directory, as `load` reads them: names relative to it
    (recursive; an entry that is neither a regular file nor a directory is listed under its
    name, so `load` refuses it as unknown), read without following a symlink."""

    def __init__(self, dir: Path) -> None:
        self.dir = Path(dir)
        try:
            self.names = sorted(self._walk(""))
        except OSError as e:
            raise _bad("", "The trainer directory cannot be listed", expected="a directory",
                       found=e.strerror or str(e)) from None

    def _walk(self, rel: str) -> Iterator[str]:
        with os.scandir(self.dir / rel if rel else self.dir) as it:
            for e in it:
                name = f"{rel}/{e.name}" if rel else e.name
                if e.is_dir(follow_symlinks=False):
                    yield from self._walk(name)
                else:
                    yield name

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def path(self, name: str) -> Path:
        return self.dir / name

    def read(self, name: str) -> bytes:
        return read_regular(self.dir / name)


def _unique_state(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Split a state dict into its unique tensors and ties (name -> earlier name that is the
    same tensor view: same storage, offset, shape, stride and dtype)."""
    unique: dict[str, Tensor] = {}
    ties: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(),
                 tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and ident in seen:
            ties[name] = seen[ident]
        else:
            seen[ident] = name
            unique[name] = t
    return unique, ties


def _clone(t: Tensor) -> Tensor:
    return t.detach().clone(memory_format=torch.contiguous_format)



def _optimizer_state(opt: Any) -> OptimizerState:
    """Copies of an optimizer's state, params numbered as `Optimizer.state_dict` does."""
    params = [p for group in opt.param_groups for p in group["params"]]
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, float | int | bool] = {}
    for i, p in enumerate(params):
        for name, value in opt.state.get(p, {}).items():
            if torch.is_tensor(value):
                tensors[f"state.{i}.{name}"] = _clone(value)
            else:
                scalars[f"state.{i}.{name}"] = value
    groups = [
        json.loads(json.dumps({k: v for k, v in g.items() if k != "params"}))
        for g in opt.param_groups
    ]
    return OptimizerState(tensors, scalars, groups)


# ---------------------------------------------------------------------------------------
# 2. Reading the files back: check everything, name the file and the tensor
# ---------------------------------------------------------------------------------------

_REMEDY_CORRUPT = (
    "the trainer files of this checkpoint are damaged or were not written by this rollkeep; "
    "restore from an older checkpoint, or start the run fresh."
)
_REMEDY_SHAPE = (
    "the checkpoint was written for a different model or optimizer; resume with the model "
    "config of the run that wrote it (trainer.model), or start the run fresh."
)


def _bad(file: str, what: str, *, field: str | None = None, expected: str | None = None,
         found: str | None = None, remedy: str = _REMEDY_CORRUPT) -> CheckpointError:
    return CheckpointError(what, path=f"trainer/{file}", field=field, expected=expected,
                           found=found, remedy=remedy)


def _read_tensors(files: TrainerFiles, name: str) -> dict[str, Tensor]:
    if name not in files:
        raise _bad(name, f"The trainer file {name} is missing", expected=f"a file {name}",
                   found=f"only {sorted(files)}")
    try:
        if not stat.S_ISREG(os.lstat(files.path(name)).st_mode):  # no symlink, never a FIFO
            raise ValueError("not a regular file")
        return st_load_file(files.path(name))  # mmap'd, not read into a second buffer
    except Exception as err:  # SafetensorError, or whatever a malformed header provokes
        raise _bad(name, f"{name} is not a readable safetensors file",
                   expected="a complete safetensors file", found=f"{type(err).__name__}: {err}"
                   ) from None


def _check_tensors(found: Mapping[str, Tensor], expected: Mapping[str, Tensor], file: str) -> None:
    """`found` must have exactly `expected`'s names, each with its dtype and shape."""
    for name, want in expected.items():
        if name not in found:
            raise _bad(file, f"Tensor {name!r} is missing", field=name,
                       expected=f"{want.dtype} {list(want.shape)}",
                       found=f"{len(found)} other tensors", remedy=_REMEDY_SHAPE)
        got = found[name]
        if got.dtype != want.dtype or got.shape != want.shape:
            raise _bad(file, f"Tensor {name!r} has the wrong dtype or shape", field=name,
                       expected=f"{want.dtype} {list(want.shape)}",
                       found=f"{got.dtype} {list(got.shape)}", remedy=_REMEDY_SHAPE)
    for name in found:
        if name not in expected:
            raise _bad(file, f"Unexpected tensor {name!r}", field=name,
                       expected=f"only the {len(expected)} tensors of this model", found=name,
                       remedy=_REMEDY_SHAPE)


def _read_meta(files: TrainerFiles) -> dict[str, Any]:
    if STATE_FILE not in files:
        raise _bad(STATE_FILE, f"The trainer file {STATE_FILE} is missing",
                   found=f"only {sorted(files)}")
    try:
        meta = loads_json(files.read(STATE_FILE))
    except OSError as err:
        raise _bad(STATE_FILE, f"{STATE_FILE} cannot be read", expected="a regular file",
                   found=err.strerror or str(err)) from None
    except ValueError as err:
        raise _bad(STATE_FILE, f"{STATE_FILE} is not valid JSON", found=str(err)) from None
    shape = {"format": str, "rl_steps": int, "sft_steps": int, "ties": dict,
             "reference": bool, "optimizers": dict}
    if not isinstance(meta, dict):
        raise _bad(STATE_FILE, f"{STATE_FILE} is not a JSON object", found=type(meta).__name__)
    if STEP_KEY in meta:  # absent in files written before the binding
        shape[STEP_KEY] = int
    if meta.get("format") == SHARDED_FORMAT:  # trainer.world_size > 1 (`shards`)
        shape.update({STEP_KEY: int, "world_size": int})
    for key, typ in shape.items():
        value = meta.get(key)
        if not isinstance(value, typ) or (typ is int and (isinstance(value, bool) or value < 0)):
            raise _bad(STATE_FILE, f"Field {key!r} is missing or of the wrong type", field=key,
                       expected=typ.__name__ + (" >= 0" if typ is int else ""),
                       found=repr(value)[:80])
    if meta["format"] not in (FORMAT, SHARDED_FORMAT):
        raise _bad(STATE_FILE, "Unsupported trainer checkpoint format", field="format",
                   expected=f"{FORMAT} or {SHARDED_FORMAT}", found=repr(meta["format"]))
    if meta["format"] == SHARDED_FORMAT and not 1 <= meta["world_size"] <= MAX_WORLD_SIZE:
        raise _bad(STATE_FILE, "world_size is out of range", field="world_size",
                   expected=f"1 ... {MAX_WORLD_SIZE}", found=str(meta["world_size"]))
    if set(meta) != set(shape):
        raise _bad(STATE_FILE, "Unknown fields", expected=str(sorted(shape)),
                   found=str(sorted(set(meta) - set(shape))))
    opts = meta["optimizers"]
    if "rl" not in opts or not set(opts) <= set(OPTIMIZER_NAMES):
        raise _bad(STATE_FILE, "Wrong optimizer list", field="optimizers",
                   expected='"rl", optionally "sft"', found=str(sorted(opts)))
    for opt, entry in opts.items():
        groups = entry.get("param_groups") if isinstance(entry, dict) else None
        if not (isinstance(groups, list) and len(groups) == 1 and isinstance(groups[0], dict)
                and isinstance(groups[0].get("lr"), float | int)
                and isinstance(entry.get("scalars"), dict)):
            raise _bad(STATE_FILE, f"Optimizer {opt!r} is malformed", field=f"optimizers.{opt}",
                       expected='{"param_groups": [{"lr": <float>, ...}], "scalars": {...}}',
                       found=repr(entry)[:120])
    return meta


def _check_steps(files: TrainerFiles, meta: Mapping[str, Any], step: int | None) -> None:
    """Every file declares the same step: `rl_steps` (trainer.json's `rollkeep_step`, and
    each safetensors file's metadata). A file copied from another checkpoint is refused."""
    bound = STEP_KEY in meta
    if bound and meta[STEP_KEY] != meta["rl_steps"]:
        raise _bad(STATE_FILE, f"{STEP_KEY} and rl_steps disagree", field=STEP_KEY,
                   expected=str(meta["rl_steps"]), found=str(meta[STEP_KEY]))
    check_step(STATE_FILE, meta["rl_steps"], step)
    for name in files:
        if not name.endswith(".safetensors") or name.startswith("shards/"):
            continue  # (a shard is bound by its own step tensor: `shards.read_shards`)
        try:
            declared = declared_step_of(files.path(name))  # the header only
        except (OSError, ValueError) as err:
            raise _bad(name, f"{name} is not a readable safetensors file", found=str(err)) from None
        if bound or declared is not None:
            check_step(name, declared, meta["rl_steps"])


def _read_optimizers(
    tensors: Mapping[str, Tensor], meta: Mapping[str, Any], params: Sequence[Tensor]
) -> dict[str, dict[int, dict[str, Any]]]:
    """optimizer.safetensors' tensors (+ scalars) -> {opt: {param_index: {name: value}}},
    checked: known optimizers, indices in range, moments shaped like their parameter, 0-d
    steps."""
    out: dict[str, dict[int, dict[str, Any]]] = {opt: {} for opt in meta["optimizers"]}
    values = list(tensors.items())
    for opt, entry in meta["optimizers"].items():
        values += [(f"{opt}.{k}", v) for k, v in entry["scalars"].items()]
    for key, value in values:
        opt, _, rest = key.partition(".")
        parts = rest.split(".")
        field = key
        if opt not in out or len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
            raise _bad(OPTIMIZER_FILE, f"Unexpected optimizer state {key!r}", field=field,
                       expected=f"{{opt}}.state.{{param_index}}.{{name}}, opt in {sorted(out)}",
                       found=key)
        index, name = int(parts[1]), parts[2]
        if index >= len(params):
            raise _bad(OPTIMIZER_FILE, f"Optimizer state {key!r} names no parameter", field=field,
                       expected=f"param_index < {len(params)}", found=str(index),
                       remedy=_REMEDY_SHAPE)
        p = params[index]
        if torch.is_tensor(value):
            want = (torch.Size([]), None) if name == "step" else (p.shape, p.dtype)
            if value.shape != want[0] or (want[1] is not None and value.dtype != want[1]):
                raise _bad(OPTIMIZER_FILE, f"Optimizer state {key!r} does not fit parameter "
                           f"{index}", field=field,
                           expected=f"shape {list(want[0])}" + (f" {want[1]}" if want[1] else ""),
                           found=f"shape {list(value.shape)} {value.dtype}",
                           remedy=_REMEDY_SHAPE)
            value = value.clone()  # the optimizer updates it in place
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad(STATE_FILE, f"Optimizer scalar {key!r} is not a number", field=field,
                       found=repr(value)[:80])
        out[opt].setdefault(index, {})[name] = value
    return out


def _torch_optimizer_state(opt: Any, state: dict[int, dict[str, Any]]) -> dict:
    """`Optimizer.load_state_dict` input: the checkpoint's state with this optimizer's own
    param groups (hyper-parameters come from the config)."""
    groups, start = [], 0
    for g in opt.param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(start, start + n))})
        start += n
    return {"state": state, "param_groups": groups}

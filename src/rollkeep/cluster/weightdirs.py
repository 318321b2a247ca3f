"""Weight directories: the trainer's weights on disk, in the form an inference server loads
(server mode; the wire contract's last section).

Layout::

    RUN_DIR/weights/
        v12/                        one published weight version
            config.json             copied from the source model directory
            model.safetensors       the weights, under exactly the tensor names of the
                                    source's checkpoint file(s)
            tokenizer.json ...      the tokenizer, generation and chat-template files of
                                    COPIED that the source has, copied
            WEIGHTS.json            written last: {"version": 12,
                                    "files": {name: {"size": int, "sha256": hex}},
                                    "digest": hex}
        v12.tmp-HEX/                a publication under way, or one that crashed
        v12.bad-HEX/                a damaged (or stale) v12 moved aside to be replaced

`digest` is the sha256 of the listing `"<sha256>  <name>\\n"` of every file but WEIGHTS.json,
sorted by name: `sha256sum`'s own format, so in a shell ::

    cd RUN_DIR/weights/v12 && LC_ALL=C sha256sum $(LC_ALL=C ls | grep -vx WEIGHTS.json) | sha256sum

prints it. A server is set to the version label `rollkeep:<N>:<digest[:16]>` (`WeightsDir.label`).

`model.safetensors` holds the names the source model's checkpoint holds, no more, no fewer:
a tied duplicate the original left out (GPT-2's `lm_head.weight`, the same tensor as
`transformer.wte.weight`) is left out here too, so `from_pretrained(v12)` and a server's
weight loader see the layout they already read at start-up. Tensors are written contiguous,
in the dtype they have (the trainer's float32 master weights) or cast to `dtype` (bf16 for
serving; floating-point tensors only). `config.json` is copied as it is.


Atomic publication
==================

Assumptions: those of the checkpoint store (A1-A6 in `rollkeep.core.checkpoint.store`):
rename is atomic, fsync makes a file's bytes or a directory's entries durable, all of
`weights/` is on one filesystem, the process may stop between any two system calls, an
fsync that failed may have lost data. One writer (the controller) per `weights/`; readers
(servers, `load_state_dict`) may come at any time and trust only a directory that verifies.

Steps of `publish(run_dir, N, state_dict, source_dir=...)`:

W1. Read the source: the safetensors headers of its checkpoint file(s), the files of COPIED
    it has (config.json is required). Match `state_dict` to the headers' names, shapes and
    dtypes, and lay out `model.safetensors`'s header. Nothing on disk has changed; a
    mismatch raises WeightsSourceError.
W2. Create `weights/` if needed and fsync `RUN_DIR` (every publication: an earlier process
    may have died before the name was durable). fsync `weights/`, then remove the leftovers
    of earlier runs (`v*.tmp-*`, `v*.bad-*`); a leftover that cannot be removed stays for
    the next publication (`retain` reports such failures).
W3. If `vN/` exists, verify it and hash what this publication would write (no write): if it
    verifies and holds exactly these files (the same digest), return it; nothing is written.
    A restore republishes only what is missing, damaged or stale (a `vN/` of a timeline
    abandoned by `--resume-from` verifies but holds other weights).
W4. Create `vN.tmp-HEX/`; write each copied file and fsync it; stream `model.safetensors`
    (header, then one tensor at a time, hashed as written) and fsync it. [weights.file_written]
W5. Write WEIGHTS.json, fsync it, fsync `vN.tmp-HEX/`.                 [weights.manifest_written]
    WEIGHTS.json is written last, so a directory with one has all its files, durable.
W6. If `vN/` exists (it failed W3), rename it to `vN.bad-HEX`.
W7. **Rename `vN.tmp-HEX/` to `vN/` and fsync `weights/`: the commit point.**
                                                                       [weights.dir_renamed]
    Then remove `vN.bad-HEX/` (a failure to is not an error: W2 of the next publication).

What a crash leaves: before W6, any `vN/` that was there, untouched, and a `vN.tmp-HEX/`
(W4-W5). Between W6 and W7, no `vN/` (and `vN.bad-HEX/`). After the rename of W7, the new
`vN/` (a power cut before its fsync: the new `vN/`, or none, the rename not yet durable).
So at every instant `vN/` is absent, the directory that was there before, or the new one,
complete and durable. A damaged directory is never served: `verify` refuses it.

Errors: an OSError (or any exception) before the commit point's fsync returned undoes what
this publication did, as far as it can (best effort, the failing disk may go on failing):
the temporary directory is removed, a `vN/` already renamed into place is renamed to a
`vN.tmp-HEX` name and removed (an fsync that failed may have lost its data), a directory
moved aside is removed (it was damaged or stale). Then the error propagates: the caller
turns an OSError into exit 5. No `vN/` is left behind.

Retention: `retain(run_dir, keep)` renames each `vN/` not in `keep` to `vN.tmp-HEX`, fsyncs
`weights/`, then deletes it (so no half-deleted `vN/` is ever visible) along with every
leftover; a failure is reported, not raised.                            [weights.retention]


Verification
============

`verify(path)` trusts nothing in the directory (`rollkeep.core.io.untrusted`):

V1. The directory's name is `v<N>`, and it is a directory (not a symlink to one).
V2. WEIGHTS.json is a regular file of at most MAX_WEIGHTS_JSON bytes holding strict JSON:
    an object with exactly `version` (the N of the name), `files` (plain names, each with an
    int `size` >= 0 and a lowercase hex `sha256`; model.safetensors and config.json among
    them) and `digest` (the digest of `files`).
V3. The directory holds exactly those files and WEIGHTS.json, each a regular file: no
    symlink, FIFO, socket, device, subdirectory, extra or missing file.
V4. Each file has its listed size and sha256 (streamed).

Anything else raises WeightsDirError (a CheckpointError) naming the file and what was
expected and found.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import crashpoints
from ..core.errors import CheckpointError, UserInputError
from ..core.io.fs import DEFAULT_FS, DIR, FILE, FS, SYMLINK
from ..core.io.untrusted import SAFETENSORS_MAX_HEADER, loads_json, safetensors_header

if TYPE_CHECKING:
    import torch

__all__ = [
    "COPIED",
    "MODEL",
    "WEIGHTS",
    "WEIGHTS_DIR",
    "Retention",
    "WeightsDir",
    "WeightsDirError",
    "WeightsSourceError",
    "digest_of",
    "label_of",
    "load_state_dict",
    "publish",
    "retain",
    "verify",
]

WEIGHTS_DIR = "weights"  # RUN_DIR/weights
WEIGHTS = "WEIGHTS.json"
MODEL = "model.safetensors"
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"  # a sharded source checkpoint's weight map
# What is copied from the source directory, when present (config.json must be).
COPIED = (
    CONFIG,
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
MAX_WEIGHTS_JSON = 1 << 20
MAX_COPIED = 1 << 30  # a tokenizer or config file larger than this is not one

FILE_WRITTEN = crashpoints.register("weights.file_written")
MANIFEST_WRITTEN = crashpoints.register("weights.manifest_written")
DIR_RENAMED = crashpoints.register("weights.dir_renamed")
RETENTION = crashpoints.register("weights.retention")

_VERSION_RE = re.compile(r"v(0|[1-9][0-9]*)")
_LEFTOVER_RE = re.compile(r"v(?:0|[1-9][0-9]*)\.(?:tmp|bad)-[0-9a-f]+")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX_RE = re.compile(r"[0-9a-f]{64}")
_FLOAT = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_REMEDY = (
    "let rollkeep publish this version again (a restart republishes every version it needs "
    "that is missing or damaged); never edit a weight directory by hand"
)


# -- results and errors ------------------------------------------------------------------


@dataclass(frozen=True)
class WeightsDir:
    """A published, verified weight directory. `nbytes`: all its files, WEIGHTS.json too."""

    path: Path
    version: int
    digest: str
    nbytes: int = field(default=0, compare=False)

    @property
    def label(self) -> str:
        """The version label a server is set to: `rollkeep:<N>:<digest[:16]>`."""
        return label_of(self.version, self.digest)


@dataclass(frozen=True)
class Retention:
    """What `retain` did: the names it removed, and (name, error) for each it could not."""

    removed: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]


class WeightsDirError(CheckpointError):
    """A weight directory cannot be trusted: `verify` refused it. `publish` replaces such a
    directory; a server refuses to load it."""


class WeightsSourceError(UserInputError):
    """The source model directory, or the state dict handed to `publish`, does not fit the
    layout a weight directory must have. Nothing was written."""


def label_of(version: int, digest: str) -> str:
    return f"rollkeep:{version}:{digest[:16]}"


def digest_of(files: Mapping[str, Mapping[str, Any]]) -> str:
    """The digest of a `files` listing: sha256 of `"<sha256>  <name>\\n"`, sorted by name."""
    listing = "".join(f"{files[name]['sha256']}  {name}\n" for name in sorted(files))
    return hashlib.sha256(listing.encode("utf-8")).hexdigest()


# -- W1: the source and the layout of model.safetensors -----------------------------------


def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
             "U16": "uint16", "U8": "uint8", "BOOL": "bool"}
    return {st: getattr(torch, name) for st, name in names.items() if hasattr(torch, name)}


def _source_error(what: str, source: Path, *, expected: str, found: str, path: Path | None = None) -> WeightsSourceError:
    return WeightsSourceError(
        what, path=str(path if path is not None else source), expected=expected, found=found,
        remedy="point the engine at the transformers model directory the trainer was loaded from "
        "(written by save_pretrained(DIR, safe_serialization=True))",
    )


class _Source:
    """The source model directory, read through the fs seam. A symlink in it (a Hugging
    Face cache snapshot is made of links into `blobs/`) is followed to its target, which
    must be a regular file."""

    def __init__(self, path: Path, fs: FS) -> None:
        self.path, self.fs = Path(path), fs
        try:
            self.entries = dict(fs.listdir(self.path))
        except OSError as e:
            raise _source_error(
                "the source model directory cannot be listed", self.path,
                expected="a directory with config.json and model.safetensors",
                found=e.strerror or str(e),
            ) from e

    def file(self, name: str) -> Path | None:
        """The regular file `name` of the directory (a symlink followed), None if absent."""
        kind = self.entries.get(name)
        if kind is None:
            return None
        path = self.path / name
        if kind == SYMLINK:
            path = Path(os.path.realpath(path))
            kind = self.fs.kind_of(path)
        if kind != FILE:
            raise _source_error(
                f"{name} of the source model directory is not a regular file", self.path,
                path=self.path / name, expected="a regular file (or a symlink to one)",
                found=self.fs.describe(path),
            )
        return path

    def read(self, name: str, path: Path) -> bytes:
        data = self.fs.read_prefix(path, MAX_COPIED + 1)
        if len(data) > MAX_COPIED:
            raise _source_error(
                f"{name} of the source model directory is too large to be a config or tokenizer file",
                self.path, path=path, expected=f"at most {MAX_COPIED} bytes", found="more",
            )
        return data

    def checkpoint_files(self) -> list[str]:
        """The names of the source's safetensors checkpoint file(s): model.safetensors, or
        the shards a model.safetensors.index.json names."""
        if self.entries.get(MODEL) is not None:
            return [MODEL]
        index = self.file(INDEX)
        if index is None:
            raise _source_error(
                "the source model directory has no safetensors checkpoint", self.path,
                expected=f"{MODEL} (or a sharded checkpoint with {INDEX})",
                found=", ".join(sorted(self.entries)) or "an empty directory",
            )
        try:
            weight_map = loads_json(self.read(INDEX, index))["weight_map"]
            shards = sorted(set(weight_map.values()))
            if not shards or not all(isinstance(s, str) and _NAME_RE.fullmatch(s) for s in shards):
                raise ValueError(f"shard names {shards[:5]!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise _source_error(
                f"{INDEX} of the source model directory is not a weight map", self.path,
                path=index, expected='{"weight_map": {tensor name: shard file name}}', found=str(e),
            ) from e
        return shards

    def header(self, name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """tensor name -> (safetensors dtype, shape) from the header of checkpoint file `name`."""
        path = self.file(name)
        if path is None:
            raise _source_error(
                f"the source's checkpoint shard {name} is missing", self.path,
                path=self.path / name, expected=f"the file, as {INDEX} names it", found="nothing",
            )
        dtypes = _torch_dtypes()
        try:
            head = self.fs.read_prefix(path, 8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            if n > SAFETENSORS_MAX_HEADER:
                raise ValueError(f"a header length of {n}")
            header = safetensors_header(self.fs.read_prefix(path, 8 + n))
            out: dict[str, tuple[str, tuple[int, ...]]] = {}
            for tensor, info in header.items():
                if tensor == "__metadata__":
                    continue
                dtype, shape = info["dtype"], info["shape"]
                if dtype not in dtypes or not isinstance(shape, list) or not all(
                        type(d) is int and d >= 0 for d in shape):
                    raise ValueError(f"tensor {tensor!r}: dtype {dtype!r}, shape {shape!r}")
                out[tensor] = (dtype, tuple(shape))
        except (ValueError, KeyError, TypeError) as e:
            raise _source_error(
                f"{name} of the source model directory has no readable safetensors header",
                self.path, path=path, expected="a safetensors file", found=str(e),
            ) from e
        if not out:
            raise _source_error(
                f"{name} of the source model directory holds no tensors", self.path,
                path=path, expected="the model's weights", found="an empty safetensors file",
            )
        return out


def _layout(source: _Source) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the source's checkpoint: name -> (safetensors dtype, shape)."""
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for shard in source.checkpoint_files():
        for tensor, spec in source.header(shard).items():
            if tensor in layout:
                raise _source_error(
                    f"tensor {tensor!r} is in two shards of the source checkpoint", source.path,
                    path=source.path / shard, expected="each tensor in one shard", found="a duplicate",
                )
            layout[tensor] = spec
    return layout


def _ident(t: Any) -> tuple | None:
    """What makes two state-dict entries the same tensor (a tie), as the GRPO trainer's
    snapshot sees it: one storage, offset, shape, stride and dtype. None for a tensor with
    no storage of its own (sparse, meta) or no elements."""
    try:
        if not t.numel():
            return None
        return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                t.stride(), t.dtype)
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


@dataclass(frozen=True)
class _Plan:
    """What `publish` writes, decided before anything is: the copied files' bytes, and
    `model.safetensors` as its header plus (name, tensor, dtype to write) in file order."""

    copies: tuple[tuple[str, bytes], ...]
    header: bytes
    tensors: tuple[tuple[str, Any, Any], ...]

    def model_parts(self) -> Iterator[memoryview]:
        """model.safetensors, in pieces: the header, then each tensor's bytes (each cast and
        copied to the CPU only when its turn comes)."""
        import torch

        yield memoryview(self.header)
        for _, t, dtype in self.tensors:
            t = t.detach()
            if t.dtype != dtype:
                t = t.to(dtype)
            t = t.to("cpu").contiguous().reshape(-1)
            yield memoryview(t.view(torch.uint8).numpy())

    def model_sha256(self) -> tuple[int, str]:
        h, size = hashlib.sha256(), 0
        for part in self.model_parts():
            h.update(part)
            size += part.nbytes
        return size, h.hexdigest()


def _plan(state_dict: Mapping[str, Any], source: _Source, dtype: Any) -> _Plan:
    """W1: match `state_dict` to the source checkpoint's tensors; read the copied files."""
    import torch

    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    if source.file(CONFIG) is None:
        raise _source_error(
            "the source model directory has no config.json", source.path,
            expected="a transformers model directory (config.json, model.safetensors, tokenizer)",
            found=", ".join(sorted(source.entries)) or "an empty directory",
        )
    copies = []
    for name in COPIED:
        path = source.file(name)
        if path is not None:
            copies.append((name, source.read(name, path)))
    layout = _layout(source)
    by_st = _torch_dtypes()
    to_st = {v: k for k, v in by_st.items()}

    def mismatch(what: str, tensor: str, expected: str, found: str) -> WeightsSourceError:
        return WeightsSourceError(
            what, field=tensor, path=str(source.path), expected=expected, found=found,
            remedy="publish the weights of the model loaded from this source directory "
            "(trainer.model_path and the engine's model directory must be the same model)",
        )

    missing = [n for n in layout if n not in state_dict]
    if missing:
        raise mismatch(
            f"the state dict lacks {len(missing)} tensor(s) of the source checkpoint",
            missing[0], expected=f"all {len(layout)} tensors of the source checkpoint",
            found=f"no {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}",
        )
    tensors = []
    written: set[tuple] = set()
    for name, (st_dtype, shape) in layout.items():
        t = state_dict[name]
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type == "meta":
            raise mismatch(f"state dict entry {name!r} is not a dense tensor with data", name,
                           expected="a torch.Tensor (strided, not on the meta device)",
                           found=f"{type(t).__name__}" + (f" ({t.layout}, {t.device})" if isinstance(t, torch.Tensor) else ""))
        if tuple(t.shape) != shape:
            raise mismatch(f"tensor {name!r} has another shape than in the source checkpoint", name,
                           expected=str(list(shape)), found=str(list(t.shape)))
        # Floating-point weights may differ in precision (float32 master weights of a bf16
        # model; `dtype` casts them); anything else keeps the source's dtype exactly.
        if (st_dtype in _FLOAT) != t.dtype.is_floating_point or (
                st_dtype not in _FLOAT and by_st[st_dtype] != t.dtype):
            raise mismatch(f"tensor {name!r} has another dtype than in the source checkpoint", name,
                           expected=st_dtype + (" (or another floating-point dtype)" if st_dtype in _FLOAT else ""),
                           found=str(t.dtype))
        out = dtype if dtype is not None and t.dtype.is_floating_point else t.dtype
        if out not in to_st:
            raise mismatch(f"tensor {name!r} has a dtype safetensors cannot hold", name,
                           expected=", ".join(sorted(to_st.values())), found=str(out))
        tensors.append((name, t, out))
        written.add(_ident(t))
    written.discard(None)
    extra = sorted(n for n, t in state_dict.items() if n not in layout and _ident(t) not in written)
    if extra:
        raise mismatch(
            f"the state dict has {len(extra)} tensor(s) the source checkpoint does not, "
            "and they are not tied to one it does", extra[0],
            expected="only the source's tensors, and tied duplicates of them (left out as the source left them out)",
            found=", ".join(extra[:5]) + (" ..." if len(extra) > 5 else ""),
        )
    # The header, tensors in the order the safetensors library writes them (largest
    # element first, then by name), so every tensor's data is aligned to its element size.
    tensors.sort(key=lambda x: (-x[2].itemsize, x[0]))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t, out in tensors:
        n = t.numel() * out.itemsize
        header[name] = {"dtype": to_st[out], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return _Plan(tuple(copies), len(raw).to_bytes(8, "little") + raw, tuple(tensors))


# -- publication -------------------------------------------------------------------------


def _hex() -> str:
    return secrets.token_hex(8)


def _weights_json(version: int, files: Mapping[str, Mapping[str, Any]]) -> bytes:
    fields = {"version": version, "files": {n: dict(files[n]) for n in sorted(files)},
              "digest": digest_of(files)}
    return (json.dumps(fields, indent=2) + "\n").encode("utf-8")


def _remove(fs: FS, path: Path, kind: str | None) -> None:
    if kind == DIR:
        fs.rmtree(path)
    elif kind is not None:
        fs.unlink(path)


def _attempt(fn: Any, *args: Any) -> str | None:
    """Call `fn(*args)`; the error text of an OSError, None if it succeeded."""
    try:
        fn(*args)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _remove_leftovers(fs: FS, root: Path, entries: list[tuple[str, str]]) -> tuple[list[str], list[tuple[str, str]]]:
    removed, failed = [], []
    for name, kind in entries:
        if _LEFTOVER_RE.fullmatch(name):
            err = _attempt(_remove, fs, root / name, kind)
            if err is None:
                removed.append(name)
            else:
                failed.append((name, err))
    return removed, failed


def _check_version(version: int) -> None:
    if type(version) is not int or version < 0:
        raise ValueError(f"a weight version is an int >= 0, got {version!r}")


def publish(
    run_dir: Path,
    version: int,
    state_dict: Mapping[str, torch.Tensor],
    *,
    source_dir: Path,
    dtype: torch.dtype | None = None,
    fs: FS = DEFAULT_FS,
) -> WeightsDir:
    """Publish `state_dict` as `RUN_DIR/weights/v<version>/`, in the layout of the model in
    `source_dir`, atomically; return it verified. Steps W1-W7 of the module docstring: a
    `v<version>/` that verifies and holds the same files is returned as it is; one that does
    not is replaced. `dtype` casts floating-point tensors (e.g. torch.bfloat16 for serving).

    Raises WeightsSourceError (the source or the state dict does not fit; nothing written)
    and OSError (the filesystem failed; no `v<version>/` left behind). Blocking: it writes
    and fsyncs the whole model (0.15-0.7 s for 100 MB on a shared VM disk: see
    `rollkeep.bench.weights`), so an event loop calls it in a thread, and nothing may change
    the tensors until it returns."""
    _check_version(version)
    run_dir = Path(run_dir)
    root = run_dir / WEIGHTS_DIR
    final = root / f"v{version}"
    plan = _plan(state_dict, _Source(Path(source_dir), fs), dtype)  # W1

    # W2: weights/ exists, durably; leftovers of earlier runs go.
    if fs.kind_of(root) is None:
        fs.mkdir(root)
    fs.fsync(run_dir)
    fs.fsync(root)  # the renames of an earlier retention, durable before their trees go
    _remove_leftovers(fs, root, fs.listdir(root))

    # W3: an existing v<N> that verifies and holds these very files is kept.
    if fs.kind_of(final) is not None:
        try:
            found: WeightsDir | None = verify(final, fs=fs)
        except WeightsDirError:
            found = None
        if found is not None:
            files = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                     for name, data in plan.copies}
            size, sha = plan.model_sha256()
            files[MODEL] = {"size": size, "sha256": sha}
            if digest_of(files) == found.digest:
                return found

    tmp = root / f"v{version}.tmp-{_hex()}"
    made = renamed = durable = False
    aside: Path | None = None
    try:
        # W4: every file, durable, under a name no reader looks at.
        fs.mkdir(tmp)
        made = True
        files = {}
        for name, data in plan.copies:
            fs.write(tmp / name, data)
            fs.fsync(tmp / name)
            files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            crashpoints.hit(FILE_WRITTEN)
        out = fs.open_append(tmp / MODEL)
        try:
            h, size = hashlib.sha256(), 0
            for part in plan.model_parts():
                out.write(part)
                h.update(part)
                size += part.nbytes
            out.fsync()
        finally:
            out.close()
        files[MODEL] = {"size": size, "sha256": h.hexdigest()}
        crashpoints.hit(FILE_WRITTEN)
        # W5: WEIGHTS.json last, so it vouches only for files already durable.
        manifest = _weights_json(version, files)
        fs.write(tmp / WEIGHTS, manifest)
        fs.fsync(tmp / WEIGHTS)
        fs.fsync(tmp)
        crashpoints.hit(MANIFEST_WRITTEN)
        # W6: a damaged or stale v<N> goes aside.
        if fs.kind_of(final) is not None:
            aside = root / f"v{version}.bad-{_hex()}"
            fs.rename(final, aside)
        # W7: THE COMMIT POINT.
        fs.rename(tmp, final)
        renamed = True
        fs.fsync(root)
        durable = True
        crashpoints.hit(DIR_RENAMED)
    except BaseException:
        if not durable:
            _undo(fs, root, tmp=tmp if made and not renamed else None, final=final if renamed else None,
                  aside=aside)
        raise
    if aside is not None:
        _attempt(_remove, fs, aside, fs.kind_of(aside))  # else: removed by the next W2
    digest = digest_of(files)
    nbytes = sum(f["size"] for f in files.values()) + len(manifest)
    return WeightsDir(final, version, digest, nbytes)


def _undo(fs: FS, root: Path, *, tmp: Path | None, final: Path | None, aside: Path | None) -> None:
    """Best effort: remove what a publication that failed before its commit point was
    durable created. Each step may fail (the disk that failed may go on failing); what stays
    is a leftover for the next publication's W2."""
    if final is not None:
        # Renamed away before it is deleted, so no half-deleted v<N> is ever visible.
        doomed = root / f"{final.name}.tmp-{_hex()}"
        if _attempt(fs.rename, final, doomed) is None:
            _attempt(fs.rmtree, doomed)
    if tmp is not None and fs.kind_of(tmp) is not None:
        _attempt(fs.rmtree, tmp)
    if aside is not None and fs.kind_of(aside) is not None:
        _attempt(_remove, fs, aside, fs.kind_of(aside))


def retain(run_dir: Path, keep: AbstractSet[int], *, fs: FS = DEFAULT_FS) -> Retention:
    """Delete every `v<N>/` of `RUN_DIR/weights/` whose N is not in `keep`, and every
    leftover (`v*.tmp-*`, `v*.bad-*`); never a version in `keep`, nor a name that is not a
    weight directory's. Errors are reported in the result, not raised."""
    for v in keep:
        _check_version(v)
    root = Path(run_dir) / WEIGHTS_DIR
    try:
        entries = fs.listdir(root)
    except FileNotFoundError:
        return Retention((), ())
    except OSError as e:
        return Retention((), ((WEIGHTS_DIR, f"cannot be listed: {type(e).__name__}: {e}"),))
    removed: list[str] = []
    failed: list[tuple[str, str]] = []
    doomed: list[tuple[str, Path]] = []
    for name, kind in entries:
        m = _VERSION_RE.fullmatch(name)
        if m is None or int(m.group(1)) in keep:
            continue
        if kind != DIR:
            err = _attempt(fs.unlink, root / name)
            if err is None:
                removed.append(name)
            else:
                failed.append((name, err))
            continue
        target = root / f"{name}.tmp-{_hex()}"
        err = _attempt(fs.rename, root / name, target)
        if err is None:
            doomed.append((name, target))
        else:
            failed.append((name, err))
    # The renames are durable before any file goes: a power cut never brings back a
    # half-deleted v<N>. If the fsync fails, nothing renamed is deleted now.
    err = _attempt(fs.fsync, root)
    if err is not None:
        failed += [(name, f"not deleted: the fsync of {root} failed ({err})") for name, _ in doomed]
        return Retention(tuple(removed), tuple(failed))
    for name, target in doomed:
        crashpoints.hit(RETENTION)
        err = _attempt(fs.rmtree, target)
        if err is None:
            removed.append(name)
        else:
            failed.append((name, err))
    gone, stuck = _remove_leftovers(fs, root, entries)
    return Retention(tuple(sorted(removed + gone)), tuple(sorted(failed + stuck)))


# -- verification ------------------------------------------------------------------------


def _bad(what: str, path: Path, *, expected: str, found: str, field: str | None = None) -> WeightsDirError:
    return WeightsDirError(what, path=str(path), field=field, expected=expected, found=found, remedy=_REMEDY)


def _listing_problem(files: Any) -> tuple[str, str] | None:
    """(field, problem) of a WEIGHTS.json `files` value that is not a valid listing."""
    if not isinstance(files, dict) or not files:
        return "files", f"a {type(files).__name__}" + (" (empty)" if files == {} else "")
    for name, entry in files.items():
        if not _NAME_RE.fullmatch(name) or name == WEIGHTS or _LEFTOVER_RE.fullmatch(name):
            return "files", f"the name {name!r}"
        if not isinstance(entry, dict) or set(entry) != {"size", "sha256"}:
            return f"files[{name!r}]", repr(entry)[:200]
        size, sha = entry["size"], entry["sha256"]
        if type(size) is not int or size < 0 or not isinstance(sha, str) or not _HEX_RE.fullmatch(sha):
            return f"files[{name!r}]", repr(entry)[:200]
    for required in (MODEL, CONFIG):
        if required not in files:
            return "files", f"no {required}"
    return None


def _verify(path: Path, fs: FS, *, unhashed: AbstractSet[str] = frozenset()) -> tuple[WeightsDir, dict[str, Any]]:
    """V1-V4 (the files in `unhashed` are not hashed: the caller checks the bytes it reads)."""
    path = Path(path)
    m = _VERSION_RE.fullmatch(path.name)
    if m is None:  # V1
        raise _bad("not a weight directory's name", path, expected="v<N> (N an int, no leading zeros)",
                   found=repr(path.name))
    version = int(m.group(1))
    if (kind := fs.kind_of(path)) != DIR:
        raise _bad("not a weight directory", path, expected="a directory (not a symlink to one)",
                   found=fs.describe(path) if kind is not None else "nothing")
    where = path / WEIGHTS
    try:  # V2
        raw = fs.read_prefix(where, MAX_WEIGHTS_JSON + 1)
    except OSError as e:
        missing = isinstance(e, FileNotFoundError)
        raise _bad(f"{WEIGHTS} cannot be read" + (" (a publication that did not finish?)" if missing else ""),
                   where, expected="a regular file", found=fs.describe(where) if not missing else "nothing") from e
    if len(raw) > MAX_WEIGHTS_JSON:
        raise _bad(f"{WEIGHTS} is too large", where, expected=f"at most {MAX_WEIGHTS_JSON} bytes", found="more")
    try:
        fields = loads_json(raw)
    except ValueError as e:
        raise _bad(f"{WEIGHTS} is not JSON (truncated?)", where, expected="one JSON object",
                   found=str(e)[:200]) from e
    if not isinstance(fields, dict) or set(fields) != {"version", "files", "digest"}:
        found = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
        raise _bad(f"{WEIGHTS} does not have the fields of a weight directory", where,
                   expected="exactly version, files, digest", found=str(found)[:200])
    if fields["version"] != version or type(fields["version"]) is not int:
        raise _bad(f"{WEIGHTS} is of another version than its directory", where, field="version",
                   expected=str(version), found=repr(fields["version"])[:80])
    files = fields["files"]
    problem = _listing_problem(files)
    if problem is not None:
        raise _bad(f"{WEIGHTS} does not list the files of a weight directory", where, field=problem[0],
                   expected=f"plain file names with an int size and a sha256, {MODEL} and {CONFIG} among them",
                   found=problem[1])
    digest = fields["digest"]
    if not isinstance(digest, str) or digest != digest_of(files):
        raise _bad(f"{WEIGHTS}'s digest is not that of its files", where, field="digest",
                   expected=digest_of(files), found=repr(digest)[:80])
    try:  # V3
        entries = fs.listdir(path)
    except OSError as e:
        raise _bad("the weight directory cannot be listed", path, expected="a directory",
                   found=e.strerror or str(e)) from e
    names = {name for name, _ in entries}
    extra = sorted(names - set(files) - {WEIGHTS})
    missing = sorted(set(files) - names)
    if extra or missing:
        found = "; ".join(part for part in (
            f"missing: {', '.join(missing)}" if missing else "", f"not listed: {', '.join(extra)}" if extra else ""
        ) if part)
        raise _bad("the weight directory does not hold exactly the files WEIGHTS.json lists", path,
                   expected=f"{len(files)} files and {WEIGHTS}", found=found)
    for name, kind in entries:
        if kind != FILE:
            raise _bad(f"{name} of the weight directory is not a regular file", path / name,
                       expected="a regular file (no symlink, FIFO, device or directory)",
                       found=fs.describe(path / name))
    for name in sorted(files):  # V4
        if name in unhashed:
            continue
        try:
            size, sha = fs.hash(path / name)
        except OSError as e:
            raise _bad(f"{name} of the weight directory cannot be read", path / name,
                       expected="a regular file", found=e.strerror or str(e)) from e
        want = files[name]
        if size != want["size"] or sha != want["sha256"]:
            raise _bad(f"{name} of the weight directory is damaged", path / name, field=f"files[{name!r}]",
                       expected=f"{want['size']} bytes, sha256 {want['sha256']}", found=f"{size} bytes, sha256 {sha}")
    nbytes = sum(f["size"] for f in files.values()) + len(raw)
    return WeightsDir(path, version, digest, nbytes), files


def verify(path: Path, *, fs: FS = DEFAULT_FS) -> WeightsDir:
    """The weight directory at `path`, checked (V1-V4 of the module docstring); raises
    WeightsDirError if it cannot be trusted. Reads only; changes nothing."""
    return _verify(path, fs)[0]


def load_state_dict(path: Path, *, fs: FS = DEFAULT_FS) -> dict[str, torch.Tensor]:
    """The tensors of a verified weight directory's model.safetensors, on the CPU, under the
    file's names (a tied duplicate the source checkpoint leaves out is absent: load with
    `strict=False`, or tie it, as from_pretrained does). The bytes parsed are the bytes
    checked: the file is read once, then its sha256 compared with WEIGHTS.json's."""
    from safetensors.torch import load as st_load

    path = Path(path)
    _, files = _verify(path, fs, unhashed={MODEL})
    try:
        data = fs.read(path / MODEL)
    except OSError as e:
        raise _bad(f"{MODEL} of the weight directory cannot be read", path / MODEL,
                   expected="a regular file", found=e.strerror or str(e)) from e
    want = files[MODEL]
    sha = hashlib.sha256(data).hexdigest()
    if len(data) != want["size"] or sha != want["sha256"]:
        raise _bad(f"{MODEL} of the weight directory is damaged", path / MODEL, field=f"files[{MODEL!r}]",
                   expected=f"{want['size']} bytes, sha256 {want['sha256']}", found=f"{len(data)} bytes, sha256 {sha}")
    return st_load(data)

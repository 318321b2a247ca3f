"""Weight directories (`rollkeep.cluster.weightdirs`): what publishing a version costs.

    weights_bench(repeats=..., quick=..., log=..., workdir=None) -> dict
    python -m rollkeep.bench.weights [--repeats N] [--quick] [--dir DIR]

Two GPT-2 models built from a config (random weights, nothing downloaded), each saved with
`save_pretrained` into a source directory (config.json, generation_config.json,
model.safetensors; no tokenizer):

  tiny       the test fixture's shape (tests/hf_fixture.py): 2 layers, width 32, 77 tokens
  gpt2-25m   6 layers, width 512, 8 heads, 1024 positions, 12,288 tokens (~25 M parameters)

For each, `repeats` times (medians reported, min and max beside them):

  publish            a new version, float32 as the trainer holds it: read the source's
                     header, write and fsync every file, WEIGHTS.json, rename, fsync
  publish_bf16       a new version cast to bfloat16
  republish          the same version again: verify the directory and hash what would be
                     written (nothing is written)
  verify             `verify` alone (every file hashed, streamed)
  load_state_dict    `load_state_dict` (verify, one read, parse)
  publish_no_fsync   `publish` with every fsync skipped (what it costs besides the disk:
                     reading the source, hashing, copying into the page cache)
  save_file          for scale: safetensors' own `save_file` of the same tensors plus one
                     fsync (no copies, no manifest, not atomic)

`bytes` is every file of the directory, WEIGHTS.json included; `model_bytes` is
model.safetensors alone. WORKDIR (a temporary directory by default) decides the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODELS = {
    "tiny": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64, "vocab_size": 77},
    "gpt2-25m": {"n_layer": 6, "n_embd": 512, "n_head": 8, "n_positions": 1024, "vocab_size": 12288},
}
_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs)}


class _NoFsync:
    """The real filesystem with every fsync skipped (never for anything but this bench)."""

    @staticmethod
    def make() -> Any:
        from ..core.io.fs import FS, OSAppendFile

        class NoFsyncFile(OSAppendFile):
            def fsync(self) -> None:
                pass

        class NoFsync(FS):
            def fsync(self, path: Path) -> None:
                pass

            def open_append(self, path: Path) -> Any:
                from ..core.io.untrusted import open_append_fd

                return NoFsyncFile(open_append_fd(path))

        return NoFsync()


def _one(name: str, shape: dict, work: Path, repeats: int, log: Callable[[str], None]) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    from ..cluster import weightdirs

    src, run = work / f"{name}-source", work / f"{name}-run"
    run.mkdir(parents=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**shape, **_TOKENS))
    model.save_pretrained(src, safe_serialization=True)
    weights = model.state_dict()  # tied names share one tensor, as the trainer's weights()
    params = sum(p.numel() for p in model.parameters())
    log(f"{name}: {params / 1e6:.2f} M parameters, {repeats} repeat(s)")

    t: dict[str, list[float]] = {k: [] for k in
                                 ("publish", "publish_bf16", "republish", "verify", "load_state_dict", "save_file",
                                  "publish_no_fsync")}
    unique = {k: v for k, v in weights.items() if k != "lm_head.weight"}  # what save_pretrained wrote
    no_fsync = _NoFsync.make()
    (run / "no-fsync").mkdir()
    out = bf16 = None
    for i in range(repeats):
        t0 = time.perf_counter()
        out = weightdirs.publish(run, 2 * i, weights, source_dir=src)
        t1 = time.perf_counter()
        bf16 = weightdirs.publish(run, 2 * i + 1, weights, source_dir=src, dtype=torch.bfloat16)
        t2 = time.perf_counter()
        again = weightdirs.publish(run, 2 * i, weights, source_dir=src)
        t3 = time.perf_counter()
        weightdirs.verify(out.path)
        t4 = time.perf_counter()
        weightdirs.load_state_dict(out.path)
        t5 = time.perf_counter()
        plain = work / f"{name}-save_file-{i}.safetensors"
        save_file(unique, str(plain), metadata={"format": "pt"})
        fd = os.open(plain, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        t6 = time.perf_counter()
        plain.unlink()
        weightdirs.publish(run / "no-fsync", i, weights, source_dir=src, fs=no_fsync)
        t7 = time.perf_counter()
        assert again == out
        for key, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6), strict=True):
            t[key].append(dt)
    assert out is not None and bf16 is not None
    result: dict[str, Any] = {
        "parameters": params,
        "bytes": out.nbytes,
        "model_bytes": (out.path / weightdirs.MODEL).stat().st_size,
        "bytes_bf16": bf16.nbytes,
        "model_bytes_bf16": (bf16.path / weightdirs.MODEL).stat().st_size,
        "label": out.label,
    }
    result.update({k: _stats(v) for k, v in t.items()})
    result["publish_MB_per_s"] = result["bytes"] / result["publish"]["median_s"] / 1e6
    return result


def weights_bench(*, repeats: int = 3, quick: bool = False, log: Callable[[str], None] = print,
                  workdir: Path | None = None) -> dict:
    """Publication cost of the models of MODELS (with `quick`, the tiny one only)."""
    names = ["tiny"] if quick else list(MODELS)
    with tempfile.TemporaryDirectory(dir=workdir, prefix="rollkeep-weights-") as tmp:
        return {name: _one(name, MODELS[name], Path(tmp), repeats, log) for name in names}


def _table(results: dict) -> str:
    rows = ["model      params    bytes (f32)   bytes (bf16)  publish   bf16      republish verify    load      "
            "save_file no fsync"]
    for name, r in results.items():
        rows.append(
            f"{name:10} {r['parameters'] / 1e6:6.2f} M {r['bytes']:13,} {r['bytes_bf16']:13,} "
            + " ".join(f"{r[k]['median_s'] * 1e3:7.1f}ms" for k in
                       ("publish", "publish_bf16", "republish", "verify", "load_state_dict", "save_file",
                        "publish_no_fsync"))
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m rollkeep.bench.weights", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="the tiny model only")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    results = weights_bench(repeats=args.repeats, quick=args.quick, workdir=args.dir)
    print(_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""The vllm engine in this process against a real vLLM's CPU build: scripts/gpu_check.py's
vLLM session checks (logprobs, continuation, stale cache, versions in flight, the salt-less
control, shutdown), without a GPU.

    .venv-vllm/bin/python scripts/vllm_cpu_inprocess.py [--out DIR] [--block-size N] [--only NAME,...]

Two things differ from a GPU run, both outside the adapter: the adapter's CUDA guard is
lifted while vllm is imported (vLLM has already chosen its CPU platform by then), and the
KV block size is set (`--block-size`, 32): the CPU build's default block is 128 tokens,
the whole context of the check's model, so no block would ever be cached and the
stale-cache control would be inconclusive. The interpreter needs rollkeep's own
dependencies besides vllm (the `make vllm-cpu` list lacks xxhash and pyroaring: install
them there, or put a directory holding them first with --extra-path).

Run with vllm-cpu 0.32.0 (bf16, block 32, 2 cores, about a minute): every check PASS but
the continuation, INFO (vLLM's CPU build has no Triton, so it runs Model Runner V1).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ["vllm-logprobs", "vllm-continuation", "vllm-stale-cache", "vllm-inflight-versions",
          "vllm-stale-cache-control", "vllm-shutdown"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "vllm_cpu_inprocess"))
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--only", default=",".join(CHECKS))
    ap.add_argument("--extra-path", action="append", default=[], help="put this directory on sys.path first")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), *args.extra_path]

    import torch
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        print(f"this vLLM runs on {current_platform.device_type}: use scripts/gpu_check.sh", file=sys.stderr)
        return 2
    from rollkeep.engines import vllm as vl

    guarded, with_block = vl._import_vllm, vl.engine_args

    def import_vllm_on_cpu():
        real = torch.cuda.is_available
        torch.cuda.is_available = lambda: True
        try:
            return guarded()
        finally:
            torch.cuda.is_available = real

    vl._import_vllm = import_vllm_on_cpu
    vl.engine_args = lambda **kw: {**with_block(**kw), "block_size": args.block_size}
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gc
    spec.loader.exec_module(gc)
    gc.DEVICE = "cpu"
    ctx = gc.Context(Path(args.out), sys.executable, deadline=time.time() + 1200)
    try:
        results = gc.run_checks(ctx, [n for n in args.only.split(",") if n])
    finally:
        gc.close_session()
    return int(any(r.status == "FAIL" for r in results))


if __name__ == "__main__":
    sys.exit(main())

"""`rollkeep serve MODEL_DIR`: a local transformers model over HTTP with vLLM's or SGLang's
routes (server mode)."""

from __future__ import annotations

import argparse

from ..core.errors import UserInputError

HELP = """\
Serve the transformers causal LM in MODEL_DIR (config.json, *.safetensors, tokenizer) over
HTTP with the routes and fields of a vLLM server (--flavor vllm) or an SGLang server
(--flavor sglang): token-in generation, streamed or whole, abort, pause and resume, weight
reloads from a model directory, and weight version labels (docs/server-mode.md). A train
run reaches it with engine.name: remote.

Generation is the hf engine's: for the same weights, prompt ids, seed and sampling
positions the tokens and float32 log-probs are exactly those of engine.name: hf in process.
It runs on CUDA when torch sees a GPU, else on the CPU.

Once it listens it prints one line, "rollkeep serve: listening on http://HOST:PORT (...)",
and writes PORT to --port-file if given (atomically). SIGINT or SIGTERM stops it cleanly
(running requests end with finish reason "abort"); so does its parent exiting, with
--exit-with-parent.

examples:
  rollkeep serve models/arith --port 8101
  rollkeep serve models/arith --port 8102 --flavor sglang
  rollkeep serve models/arith --port 0 --port-file /tmp/port --exit-with-parent

exit codes: 0 stopped by a signal (or its parent exiting), 2 bad MODEL_DIR or options
(including a port that is taken).
"""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="serve a local model over HTTP with vLLM or SGLang routes (server mode)",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a transformers model directory (safetensors)")
    p.add_argument("--flavor", choices=("vllm", "sglang"), default="vllm",
                   help="whose routes and fields to serve (default: vllm)")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="the port (default: 8000; 0: a free one)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model name in responses (default: MODEL_DIR)")
    p.add_argument("--max-batch-size", type=int, default=32, metavar="N",
                   help="most requests decoded together (default: 32)")
    p.add_argument("--port-file", metavar="PATH", help="write the port here once listening (atomically)")
    p.add_argument("--exit-with-parent", action="store_true", help="stop when the parent process exits")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        from ..serve.process import Options, serve
    except ImportError as e:
        raise UserInputError(
            "`rollkeep serve` needs fastapi, uvicorn, torch and transformers",
            found=f"{type(e).__name__}: {e}", remedy="pip install 'rollkeep[serve]'",
        ) from e
    return serve(Options(
        model_dir=args.model_dir, flavor=args.flavor, host=args.host, port=args.port,
        served_model_name=args.served_model_name, max_batch_size=args.max_batch_size,
        port_file=args.port_file, exit_with_parent=args.exit_with_parent,
    ))

#!/usr/bin/env bash
# GPU check: what a machine with one CUDA GPU can run (docs/backends.md, "GPU check").
#
#   scripts/gpu_check.sh [--out DIR] [--only NAME,...] [--vllm-python PY] [--list]
#
# PYTHON (default: python3) runs the torch and hf checks; it needs a CUDA build of torch,
# transformers and rollkeep's dependencies (`pip install -e '.[hf]'`). The vllm checks run
# in the interpreter given by --vllm-python or $VLLM_PYTHON, else PYTHON if it imports
# vllm, else .venv-vllm/bin/python if it exists; else they are skipped. Needs no network.
# Prints PASS/FAIL/SKIP/INFO per check; exits 1 if any check failed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
cd "$ROOT"
exec "$PY" "$ROOT/scripts/gpu_check.py" "$@"

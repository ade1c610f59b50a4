#!/usr/bin/env bash
# infermux against llama-cpp-python's own OpenAI server on the default model (SmolLM2-135M-
# Instruct Q4_1), measured by `infermux bench --compare` in one run per scenario:
#   A = python -m llama_cpp.server --n_threads 2          (the peer)
#   B = infermux serve, with the backend pinned by `x-infermux-backend: <backend>`
# Requests alternate between A and B in ABBA blocks (never both at once), with the same
# prompts, so the two servers never compete for the cores and slow drift hits both.
#
#   benchmarks/serving_vs_llamacpp_server.sh            # the full run (~15-25 min on 2 cores)
#   QUICK=1 benchmarks/serving_vs_llamacpp_server.sh    # a smoke run (~2 min)
#
# Writes into $OUT (default benchmarks/results/serving_vs_llamacpp_server/): per backend and
# scenario a report (.txt), every figure and request (.json) and plots (a folder of PNGs),
# plus commands.txt with the exact command lines and the machine. Environment overrides:
#   BACKENDS="llamacpp core_engine"   infermux backends to pin, one comparison each
#   SCENARIOS="c1 c8 sweep"           c<N>: concurrency N; sweep: Poisson rates $RATES
#   NUM_REQUESTS INPUT_LEN OUTPUT_LEN RATES SLO WARMUP SEED
#   INFERMUX_CONFIG=FILE              passed as `infermux serve --config FILE`
#   PY (default .venv/bin/python)  INFERMUX (default .venv/bin/infermux, else python -m gateway.cli)
#   INFERMUX_SERVE_CMD                replaces the whole infermux start command ($INFERMUX_PORT set)
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PY:-.venv/bin/python}"
if [[ -z "${INFERMUX:-}" ]]; then
    if [[ -x .venv/bin/infermux ]]; then INFERMUX=".venv/bin/infermux"; else INFERMUX="$PY -m gateway.cli"; fi
fi
OUT="${OUT:-benchmarks/results/serving_vs_llamacpp_server}"
BACKENDS="${BACKENDS:-llamacpp core_engine}"
SCENARIOS="${SCENARIOS:-c1 c8 sweep}"
SEED="${SEED:-0}"
SLO="${SLO:-ttft=2s,tpot=100ms}"
if [[ -n "${QUICK:-}" ]]; then
    NUM_REQUESTS="${NUM_REQUESTS:-4}" INPUT_LEN="${INPUT_LEN:-64}" OUTPUT_LEN="${OUTPUT_LEN:-16}"
    RATES="${RATES:-1,4}" WARMUP="${WARMUP:-1}"
else
    NUM_REQUESTS="${NUM_REQUESTS:-32}" INPUT_LEN="${INPUT_LEN:-256}" OUTPUT_LEN="${OUTPUT_LEN:-128}"
    RATES="${RATES:-0.2,0.4,0.8}" WARMUP="${WARMUP:-2}"
fi

MODEL_PATH="$("$PY" -c 'from backends.default_model import default_model_path; print(default_model_path())')"
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
LLAMA_PORT="${LLAMA_PORT:-$(free_port)}"
INFERMUX_PORT="${INFERMUX_PORT:-$(free_port)}"
LLAMA_URL="http://127.0.0.1:$LLAMA_PORT"
INFERMUX_URL="http://127.0.0.1:$INFERMUX_PORT"
mkdir -p "$OUT"

PIDS=()
stop_servers() {
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
}
trap stop_servers EXIT

# Wait until URL answers 200 while PID lives; on failure show the end of LOG and stop.
wait_ready() {
    local url="$1" pid="$2" name="$3" log="$4"
    echo "waiting for $name at $url ..."
    if ! "$PY" - "$url" "$pid" <<'PYTHON'; then
import os, sys, time
import httpx
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 900
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)
    try:
        if httpx.get(url, timeout=5).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(1)
PYTHON
        echo "$name did not become ready; the end of $log:" >&2
        tail -n 30 "$log" >&2
        exit 1
    fi
}

# Can infermux serve the default model through backend $1? (A backend missing from the config
# would fail every B request; say so once instead of running A alone for minutes.)
backend_serves() {
    "$PY" - "$INFERMUX_URL" "$1" <<'PYTHON'
import sys
import httpx
url, backend = sys.argv[1], sys.argv[2]
reply = httpx.post(
    f"{url}/v1/chat/completions",
    headers={"x-infermux-backend": backend},
    json={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    timeout=600,
)
if reply.status_code != 200:
    print(f"!! skipping backend {backend}: HTTP {reply.status_code}: {reply.text[:300]}", file=sys.stderr)
    sys.exit(1)
PYTHON
}

LLAMA_CMD=("$PY" -m llama_cpp.server --model "$MODEL_PATH" --host 127.0.0.1 --port "$LLAMA_PORT"
    --n_threads 2 --n_ctx 2048
    # By default llama_cpp.server aborts the running request when a new one arrives.
    --interrupt_requests False)
# shellcheck disable=SC2206
INFERMUX_CMD=(${INFERMUX_SERVE_CMD:-$INFERMUX serve --host 127.0.0.1 --port $INFERMUX_PORT --no-access-log ${INFERMUX_CONFIG:+--config $INFERMUX_CONFIG}})

{
    echo "# $(date -u +%FT%TZ) on $(uname -srm), $(nproc) cores, $("$PY" --version)"
    echo "# llama-cpp-python $("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)'), model $MODEL_PATH"
    echo "${LLAMA_CMD[*]}"
    echo "${INFERMUX_CMD[*]}"
} >"$OUT/commands.txt"

"${LLAMA_CMD[@]}" >"$OUT/llama_cpp_server.log" 2>&1 &
PIDS+=("$!")
wait_ready "$LLAMA_URL/v1/models" "$!" "llama_cpp.server" "$OUT/llama_cpp_server.log"
"${INFERMUX_CMD[@]}" >"$OUT/infermux_serve.log" 2>&1 &
PIDS+=("$!")
wait_ready "$INFERMUX_URL/ready" "$!" "infermux serve" "$OUT/infermux_serve.log"

failures=0
for backend in $BACKENDS; do
    if ! backend_serves "$backend"; then
        failures=$((failures + 1))
        continue
    fi
    for scenario in $SCENARIOS; do
        case "$scenario" in
            c*) load=(--concurrency "${scenario#c}") ;;
            sweep) load=(--request-rate "$RATES") ;;
            *) echo "unknown scenario $scenario (use c<N> or sweep)" >&2; exit 2 ;;
        esac
        name="${backend}_${scenario}"
        bench=($INFERMUX bench
            --url "$LLAMA_URL" --compare "$INFERMUX_URL" --model2 smollm2
            --header2 "x-infermux-backend:$backend"
            --workload fixed --num-requests "$NUM_REQUESTS"
            --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos
            "${load[@]}" --warmup "$WARMUP" --seed "$SEED" --slo "$SLO"
            --json "$OUT/$name.json" --plot "$OUT/$name")
        echo "${bench[*]}" >>"$OUT/commands.txt"
        echo "== $name: A = llama_cpp.server, B = infermux ($backend)"
        status=0
        "${bench[@]}" | tee "$OUT/$name.txt" || status=$?
        if [[ $status -ne 0 ]]; then
            echo "!! $name exited with $status (see $OUT/$name.txt)" >&2
            failures=$((failures + 1))
        fi
    done
done
echo "results in $OUT/"
exit $((failures > 0))

#!/usr/bin/env bash
# GPU check of the core engine's Triton kernels, for a session that is lent a CUDA machine:
#   1. the kernel tests (tests/core_engine/kernels) on CUDA, not in the interpreter;
#   2. benchmarks/kernel_decode.py: paged decode and the other kernels vs torch, plus a short
#      end-to-end decode through the core engine.
# Runs in a few minutes on an H100/H200 (most of it Triton's first compiles). See docs/gpu.md.
#
#   scripts/gpu_check.sh
#   scripts/gpu_check.sh --cpu-dry-run   # the same steps on a CPU box (interpreter, tiny shapes),
#                                        # to check the script itself without a GPU
#
# Environment (all optional):
#   PYTHON              the interpreter (default: python3)
#   OUT                 where logs, junit XML and kernel_decode.json go (default: ./gpu_check_out)
#   INFERMUX_WHEEL_DIR  wheels to install missing packages from, offline (default: ./.whl)
# Exit status: 0 only when every kernel test ran and passed (none skipped) and every benchmark
# section ran; 1 when a section failed or was skipped; 2 when torch/triton/CUDA or a package the
# engine imports is missing.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$ROOT/gpu_check_out}
WHEELS=${INFERMUX_WHEEL_DIR:-$ROOT/.whl}
mkdir -p "$OUT_DIR"
DRY_RUN=0
[ "${1:-}" = "--cpu-dry-run" ] && DRY_RUN=1

# The repo is importable without an install; the tests put tensors on the GPU, and Triton
# must compile for it rather than interpret.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # progress shows through tee
unset TRITON_INTERPRET INFERMUX_KERNELS
export INFERMUX_TEST_DEVICE=cuda
BENCH_ARGS=(--device cuda)
if [ "$DRY_RUN" -eq 1 ]; then
    export INFERMUX_TEST_DEVICE=cpu TRITON_INTERPRET=1
    BENCH_ARGS=(--device cpu --quick --no-engine --iters 1)
fi
# Keep Triton 3.9's current default explicitly (silences its deprecation warning).
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}

step() { printf '\n=== %s\n' "$*"; }

# pip_install PKG...: from the carried wheels when there are any, else from the index.
pip_install() {
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$@"
    else
        "$PY" -m pip install -q --retries 0 --timeout 10 "$@"
    fi
}

# ensure MODULE [PIP_NAME]: import it, installing it first when missing.
ensure() {
    "$PY" -c "import $1" 2>/dev/null && return 0
    echo "installing ${2:-$1} ..."
    pip_install "${2:-$1}" >/dev/null 2>&1
    "$PY" -c "import $1" 2>/dev/null
}

step "environment"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" --version
if ! "$PY" -c "import torch, triton" 2>/dev/null; then
    if compgen -G "$WHEELS/torch-*.whl" >/dev/null; then
        echo "installing torch and triton from $WHEELS ..."
        "$PY" -m pip install -q --no-index --find-links "$WHEELS" torch triton
    fi
fi
if ! "$PY" -c "import torch, triton" 2>/dev/null; then
    cat <<EOF
ERROR: this check needs a CUDA build of torch and triton in $PY, e.g.
    $PY -m pip install torch --index-url https://download.pytorch.org/whl/cu126   # brings triton
or their wheels in $WHEELS (INFERMUX_WHEEL_DIR). See docs/gpu.md.
EOF
    exit 2
fi
"$PY" - <<'EOF' || exit 2
import torch, triton

print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
import os

if os.environ["INFERMUX_TEST_DEVICE"] == "cpu":
    raise SystemExit(print("dry run on CPU: Triton kernels run in the interpreter"))
if not torch.cuda.is_available():
    raise SystemExit("ERROR: torch sees no CUDA device (a CPU-only torch build, or no driver)")
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
EOF

step "project and light dependencies"
ensure pytest || { echo "ERROR: pytest is missing and could not be installed"; exit 2; }
# What core_engine imports at load (module[:pip name]): the project's dependencies it uses and
# the `core` extra's regex; without one the engine section cannot run.
for spec in numpy msgspec gguf tqdm jinja2 regex llguidance zmq:pyzmq; do
    ensure "${spec%%:*}" "${spec#*:}" || { echo "ERROR: ${spec#*:} is missing and could not be installed"; exit 2; }
done
# An editable install without dependencies (PYTHONPATH above already covers a failure here).
(cd /tmp && "$PY" -c "import core_engine" 2>/dev/null) \
    || "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >/dev/null 2>&1 \
    || echo "note: editable install skipped; using PYTHONPATH=$ROOT"

step "kernel tests on $INFERMUX_TEST_DEVICE"
# Only the kernel folder's conftest: the gateway fixtures in tests/conftest.py need none of this.
timeout 200 "$PY" -m pytest tests/core_engine/kernels -q -p no:cacheprovider \
    --confcutdir=tests/core_engine/kernels --junitxml="$OUT_DIR/kernel_tests.xml" \
    2>&1 | tee "$OUT_DIR/kernel_tests.log"
tests_rc=${PIPESTATUS[0]}
# A skipped kernel test is a kernel not checked on this machine: the check fails.
num_skipped=$("$PY" -c 'import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); print(sum(int(s.get("skipped", 0)) for s in r.iter("testsuite")))' "$OUT_DIR/kernel_tests.xml" 2>/dev/null || echo unknown)
if [ "$tests_rc" -eq 0 ] && [ "$num_skipped" != 0 ]; then
    echo "ERROR: $num_skipped kernel test(s) skipped (see $OUT_DIR/kernel_tests.log)"
    tests_rc=1
fi

step "decode benchmark"
timeout 150 "$PY" benchmarks/kernel_decode.py "${BENCH_ARGS[@]}" --json "$OUT_DIR/kernel_decode.json" \
    2>&1 | tee "$OUT_DIR/kernel_decode.log"
bench_rc=${PIPESTATUS[0]}

step "summary"
echo "kernel tests: $([ "$tests_rc" -eq 0 ] && echo passed || echo "FAILED (exit $tests_rc)")"
echo "benchmark:    $([ "$bench_rc" -eq 0 ] && echo ran || echo "FAILED or a section skipped (exit $bench_rc)")"
echo "results in $OUT_DIR"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]

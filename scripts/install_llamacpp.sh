#!/usr/bin/env bash
# Builds llama-cpp-python from source once per (version, build flags, CPU) and installs it.
#
# pip's own wheel cache is keyed on the sdist alone: it would hand a wheel built with other
# CMAKE_ARGS, or on another CPU (-march=native), to this machine. So the wheel is built with
# pip's cache off into a folder keyed on what decides the machine code, and installed from there.
#
# The build emits no AMX code (-mno-amx-*): with -march=native on a Xeon with AMX, llama.cpp's
# AMX buffer type takes Q4_0/Q4_1/Q8_0 weights and its kernels crash (SIGSEGV in decode,
# SIGILL in llama-bench) where the OS has not granted the AMX tile state. GCC gives explicit
# -mno-* options precedence over -march=native, so __AMX_INT8__ is never defined and the AMX
# buffer type is not compiled in; AVX-512/VNNI/AVX2 and the CPU repack stay on.
# backends/_llamacpp_safety.py checks the same at run time for wheels built elsewhere.
set -euo pipefail
PY="${1:?usage: install_llamacpp.sh PYTHON}"
VERSION="${LLAMACPP_VERSION:-0.3.36}"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON} -DCMAKE_C_FLAGS='${NO_AMX}' -DCMAKE_CXX_FLAGS='${NO_AMX}'"
FLAGS="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | sort | tr '\n' ' ' || true)"
KEY="$(printf '%s|%s|%s|%s' "$VERSION" "$CMAKE_ARGS" "$FLAGS" "$(uname -m)" | sha256sum | cut -c1-16)"
CACHE="${INFERMUX_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/infermux/wheels}/llama-cpp-python-$KEY"
if ! ls "$CACHE"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $VERSION for this CPU (about 5 minutes on 2 cores) -> $CACHE"
    rm -rf "$CACHE.tmp" && mkdir -p "$CACHE.tmp"
    "$PY" -m pip wheel -q --no-cache-dir --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION" -w "$CACHE.tmp"
    rm -rf "$CACHE" && mv "$CACHE.tmp" "$CACHE"
fi
"$PY" -m pip install -q --force-reinstall --no-deps "$CACHE"/llama_cpp_python-*.whl
"$PY" -m pip install -q "llama-cpp-python==$VERSION"   # its pure-Python dependencies

#!/usr/bin/env bash
# Builds llama.cpp's own C++ `llama-server` once per (version, build flags, CPU) and prints the
# path of the binary on the last line of stdout. It is the peer of
# benchmarks/serving_vs_llama_server.py.
#
# The sources are the llama.cpp tree vendored in the llama-cpp-python sdist (vendor/llama.cpp),
# unpacked once into the cache by scripts/llamacpp_sources.sh, so llama-server and infermux's `llamacpp` backend run
# the same llama.cpp code. Nothing is fetched from GitHub and nothing is committed.
#
# The flags match scripts/install_llamacpp.sh: -march=native (GGML_NATIVE) with no AMX code
# (see the reason there), and the same cache key (version, cmake options, the sorted CPU flags
# of /proc/cpuinfo, machine). Also:
#   -DBUILD_SHARED_LIBS=OFF      one self-contained binary, so only it needs to be kept
#   -DLLAMA_OPENSSL=OFF          no HTTPS client (it only serves on loopback here)
#   -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
#                                no Web UI: otherwise the build downloads it from Hugging Face
# LLAMA_CURL is gone from this tree (a deprecated no-op), so it is not passed.
#
#   scripts/build_llama_server.sh              # ~10 minutes on 2 cores the first time
#   LLAMACPP_VERSION=0.3.36 JOBS=2 scripts/build_llama_server.sh
# Environment: LLAMACPP_VERSION (default 0.3.36), JOBS (default 2), PY (the Python whose pip
# downloads the sdist; default .venv/bin/python, else python3), INFERMUX_BUILD_CACHE (default
# ~/.cache/infermux/llama-server).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${LLAMACPP_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=".venv/bin/python"; else PY="python3"; fi
fi
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_OPTIONS=(
    -DCMAKE_BUILD_TYPE=Release
    -DGGML_NATIVE=ON
    "-DCMAKE_C_FLAGS=${NO_AMX}"
    "-DCMAKE_CXX_FLAGS=${NO_AMX}"
    -DBUILD_SHARED_LIBS=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
)
FLAGS="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | sort | tr '\n' ' ' || true)"
KEY="$(printf '%s|%s|%s|%s' "$VERSION" "${CMAKE_OPTIONS[*]}" "$FLAGS" "$(uname -m)" | sha256sum | cut -c1-16)"
CACHE="${INFERMUX_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/infermux/llama-server}/llama-server-$VERSION-$KEY"
BINARY="$CACHE/llama-server"

if [[ ! -x "$BINARY" ]]; then
    # Progress goes to stderr: stdout's last line is the binary's path.
    log() { echo "build_llama_server: $*" >&2; }
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT
    started=$SECONDS
    log "building llama-server from llama-cpp-python $VERSION for this CPU -> $CACHE"
    SRC="$(PY="$PY" LLAMACPP_VERSION="$VERSION" scripts/llamacpp_sources.sh | tail -n 1)"
    [[ -f "$SRC/tools/server/CMakeLists.txt" ]] || { log "no llama-server sources in $SRC"; exit 1; }
    GENERATOR=()
    if command -v ninja >/dev/null 2>&1; then GENERATOR=(-G Ninja); fi  # [n/N] progress lines
    log "configuring (cmake ${CMAKE_OPTIONS[*]}) ..."
    cmake -S "$SRC" -B "$WORK/build" "${GENERATOR[@]}" "${CMAKE_OPTIONS[@]}" >"$WORK/configure.log" 2>&1 \
        || { tail -n 40 "$WORK/configure.log" >&2; exit 1; }
    log "compiling with $JOBS jobs (about 10 minutes on 2 cores) ..."
    cmake --build "$WORK/build" --target llama-server -j "$JOBS" >&2
    "$WORK/build/bin/llama-server" --version >&2 || true
    rm -rf "$CACHE.tmp" && mkdir -p "$CACHE.tmp"
    cp "$WORK/build/bin/llama-server" "$CACHE.tmp/"
    printf '%s\n' "llama-cpp-python $VERSION (vendor/llama.cpp)" "cmake ${CMAKE_OPTIONS[*]}" \
        "built $(date -u +%FT%TZ) in $((SECONDS - started)) s" >"$CACHE.tmp/BUILD_INFO"
    rm -rf "$CACHE" && mv "$CACHE.tmp" "$CACHE"
    log "built in $((SECONDS - started)) s"
fi
echo "$BINARY"

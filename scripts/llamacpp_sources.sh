#!/usr/bin/env bash
# Unpacks the llama-cpp-python sdist (from PyPI) once into the cache and prints the path of its
# vendored llama.cpp tree on the last line of stdout. One copy serves every user of it:
#   - scripts/build_llama_server.sh builds llama.cpp's C++ llama-server from it;
#   - the tests read llama.cpp's corpus of real artifacts from it (models/templates/*.jinja,
#     the vocab-only models/ggml-vocab-*.gguf with their .inp/.out tokenizer test vectors):
#     tests/real_artifacts.py finds it. Nothing of it is committed.
#
#   scripts/llamacpp_sources.sh           # ~5 s the first time (a 77 MB download), then free
# Environment: LLAMACPP_VERSION (default 0.3.36), PY (the Python whose pip downloads; default
# .venv/bin/python, else python3), INFERMUX_CACHE_DIR (default ~/.cache/infermux).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION="${LLAMACPP_VERSION:-0.3.36}"
if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=".venv/bin/python"; else PY="python3"; fi
fi
ROOT="${INFERMUX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/infermux}/sources"
TREE="$ROOT/llama_cpp_python-$VERSION"
if [[ ! -f "$TREE/.complete" ]]; then
    echo "llamacpp_sources: downloading and unpacking llama-cpp-python $VERSION -> $TREE" >&2
    mkdir -p "$ROOT"
    WORK="$(mktemp -d "$ROOT/.download.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK" >&2
    tar -xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
    rm -rf "$TREE" && mv "$WORK/llama_cpp_python-$VERSION" "$TREE"
    touch "$TREE/.complete"
fi
echo "$TREE/vendor/llama.cpp"

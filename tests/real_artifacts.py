"""Where the tests find llama.cpp's corpus of real artifacts users bring.

The llama-cpp-python sdist this project already builds from vendors llama.cpp with
``models/templates/*.jinja`` (real chat templates of the model families people serve) and
``models/ggml-vocab-*.gguf`` (vocab-only GGUFs written by llama.cpp's converter, with ``.inp``
/ ``.out`` tokenizer test vectors). ``scripts/llamacpp_sources.sh`` unpacks it once into the
cache (``make test`` runs it); nothing of it is committed. A test that needs the corpus fails,
never skips, when it is missing: a suite that passed without it would prove nothing.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import pytest

__all__ = ["llamacpp_tree", "templates_dir", "vocab_dir"]

VERSION = os.environ.get("LLAMACPP_VERSION", "0.3.36")


@cache
def llamacpp_tree() -> Path:
    """The unpacked ``vendor/llama.cpp`` of the llama-cpp-python sdist (fails if absent)."""
    root = Path(os.environ.get("INFERMUX_CACHE_DIR", Path.home() / ".cache" / "infermux"))
    tree = root / "sources" / f"llama_cpp_python-{VERSION}"
    if not (tree / ".complete").is_file():
        pytest.fail(
            f"llama.cpp's corpus of real artifacts is missing ({tree}): run "
            "scripts/llamacpp_sources.sh (make test does)",
            pytrace=False,
        )
    return tree / "vendor" / "llama.cpp"


def templates_dir() -> Path:
    """``models/templates``: the real chat templates (``*.jinja``)."""
    return llamacpp_tree() / "models" / "templates"


def vocab_dir() -> Path:
    """``models``: ``ggml-vocab-*.gguf`` and their ``.inp``/``.out`` test vectors."""
    return llamacpp_tree() / "models"

"""Tiny models trained on a text, as F32 GGUFs built once per machine and cached.

``test_quantized_architectures.py`` needs, per architecture, a tiny model that has learnt its
text (so that quantisation rarely flips its top token, as with a real model). Training one
takes 30-100 s on 2 cores (300 AdamW steps), which made the test's duration depend on
whatever else ran beside it. So the tests never train: ``scripts/build_test_artifacts.py``
(run by ``make test`` before pytest) calls :func:`build` for each architecture, and the
tests ask :func:`trained_gguf` for the file, which fails, naming that command, where it
has not been built.

The files live in ``$INFERMUX_CACHE_DIR/test-artifacts`` (default
``~/.cache/infermux/test-artifacts``, beside the compiled kernels), each named by a key of
everything that decides its bytes (:func:`recipe`): the architecture and sizes, the steps,
sequence length and seed, the text, the torch / transformers / gguf versions and the source
of this module and of the factories that build and write the model. Training rounds
differently on different CPUs and thread counts; any of those files serves the test (it
compares the engine with llama.cpp on the same file), so they are not part of the key.
A build writes its file under a file lock, then renames it into place.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import inspect
import json
import os
from pathlib import Path
from typing import Any

from tests.core_engine.hf_factory import ARCHITECTURES

__all__ = ["ARCHITECTURES", "BUILD_COMMAND", "build", "cache_dir", "recipe", "trained_gguf"]

_HERE = Path(__file__).resolve().parent

#: The command that builds every artifact (what a failing test tells its reader to run).
BUILD_COMMAND = ".venv/bin/python scripts/build_test_artifacts.py"

#: Rows of 256 in every matrix (hidden 256, 4 heads of 64, FFN and experts of 256), so that
#: the K-quants apply to them.
_SIZES: dict[str, int] = {"hidden_size": 256, "intermediate_size": 256}
_OWN_SIZES: dict[str, dict[str, int]] = {
    "qwen3": {"head_dim": 64}, "qwen3moe": {"head_dim": 64, "moe_intermediate_size": 256},
    "mixtral": {"intermediate_size": 256}, "gemma2": {"head_dim": 64, "query_pre_attn_scalar": 64},
    "gemma3": {"head_dim": 64, "query_pre_attn_scalar": 64},
}
STEPS = 300
SEQ_LEN = 128
SEED = 0


def cache_dir() -> Path:
    return Path(os.environ.get("INFERMUX_CACHE_DIR", Path.home() / ".cache" / "infermux")) / "test-artifacts"


def _text() -> str:
    from tests.core_engine.test_tensor_types import TEXT

    return TEXT


def _sha256(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _vocab_sha256() -> str:
    from tests.core_engine import gguf_factory

    parts = [inspect.getsource(gguf_factory.build_tiny_vocab), gguf_factory._CORPUS, repr(gguf_factory.SPECIAL_TOKENS)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def recipe(arch: str) -> dict[str, Any]:
    """Everything that decides the bytes of ``arch``'s trained file."""
    import torch

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}; got {arch!r}")
    return {
        "arch": arch,
        "sizes": _SIZES | _OWN_SIZES.get(arch, {}),
        "steps": STEPS,
        "seq_len": SEQ_LEN,
        "seed": SEED,
        "text_sha256": hashlib.sha256(_text().encode()).hexdigest(),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "gguf": importlib.metadata.version("gguf"),
        "sources_sha256": _sha256(Path(__file__).resolve(), _HERE / "hf_factory.py"),
        # Of gguf_factory.py only what the tiny vocabulary is made of: helpers added there
        # for other tests do not make every machine train again.
        "vocab_sha256": _vocab_sha256(),
    }


def _path(arch: str) -> tuple[Path, dict[str, Any]]:
    facts = recipe(arch)
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"tiny-{arch}-{key}.gguf", facts


def trained_gguf(arch: str) -> Path:
    """The cached trained F32 GGUF of ``arch``; FileNotFoundError naming the build command
    where this machine has not built it (or its inputs changed since)."""
    path, _ = _path(arch)
    if not path.is_file():
        raise FileNotFoundError(
            f"no trained tiny {arch} model at {path} (built once per machine and inputs): run `{BUILD_COMMAND}`"
        )
    return path


def build(arch: str) -> tuple[Path, bool]:
    """Train ``arch``'s tiny model and write its F32 GGUF, unless the cache has it.
    Returns the path and whether it was built now."""
    from core_engine.gguf_loader import GGUFFile
    from tests.core_engine.hf_factory import tiny_hf_model, train_tiny, write_gguf

    path, facts = _path(arch)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return path, False
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            model = tiny_hf_model(arch, seed=SEED, **facts["sizes"])
            # The text in the tiny vocabulary (the same tokenizer the GGUF carries).
            ids = GGUFFile(write_gguf(model, partial)).tokenizer().encode(_text())
            train_tiny(model, ids, steps=STEPS, seq_len=SEQ_LEN, seed=SEED)
            write_gguf(model, partial)
            path.with_suffix(".json").write_text(json.dumps(facts, indent=2, sort_keys=True))
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
    return path, True

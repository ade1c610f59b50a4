"""Expensive test inputs, built once per machine and cached under a key of their inputs.

Nine real-vocabulary models written from vocabularies of up to 150k tokens, SmolLM2
requantised by llama.cpp: each takes seconds on 2 cores, and building them at test time made
a test's duration depend on what ran beside it. (The trained tiny models of
``tests/core_engine/trained_tiny.py`` follow the same scheme with their own key, and are never
built by a test: training takes minutes.)
``scripts/build_test_artifacts.py`` (run by ``make test`` before pytest) builds every one; a
test asks for its file by the same recipe and gets the cached one. A test that finds none
(its inputs changed since the script ran, or a test run on its own) builds it then, once, under
the same lock: the suite never depends on the script having run, only its speed does.

The files live in ``$INFERMUX_CACHE_DIR/test-artifacts`` (default
``~/.cache/infermux/test-artifacts``, beside the compiled kernels), each named by a key of
everything that decides its bytes (the ``facts`` a caller gives, kept beside it as JSON).
A build writes under a file lock, then renames into place: two xdist workers never build
the same file twice or read a half-written one.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["cache_dir", "cached_file", "file_sha256", "versions"]


def cache_dir() -> Path:
    return Path(os.environ.get("INFERMUX_CACHE_DIR", Path.home() / ".cache" / "infermux")) / "test-artifacts"


def file_sha256(*paths: Path) -> str:
    """One digest of the bytes of ``paths``, in order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def versions(*packages: str) -> dict[str, str]:
    """The installed version of each package (what wrote or computed the file)."""
    return {name: importlib.metadata.version(name) for name in packages}


def artifact_path(name: str, facts: dict[str, Any], suffix: str = ".gguf") -> Path:
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"{name}-{key}{suffix}"


def cached_file(
    name: str, facts: dict[str, Any], build: Callable[[Path], object], *, suffix: str = ".gguf"
) -> tuple[Path, bool]:
    """The cached file of ``name`` made from ``facts`` (everything that decides its bytes):
    ``build(partial)`` writes it at ``partial`` where it is missing. Returns the path and
    whether it was built now."""
    path = artifact_path(name, facts, suffix)
    if path.is_file():
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():  # another worker built it while this one waited
            return path, False
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            build(partial)
            path.with_suffix(".json").write_text(json.dumps(facts, indent=2, sort_keys=True))
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
    return path, True

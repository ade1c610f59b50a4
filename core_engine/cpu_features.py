"""What this CPU can do, read once from ``/proc/cpuinfo`` (empty off Linux)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

__all__ = ["cpu_flags", "cpu_model"]


@cache
def cpu_flags() -> frozenset[str]:
    """The kernel's feature flags of the first CPU (``avx512f``, ``avx512_bf16``...)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@cache
def cpu_model() -> str:
    """The kernel's model name of the first CPU ("AMD EPYC"), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor()

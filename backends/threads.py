"""How many threads each engine computes with when its config names no number.

``INFERMUX_NUM_THREADS`` (an integer ≥ 1) sets it for every engine of the process and of the
processes it starts (engine workers inherit the environment); without it, 2. It is the default
of ``llamacpp``'s ``n_threads``, ``core_engine``'s ``num_threads`` and of the OpenBLAS threads
under ``mlx`` (backends/mlx/cpu_blas.py); an explicit option still wins.

Why it matters: llama.cpp's worker threads spin while they wait for each other, so engines
whose threads together outnumber the cores do not share them, they fight. Measured on a 2-core
AMD EPYC: two llama.cpp processes decoding 200 tokens at the same time took 130 s each with 2
threads apiece and 2.6 s each with 1. Where several engines decode at once on few cores, give
each its share. (Tried on the test suite, two pytest workers at 1 thread each: slower, not
faster, e.g. tests/routing/test_resume_live.py 95 s -> 179 s, because the workers are seldom
both computing; so the suite keeps the default.)
"""

from __future__ import annotations

import os

__all__ = ["ENV", "default_num_threads"]

ENV = "INFERMUX_NUM_THREADS"
_FALLBACK = 2


def default_num_threads() -> int:
    """``INFERMUX_NUM_THREADS`` if set (ValueError names it when it is not an integer ≥ 1), else 2."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return _FALLBACK
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{ENV} must be an integer >= 1, got {raw!r}")
    return value

"""Kernel tests. Four kinds of module live here:

* ``test_kernel_reference.py`` (and the dispatch tests in it): the torch references against
  plain formulas. Always collected; they run on ``INFERMUX_TEST_DEVICE`` (default ``cpu``).
* ``test_triton_*.py``: each Triton kernel against its reference. They need a place where
  Triton runs: ``INFERMUX_TEST_DEVICE=cuda`` (scripts/gpu_check.sh) or the CPU interpreter
  (``TRITON_INTERPRET=1``). The variable must be set before triton is first imported and it
  changes what every ``@triton.jit`` builds, so a plain ``pytest`` run does not set it:
* ``test_kernel_interpreter.py`` runs the ``test_triton_*`` modules in a child pytest with it;
* ``test_kernel_compile.py`` compiles every kernel for sm_90/sm_80 without a GPU.

The last two only run in a plain CPU run (on CUDA the kernels run for real; interpreted
kernels cannot be compiled). By hand: ``TRITON_INTERPRET=1 python -m pytest
tests/core_engine/kernels --confcutdir=tests/core_engine/kernels``.
"""

from __future__ import annotations

import os

import pytest
import torch

from core_engine.kernels.dispatch import interpreter_enabled

# Keep Triton 3.9's FP-fusion default explicitly (as scripts/gpu_check.sh does), which also
# silences its deprecation warning in the compile tests.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

_DEVICE = os.environ.get("INFERMUX_TEST_DEVICE", "cpu").strip() or "cpu"
_TRITON_RUNS_HERE = _DEVICE == "cuda" or interpreter_enabled()

# Exactly one of the two ways to run the Triton tests is collected.
if _TRITON_RUNS_HERE:
    collect_ignore_glob = ["test_kernel_interpreter.py", "test_kernel_compile.py"]
else:
    collect_ignore_glob = ["test_triton_*.py"]


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernel tests put their tensors (``INFERMUX_TEST_DEVICE``, default cpu)."""
    dev = torch.device(_DEVICE)
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.fail("INFERMUX_TEST_DEVICE=cuda but torch sees no CUDA device")
    return dev

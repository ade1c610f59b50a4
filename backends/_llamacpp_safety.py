"""Model parameters that keep llama.cpp from crashing on the CPU it runs on.

On Xeons with AMX, a llama.cpp built with ``-march=native`` compiles in its AMX buffer type;
at load it moves Q4_0/Q4_1/Q8_0 weights there and its AMX kernels then die in the first
multi-token ``llama_decode`` (SIGSEGV in the Python bindings, SIGILL in ``llama-bench``)
where the OS has not granted the AMX tile state. ``make`` builds llama-cpp-python without
AMX code (``scripts/install_llamacpp.sh``), so the buffer type does not exist. A wheel built
elsewhere may still have it: :func:`apply_cpu_safety` then turns off llama.cpp's extra buffer
types (AMX and the CPU repack) for the model. Nothing changes for a build without AMX.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

__all__ = ["apply_cpu_safety", "library_has_amx"]

logger = logging.getLogger(__name__)


@functools.cache
def library_has_amx() -> bool:
    """True when the loaded llama.cpp was compiled with AMX kernels (its system info says so)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode("utf-8", errors="replace")
    return re.search(r"\bAMX_INT8\s*=\s*1\b", info) is not None


def apply_cpu_safety(model_params: Any) -> Any:
    """Turn off extra buffer types in ``model_params`` (a ``llama_model_params``) when unsafe."""
    if library_has_amx() and getattr(model_params, "use_extra_bufts", False):
        logger.warning(
            "this llama.cpp was built with AMX kernels, which crash on this machine class; "
            "serving with extra buffer types off (rebuild with scripts/install_llamacpp.sh "
            "to keep the CPU repack)"
        )
        model_params.use_extra_bufts = False
    return model_params

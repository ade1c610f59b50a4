"""MLX on a Linux CPU: an optimized BLAS under MLX's matmuls, and dense weights to use it.

The ``mlx[cpu]`` wheel links the reference (netlib) BLAS: its float32 ``cblas_sgemm`` is
unvectorized and single-threaded, and MLX's own 4-bit/8-bit quantized matmul on the CPU is no
faster. NumPy's wheel already carries OpenBLAS (``numpy.libs/libscipy_openblas64_*.so``), with
its symbols renamed (``scipy_cblas_sgemm64_``, 64-bit integers), so the dynamic linker cannot
use it for MLX as it is. :func:`use_openblas` compiles a forwarder of a few lines
(``cblas_sgemm`` → ``scipy_cblas_sgemm64_``) once per machine into the kernel cache and loads
it with ``RTLD_GLOBAL`` before MLX is imported: libmlx's calls to ``cblas_sgemm`` then bind to
OpenBLAS (global scope is searched before a library's own dependencies). Measured on SmolLM2-135M
(docs/benchmarks.md, MLX backend): prefill 8.5 → ~290 tok/s, decode 128 → 60 ms per token, with
:func:`dequantize` turning the quantized layers into float32 ones that use it.

Nothing here is needed for correctness: without a C compiler or NumPy's OpenBLAS the backend
logs why and runs on the reference BLAS, as before. macOS (Accelerate) is left alone.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from backends.threads import default_num_threads
from core_engine.private_files import private_dir, record_sha256, unverified_reason

__all__ = ["dense_bytes", "dequantize", "use_openblas"]

logger = logging.getLogger(__name__)

# The two routines libmlx.so takes from BLAS for float32 and float64 matmuls, forwarded to the
# ILP64 OpenBLAS of NumPy's wheel (enums stay ``int``; sizes and strides become ``int64``).
_SHIM = r"""
#include <stdint.h>
typedef int64_t blasint64;
extern void scipy_cblas_sgemm64_(int, int, int, blasint64, blasint64, blasint64, float,
    const float *, blasint64, const float *, blasint64, float, float *, blasint64);
extern void scipy_cblas_dgemm64_(int, int, int, blasint64, blasint64, blasint64, double,
    const double *, blasint64, const double *, blasint64, double, double *, blasint64);
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
    int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  scipy_cblas_sgemm64_(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha, const double *a,
    int lda, const double *b, int ldb, double beta, double *c, int ldc) {
  scipy_cblas_dgemm64_(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""


def _numpy_openblas() -> Path | None:
    """NumPy's bundled ILP64 OpenBLAS (manylinux wheels), without importing NumPy."""
    spec = importlib.util.find_spec("numpy")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = Path(next(iter(spec.submodule_search_locations))).parent / "numpy.libs"
    found = sorted(libs.glob("libscipy_openblas64_*.so*"))
    return found[0] if found else None


def _cache_dir() -> Path:
    return Path(os.environ.get("INFERMUX_CACHE_DIR", Path.home() / ".cache" / "infermux")) / "kernels"


@cache
def use_openblas() -> str | None:
    """Put NumPy's OpenBLAS under MLX's float matmuls in this process; call before MLX runs.

    Returns the library now in use, or None (and logs why) where the reference BLAS stays:
    not Linux, ``INFERMUX_MLX_BLAS=reference``, no OpenBLAS in NumPy's wheel, no C compiler.
    """
    if not sys.platform.startswith("linux") or os.environ.get("INFERMUX_MLX_BLAS") == "reference":
        return None
    if "mlx.core" in sys.modules:
        logger.warning("MLX was imported before its BLAS could be chosen: the reference BLAS stays")
        return None
    library = _numpy_openblas()
    if library is None:
        logger.info("MLX on the CPU: no OpenBLAS in NumPy's wheel, the reference BLAS stays (slow)")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("MLX on the CPU: no C compiler to link OpenBLAS, the reference BLAS stays (slow)")
        return None
    command = [compiler, "-O2", "-shared", "-fPIC", "-x", "c", "-", "-x", "none", "-o", "{out}",
               f"-L{library.parent}", f"-l:{library.name}", f"-Wl,-rpath,{library.parent}"]
    key = hashlib.sha256("\0".join([_SHIM, str(library), *command]).encode()).hexdigest()[:16]
    try:
        # The compiled kernels' cache and its checks (core_engine/kernels/cpu): a library is
        # loaded only if this user built it and its recorded SHA-256 matches.
        directory = private_dir(_cache_dir(), confidential=False)
        target = directory / f"infermux_mlx_openblas-{key}.so"
        lock_fd = os.open(directory / "infermux_mlx_openblas.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with open(lock_fd, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if unverified_reason(target) is not None:
                with tempfile.TemporaryDirectory(dir=directory, prefix=".infermux_mlx_openblas-") as scratch:
                    partial = Path(scratch) / target.name
                    result = subprocess.run(
                        [part.replace("{out}", str(partial)) for part in command],
                        input=_SHIM, capture_output=True, text=True, check=False,
                    )
                    if result.returncode != 0:
                        logger.warning("MLX on the CPU: linking OpenBLAS failed, the reference BLAS "
                                       "stays (slow):\n%s", result.stderr[-2000:])
                        return None
                    os.chmod(partial, 0o600)
                    partial.replace(target)
                record_sha256(target)
        ctypes.CDLL(str(target), mode=ctypes.RTLD_GLOBAL)
        # As many threads as the engine's share of the cores (backends/threads.py): OpenBLAS's
        # own default, every core, fights the other engines' threads.
        openblas = ctypes.CDLL(str(library))
        openblas.scipy_openblas_set_num_threads64_(ctypes.c_int(default_num_threads()))
    except OSError as exc:
        logger.warning("MLX on the CPU: could not load OpenBLAS (%s), the reference BLAS stays", exc)
        return None
    logger.info("MLX on the CPU: float matmuls through OpenBLAS (%s, %d threads)", library.name, default_num_threads())
    return library.name


def dense_bytes(model: Any) -> int:
    """Bytes the model's parameters would take with every quantized layer made float32."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    leaves: Any = tree_flatten(model.parameters())
    total = sum(int(value.nbytes) for _, value in leaves)
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            rows, packed = module.weight.shape
            extra = sum(int(getattr(module, name).nbytes) for name in ("weight", "scales", "biases") if name in module)
            total += rows * packed * (32 // module.bits) * 4 - extra
    return total


def dequantize(model: Any, dtype: Any) -> int:
    """Replace every quantized linear and embedding layer of ``model`` by a float one in
    ``dtype`` holding the same (exactly dequantized) weights; returns how many were replaced."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    replaced: list[tuple[str, Any]] = []
    for path, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        weight = mx.dequantize(
            module.weight, module.scales, module.biases, module.group_size, module.bits
        ).astype(dtype)
        if isinstance(module, nn.QuantizedEmbedding):
            dense: Any = nn.Embedding(weight.shape[0], weight.shape[1])
        else:
            dense = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                dense.bias = module.bias.astype(dtype)
        dense.weight = weight
        replaced.append((path, dense))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
        mx.eval(model.parameters())
    return len(replaced)

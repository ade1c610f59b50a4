"""C++ kernels for the core engine's CPU path, compiled on first use.

``int8_linear.cpp`` is built with the system C++ compiler against the installed torch into
``$INFERMUX_CACHE_DIR`` (default ``~/.cache/infermux/kernels``), keyed by a hash of the source,
the torch version, the CPU's features and the compiler flags, so a machine compiles it once (~30 s on 2 cores) and
later processes load the shared library. A file lock keeps concurrent first uses (e.g. several
gateway workers) from building it twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from core_engine.cpu_features import cpu_flags

__all__ = ["KernelBuildError", "int8_linear_module"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("int8_linear.cpp")
_MODULE = "infermux_int8_linear"


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled or loaded (message has the compiler's output)."""


def _cache_dir() -> Path:
    return Path(os.environ.get("INFERMUX_CACHE_DIR", Path.home() / ".cache" / "infermux")) / "kernels"


def _compile_command(output: Path) -> list[str]:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (install g++ or set CXX)")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    lib_dir = cpp_extension.library_paths()[0]
    return [
        # -fopenmp for ATen's header-inline parallel_for; the libgomp.so.1 it links is the one
        # torch has already loaded (same soname), so there is one OpenMP runtime.
        compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DTORCH_EXTENSION_NAME={_MODULE}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-I{path}" for path in includes),
        str(_SOURCE), "-o", str(output),
        f"-L{lib_dir}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib_dir}",
    ]


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_MODULE, path)
    if spec is None or spec.loader is None:
        raise KernelBuildError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def int8_linear_module() -> ModuleType:
    """The compiled ``int8_linear`` extension (built here on the first call on a machine)."""
    # -march=native: a home directory shared by different CPUs must not share the library.
    key_parts = [_SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode()]
    key_parts.append(" ".join(sorted(cpu_flags())).encode())
    probe = _compile_command(Path("out.so"))
    key_parts.append(" ".join(probe).encode())
    key = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{_MODULE}-{key}.so"
    with open(directory / f"{_MODULE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            logger.info("compiling the int8 CPU kernel (one-off on this machine, ~30 s)...")
            started = time.perf_counter()
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            result = subprocess.run(_compile_command(partial), capture_output=True, text=True)
            if result.returncode != 0:
                partial.unlink(missing_ok=True)
                raise KernelBuildError(f"compiling {_SOURCE.name} failed:\n{result.stderr[-4000:]}")
            partial.replace(target)
            logger.info("int8 CPU kernel compiled in %.0f s: %s", time.perf_counter() - started, target)
    return _load(target)

"""C++ kernels for the core engine's CPU path, compiled on first use.

Each ``<name>.cpp`` here is one pybind11 extension, built by :func:`cpu_extension` with the
system C++ compiler against the installed torch into ``$INFERMUX_CACHE_DIR`` (default
``~/.cache/infermux/kernels``), keyed by a hash of the source, the torch version, the CPU's
features and the compiler flags (``-march=native``: the instructions this CPU has, AVX2,
AVX-512 VNNI or AMX, are chosen by the compiler's macros in the source), so a machine compiles
each once (~30 s on 2 cores) and later processes load the shared library. A file lock keeps
concurrent first uses (e.g. several gateway workers) from building it twice.

Loading a library runs its code, so the cache is this user's alone: the ``kernels`` folder is
created ``0700`` and refused (:class:`KernelBuildError` naming it) when another user owns it
or group/other may write to it. Each build goes to a fresh private temporary folder; the
library is moved into place ``0600`` and its SHA-256 is written beside it
(``<library>.sha256``, ``0600``). Before a load, the library and that record must be regular
files of this user that group/other cannot write (else refused: someone else put them there)
and the library's hash must match the record (else, e.g. a library of an older version with
no record, a build cut short or a changed file: it is rebuilt).
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
import tempfile
import time
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from core_engine.cpu_features import cpu_flags
from core_engine.private_files import UnsafePathError, private_dir, record_sha256, unverified_reason

__all__ = ["KernelBuildError", "cpu_extension"]

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled or loaded (message has the compiler's output)."""


def _cache_dir() -> Path:
    return Path(os.environ.get("INFERMUX_CACHE_DIR", Path.home() / ".cache" / "infermux")) / "kernels"


def _compile_command(source: Path, module: str, output: Path, march: str = "native") -> list[str]:
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
        compiler, "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DTORCH_EXTENSION_NAME={module}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-I{path}" for path in includes),
        str(source), "-o", str(output),
        f"-L{lib_dir}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib_dir}",
    ]


def _build(source: Path, module: str, target: Path, march: str) -> None:
    """Compile into a private temporary folder, then move the library into place with its hash."""
    logger.info("compiling the %s CPU kernel (one-off on this machine, ~30 s)...", source.stem)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{module}-") as scratch:
        partial = Path(scratch) / target.name
        result = subprocess.run(_compile_command(source, module, partial, march), capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(f"compiling {source.name} failed:\n{result.stderr[-4000:]}")
        os.chmod(partial, 0o600)
        partial.replace(target)
    record_sha256(target)  # until it is written, the library has no record: rebuilt, never loaded
    logger.info("%s CPU kernel compiled in %.0f s: %s", source.stem, time.perf_counter() - started, target)


def _stale_reason(target: Path) -> str | None:
    """Why ``target`` must be rebuilt (None: it is the library this user built, unchanged).

    Raises :class:`KernelBuildError` for a library or record that is a link, of another owner
    or writable by group/other: someone else's file, never loaded nor silently replaced."""
    try:
        return unverified_reason(target)
    except UnsafePathError as exc:
        raise KernelBuildError(f"{exc} (remove it, and the kernel is rebuilt)") from exc
    except OSError as exc:  # ELOOP: a symbolic link
        raise KernelBuildError(f"cannot use {exc.filename}: {exc.strerror} (remove it)") from exc


def _load(module: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module, path)
    if spec is None or spec.loader is None:
        raise KernelBuildError(f"cannot load {path}")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


@cache
def cpu_extension(name: str, march: str = "native") -> ModuleType:
    """The compiled extension of ``<name>.cpp`` in this folder (built on a machine's first call).

    ``march``: the compiler's ``-march``; tests build ``"x86-64"`` (no AVX) to run the portable
    loops of a kernel on a machine whose native build takes the vector paths.
    """
    source = _HERE / f"{name}.cpp"
    if not source.is_file():
        raise KernelBuildError(f"no kernel source {source}")
    module = f"infermux_{name}" if march == "native" else f"infermux_{name}_{march.replace('-', '_')}"
    return cached_build(source, module, march)


def cached_build(source: Path, module: str, march: str = "native") -> ModuleType:
    """Extension ``module`` compiled from ``source`` through the cache (its checks above):
    what :func:`cpu_extension` does for each kernel, and what the cache's own tests do with
    a small source that compiles in a second."""
    # -march=native: a home directory shared by different CPUs must not share the library.
    key_parts = [source.read_bytes(), torch.__version__.encode(), sys.version.encode()]
    key_parts.append(" ".join(sorted(cpu_flags())).encode())
    key_parts.append(" ".join(_compile_command(source, module, Path("out.so"), march)).encode())
    key = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]
    try:
        directory = private_dir(_cache_dir(), confidential=False)
        lock_fd = os.open(directory / f"{module}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise KernelBuildError(f"the kernel cache cannot be used: {exc}") from exc
    target = directory / f"{module}-{key}.so"
    with open(lock_fd, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.lexists(target):
            _build(source, module, target, march)
        elif (reason := _stale_reason(target)) is not None:
            logger.warning("rebuilding the %s CPU kernel %s: %s", source.stem, target, reason)
            _build(source, module, target, march)
    return _load(module, target)

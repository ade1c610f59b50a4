"""C++ kernels for the core engine's CPU path, compiled at install or on first use.

Each ``<name>.cpp`` here is one pybind11 extension, keyed by a hash of the source, the torch
and Python versions, the CPU's features and the compiler flags (``-march=native``: the
instructions this CPU has, AVX2 or AVX-512 VNNI, are chosen by the compiler's macros in the
source). :func:`cpu_extension` loads, in this order:

1. the library built **at install**: ``pip install --no-build-isolation .`` (the image's
   install line, deploy/Dockerfile) runs :func:`prebuild` from ``setup.py`` into this
   package's ``prebuilt/`` folder, so a runtime with no C++ compiler serves the fast path. It
   is used when its key matches (same source, torch, Python, CPU features and flags); it
   must be a regular file of the package files' owner that group/other cannot write, with
   the SHA-256 recorded beside it at the build (else warned and passed over).
2. the library this user compiled before, in ``$INFERMUX_CACHE_DIR`` (default
   ``~/.cache/infermux/kernels``);
3. else it compiles it there with the system C++ compiler (~30 s on 2 cores), once per
   machine: a file lock keeps concurrent first uses (several gateway workers) from building
   it twice. With no compiler this raises :class:`KernelBuildError`, naming the fix.

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
import stat
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

__all__ = ["KernelBuildError", "cpu_extension", "installed_dir", "prebuild"]

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled or loaded (message has the compiler's output)."""


def _cache_dir() -> Path:
    return Path(os.environ.get("INFERMUX_CACHE_DIR", Path.home() / ".cache" / "infermux")) / "kernels"


def installed_dir() -> Path:
    """Where the install put its libraries (:func:`prebuild`): ``prebuilt/`` in this package."""
    return _HERE / "prebuilt"


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelBuildError(
            "no C++ compiler found (install g++ or set CXX), and no library of this kernel was "
            f"built at install for this CPU in {installed_dir()} (install with "
            "`pip install --no-build-isolation .` where a compiler is, as deploy/Dockerfile does)"
        )
    return compiler


def _compile_flags(source: Path, module: str, output: Path, march: str = "native") -> list[str]:
    """The compiler's arguments (all but the compiler itself, which does not key the library:
    the install's compiler and a runtime's, or none, must find the same one)."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    lib_dir = cpp_extension.library_paths()[0]
    return [
        # -fopenmp for ATen's header-inline parallel_for; the libgomp.so.1 it links is the one
        # torch has already loaded (same soname), so there is one OpenMP runtime.
        "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
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
        command = [_compiler(), *_compile_flags(source, module, partial, march)]
        result = subprocess.run(command, capture_output=True, text=True)
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


def _key(source: Path, module: str, march: str) -> str:
    # -march=native: a home directory (or an image) used by different CPUs must not share it.
    key_parts = [source.read_bytes(), torch.__version__.encode(), sys.version.encode()]
    key_parts.append(" ".join(sorted(cpu_flags())).encode())
    # The flags with the file names only: the install compiles the source tree's copy.
    key_parts.append(" ".join(_compile_flags(Path(source.name), module, Path("out.so"), march)).encode())
    return hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]


def _installed_library(module: str, key: str) -> Path | None:
    """The library :func:`prebuild` made at install for this key, once checked; None when
    there is none for this CPU, or (warned) when it is not the file the install wrote."""
    target = installed_dir() / f"{module}-{key}.so"
    if not os.path.lexists(target):
        return None
    owner = os.stat(_HERE / "__init__.py").st_uid  # whoever installed the package's code
    try:
        payloads = []
        for path in (target, target.with_name(target.name + ".sha256")):
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != owner or st.st_mode & 0o022:
                raise UnsafePathError(
                    f"{path} is not a regular file of the package's owner (uid {owner}) closed "
                    f"to group/other writes"
                )
            payloads.append(path.read_bytes())
    except OSError as exc:
        logger.warning("not using the kernel built at install: %s", exc)
        return None
    digest = hashlib.sha256(payloads[0]).hexdigest()
    if digest != payloads[1].decode(errors="replace").strip():
        logger.warning("not using %s: its SHA-256 %s is not the one its install recorded", target, digest)
        return None
    return target


def cached_build(source: Path, module: str, march: str = "native") -> ModuleType:
    """Extension ``module`` compiled from ``source``: the install's library, else through the
    user's cache (the checks in the module docstring); what :func:`cpu_extension` does for
    each kernel, and what the cache's own tests do with a small source that compiles in a
    second."""
    key = _key(source, module, march)
    if (installed := _installed_library(module, key)) is not None:
        logger.info("the %s CPU kernel built at install: %s", source.stem, installed)
        return _load(module, installed)
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


def prebuild(directory: Path) -> list[Path]:
    """Compile every kernel of this folder for this CPU (``-march=native``) into ``directory``
    (``<module>-<key>.so`` and its ``.sha256``, both ``0644``: the install's owner may be
    root, the server another user), in parallel; what ``setup.py`` runs at install, with
    ``directory`` this package's ``prebuilt/`` folder inside the build. Raises
    :class:`KernelBuildError` when a compile fails. Returns the libraries."""
    directory.mkdir(parents=True, exist_ok=True)
    compiler = _compiler()
    jobs = []
    for source in sorted(_HERE.glob("*.cpp")):
        module = f"infermux_{source.stem}"
        target = directory / f"{module}-{_key(source, module, 'native')}.so"
        command = [compiler, *_compile_flags(source, module, target, "native")]
        jobs.append((source, target, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    for source, target, process in jobs:
        _, stderr = process.communicate()
        if process.returncode != 0:
            raise KernelBuildError(f"compiling {source.name} failed:\n{stderr[-4000:]}")
        os.chmod(target, 0o644)
        record = target.with_name(target.name + ".sha256")
        record.write_text(hashlib.sha256(target.read_bytes()).hexdigest() + "\n")
        os.chmod(record, 0o644)
    return [target for _, target, _ in jobs]

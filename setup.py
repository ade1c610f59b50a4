"""The project's build: pyproject.toml says everything but this one step.

A non-editable install compiles the core engine's C++ CPU kernels for this machine's CPU into
the package (``core_engine/kernels/cpu/prebuilt/``), so a runtime with no C++ compiler serves
the fast path (core_engine/kernels/cpu/__init__.py says how a library is found and checked).
It needs torch at build time, so install with the venv's torch visible:
``pip install --no-build-isolation ".[core]"`` (deploy/Dockerfile does).

``INFERMUX_BUILD_KERNELS``: ``1`` fails the install when the kernels cannot be built (the
image sets it: an image that would compile at its first request is a broken image); ``0``
skips them; unset builds them when torch and a compiler are there and otherwise says why not
(they are then compiled at first use, as an editable install's are).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithKernels(build_py):
    """``build_py``, then the CPU kernels into the built package."""

    def run(self) -> None:
        super().run()
        mode = os.environ.get("INFERMUX_BUILD_KERNELS", "")
        if mode == "0" or getattr(self, "editable_mode", False):
            return
        try:
            sys.path.insert(0, str(ROOT))
            from core_engine.kernels.cpu import prebuild
        except ImportError as exc:  # torch is not importable in an isolated build
            if mode == "1":
                raise SystemExit(f"INFERMUX_BUILD_KERNELS=1 but the kernels cannot be built: {exc} "
                                 "(install torch first and pass --no-build-isolation)") from exc
            print(f"infermux: CPU kernels not built at install ({exc}); they compile at first use")
            return
        finally:
            sys.path.remove(str(ROOT))
        target = Path(self.build_lib) / "core_engine" / "kernels" / "cpu" / "prebuilt"
        print(f"infermux: compiling the CPU kernels for this CPU into {target} (~30 s)...", flush=True)
        try:
            built = prebuild(target)
        except Exception as exc:  # KernelBuildError: no compiler, or a compile error
            if mode == "1":
                raise SystemExit(f"INFERMUX_BUILD_KERNELS=1 but the kernels did not build: {exc}") from exc
            print(f"infermux: CPU kernels not built at install ({exc}); they compile at first use")
            return
        print("infermux: built " + ", ".join(path.name for path in built), flush=True)


setup(cmdclass={"build_py": BuildPyWithKernels})

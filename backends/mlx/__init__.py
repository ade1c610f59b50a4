"""The MLX backend: models served through Apple's MLX with mlx-lm (Metal on macOS, CPU on Linux).

Importing this package is free: MLX and mlx-lm are imported only when a backend is created,
so infermux works without them and the ``mlx`` kind reports itself unavailable with an
install hint. See :mod:`backends.mlx.backend` for the serving side and
:mod:`backends.mlx.gguf_loader` for how GGUF files map onto mlx-lm's Llama model.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from backends.base import BackendConfig
from backends.errors import BackendUnavailableError

if TYPE_CHECKING:
    from backends.mlx.backend import MLXBackend

__all__ = [
    "INSTALL_HINT",
    "create_backend",
    "default_backend_config",
    "is_available",
    "is_installed",
]

INSTALL_HINT = 'pip install "infermux[mlx]"'


def is_available() -> tuple[bool, str]:
    """Whether MLX and mlx-lm import here (slow: imports them); else False and why, with the hint."""
    for module in ("mlx.core", "mlx_lm"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return False, f"the MLX backend needs {module.split('.')[0]!r} ({exc}): {INSTALL_HINT}"
    return True, ""


def is_installed() -> bool:
    """Cheap check (nothing imported) that MLX and mlx-lm are installed, for default configs."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in ("mlx", "mlx_lm"))
    except (ImportError, ValueError):
        return False


def default_backend_config(model_path: Path, *, n_ctx: int = 2048) -> BackendConfig:
    """The ``mlx`` entry of the default config: ``model_path`` (a GGUF or MLX directory) via MLX."""
    return BackendConfig(
        name="mlx", kind="mlx", options={"model_path": str(model_path), "n_ctx": n_ctx}
    )


def create_backend(config: BackendConfig) -> MLXBackend:
    """Factory registered for kind ``"mlx"``; ``BackendUnavailableError`` without MLX."""
    # Before mlx-lm (and huggingface_hub) is first imported: models are local files only.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Before MLX is first imported: OpenBLAS under its float matmuls on a Linux CPU.
    from backends.mlx.cpu_blas import use_openblas

    use_openblas()
    available, reason = is_available()
    if not available:
        raise BackendUnavailableError(f"backend {config.name!r}: {reason}")
    from backends.mlx.backend import MLXBackend

    return MLXBackend(config)


#: MLX runs in a supervised worker process unless ``worker_process = false`` (backends/worker).
create_backend.worker_process_default = True  # type: ignore[attr-defined]

"""What the in-process backends (core engine, llama.cpp, MLX) share to find and load a model.

:func:`resolve_model_path` turns ``options.model_path`` (or the embedded default model) into a
local path with one error rule for all of them: a configured path that is missing or of the
wrong kind is a :class:`BackendConfigError` naming the option; a missing default model is a
:class:`BackendUnavailableError`. A path is never treated as a hub id: nothing downloads.
:func:`load_with_progress` runs the blocking load off the event loop and logs its start, a
line every few seconds while it runs, and how long it took.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import TypeVar

from backends.errors import BackendConfigError, BackendUnavailableError

__all__ = ["load_with_progress", "resolve_model_path"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between "still loading" lines.
PROGRESS_EVERY_S = 2.0


def resolve_model_path(
    backend: str, model_path: str | None, *, accepts: Callable[[Path], bool], expected: str
) -> Path:
    """The model of backend ``backend``: ``model_path`` (``~`` expanded) or the embedded
    default; ``accepts`` says whether a path is something this backend loads, ``expected``
    what that is, for the error message."""
    if model_path is not None:
        path = Path(model_path).expanduser()
    else:
        from backends.default_model import default_model_path

        try:
            path = default_model_path()
        except FileNotFoundError as exc:
            raise BackendUnavailableError(f"backend {backend!r}: {exc}") from exc
    if not path.exists():
        raise BackendConfigError(
            f"backend {backend!r}: model file not found: {path} "
            f"(backends.{backend}.options.model_path: {expected})"
        )
    if not accepts(path):
        raise BackendConfigError(
            f"backend {backend!r}: {path} is not {expected} (backends.{backend}.options.model_path)"
        )
    return path


async def load_with_progress(
    backend: str, path: Path, load: Callable[[], T], *, executor: Executor | None = None
) -> tuple[T, float]:
    """``load()`` on ``executor`` (None: a fresh thread), logging progress; returns what it
    returned and the seconds it took."""
    size = f" ({path.stat().st_size / 2**20:.0f} MiB)" if path.is_file() else ""
    logger.info("backend %s: loading %s%s", backend, path.name, size)
    started = time.monotonic()
    if executor is None:
        future: asyncio.Future[T] = asyncio.ensure_future(asyncio.to_thread(load))
    else:
        future = asyncio.get_running_loop().run_in_executor(executor, load)
    while True:
        done, _ = await asyncio.wait({future}, timeout=PROGRESS_EVERY_S)
        if done:
            break
        logger.info("backend %s: still loading %s (%.0f s)", backend, path.name, time.monotonic() - started)
    return future.result(), time.monotonic() - started

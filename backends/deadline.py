"""Deadlines as ``time.monotonic()`` values, and a cheap timeout for the request path.

The router and the ``openai`` backend keep every deadline (first byte, idle, total, a
request's own) as a ``time.monotonic()`` value or None: :func:`earliest` picks the binding
one, :class:`Deadline` bounds a block by it.

:class:`Deadline` is ``asyncio.timeout_at`` as a plain context manager, with the same
outcome: when the deadline passes the task is cancelled, and leaving the block raises
``TimeoutError`` when that cancellation is what ended it (not when the task was also
cancelled from elsewhere). Like ``asyncio.timeout`` it cancels at once, even a task that
another cancellation is already unwinding: a clean-up that must not be cut short (closing
an upstream connection) runs in a task that only its owner cancels, never in the task a
deadline bounds (``backends._upstream_exchange``).

Why not ``asyncio.timeout``: on Python 3.11 each use costs several microseconds (an
enum-driven state machine whose member lookups go through ``EnumType.__getattr__``, two
coroutine objects, three process-id system calls from ``get_running_loop``), and one
request to an upstream crosses half a dozen of them.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import Any

__all__ = ["Deadline", "earliest"]


def earliest(*deadlines: float | None) -> float | None:
    """The earliest of the deadlines that are set (None when none is)."""
    present = [d for d in deadlines if d is not None]
    return min(present) if present else None


class Deadline:
    """``with Deadline(when):`` cancels the task at ``when`` (``time.monotonic()``; None:
    never) and turns that cancellation into ``TimeoutError`` (see the module docstring)."""

    __slots__ = ("_when", "_task", "_handle", "_cancelling", "_expired")

    def __init__(self, when: float | None) -> None:
        self._when = when
        self._task: asyncio.Task[Any] | None = None
        self._handle: asyncio.Handle | None = None
        self._cancelling = 0
        self._expired = False

    def __enter__(self) -> None:
        if self._when is None:
            return
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("Deadline must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._handle = loop.call_at(loop.time() + (self._when - time.monotonic()), self._expire)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._expired:
            self._expired = False
            assert self._task is not None
            # Ours unless someone else also asked to cancel the task meanwhile.
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc

    def _expire(self) -> None:
        self._handle = None
        self._expired = True
        assert self._task is not None
        self._task.cancel()

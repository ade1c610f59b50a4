"""Deadlines as ``time.monotonic()`` values, and a cheap timeout for the request path.

The router and the ``openai`` backend keep every deadline (first byte, idle, total, a
request's own) as a ``time.monotonic()`` value or None: :func:`earliest` picks the binding
one, :class:`Deadline` bounds a block by it.

:class:`Deadline` is ``asyncio.timeout_at`` as a plain context manager, with the same
outcome: when the deadline passes the task is cancelled, and leaving the block raises
``TimeoutError`` when that cancellation is what ended it (not when the task was also
cancelled from elsewhere). Unlike ``asyncio.timeout``, it does not cancel a task that a
cancellation from elsewhere is already unwinding: it waits until that one is over (see
:meth:`Deadline._expire`). Why not ``asyncio.timeout``: on Python 3.11 each use costs
several microseconds (an enum-driven state machine whose member lookups go through
``EnumType.__getattr__``, two coroutine objects, three process-id system calls from
``get_running_loop``), and one request to an upstream crosses half a dozen of them.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import Any

__all__ = ["DEFERRAL_S", "MAX_DEFERRALS", "Deadline", "earliest", "until_uncancelled"]


def earliest(*deadlines: float | None) -> float | None:
    """The earliest of the deadlines that are set (None when none is)."""
    present = [d for d in deadlines if d is not None]
    return min(present) if present else None


class Deadline:
    """``with Deadline(when):`` cancels the task at ``when`` (``time.monotonic()``; None:
    never) and turns that cancellation into ``TimeoutError`` (see the module docstring)."""

    __slots__ = ("_when", "_task", "_handle", "_cancelling", "_expired", "_deferred")

    def __init__(self, when: float | None) -> None:
        self._when = when
        self._task: asyncio.Task[Any] | None = None
        self._handle: asyncio.Handle | None = None
        self._cancelling = 0
        self._expired = False
        self._deferred = 0

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
        task = self._task
        assert task is not None
        if task.cancelling() > self._cancelling and self._deferred < MAX_DEFERRALS:
            # Another cancellation (an inner deadline's, a client's disconnect) is unwinding
            # the task now, maybe through a library's clean-up: a second one would cut that
            # clean-up short (httpcore then never closes the upstream connection). Look again
            # shortly; if the block is left meanwhile, nothing is owed. Bounded, for code that
            # swallows a cancellation without ``uncancel()``.
            self._deferred += 1
            self._handle = asyncio.get_running_loop().call_later(DEFERRAL_S, self._expire)
            return
        self._handle = None
        self._expired = True
        task.cancel()


#: While another cancellation unwinds the task, an expired deadline looks again this often,
#: at most this many times (0.1 s in all), then cancels anyway. The router's stream timer
#: (``gateway.serving.router.RoutedStream``) defers by the same rule.
DEFERRAL_S = 0.001
MAX_DEFERRALS = 100


async def until_uncancelled(task: asyncio.Task[Any]) -> None:
    """Wait while another cancellation is unwinding ``task`` (at most 0.1 s), so that a
    cancellation sent next does not cut its clean-up short (see :meth:`Deadline._expire`)."""
    for _ in range(MAX_DEFERRALS):
        if not task.cancelling():
            return
        await asyncio.sleep(DEFERRAL_S)

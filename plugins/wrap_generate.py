"""Nesting ``infermux_wrap_generate`` implementations around ``Backend.generate``.

The chain is built when the router opens an attempt and stays lazy: nothing runs until the
router asks for the first chunk (inside its first-byte timeout). Why the extra layers:

- closing the outer stream must abort the backend even when a wrapper forgot to close
  the stream it got from ``call_next`` (an ``async for`` interrupted by ``aclose()`` leaves
  the inner generator open), so :class:`ChainedStream` closes every stream it opened;
- an exception raised by a wrapper is a plugin bug, not the backend's failure: it becomes
  an :class:`InfermuxError` naming the plugin (a 500, never retried on another backend and
  never counted against a circuit); the backend's own contract breaks are labelled as the
  backend's (``BackendError``) before they pass through the wrappers.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pluggy

from backends.base import GenerationChunk, GenerationRequest
from backends.errors import BackendError, InfermuxError

__all__ = ["ChainedStream", "PluginError", "chain_generate"]

logger = logging.getLogger("plugins")

Generate = Callable[[GenerationRequest], AsyncIterator[GenerationChunk]]


class PluginError(InfermuxError):
    """A plugin broke while serving a request (500 ``plugin_error``)."""

    code = "plugin_error"


def chain_generate(
    impls: Sequence[pluggy.HookImpl],
    *,
    request: GenerationRequest,
    backend_name: str,
    generate: Generate,
) -> ChainedStream:
    """The stream of ``request`` through every wrapper in ``impls`` (outermost first)."""
    chain = ChainedStream()

    def opener(index: int) -> Generate:
        def call_next(next_request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
            if index == len(impls):
                stream: AsyncIterator[GenerationChunk] = _BackendStream(
                    backend_name, generate(next_request)
                )
            else:
                stream = _WrapperStream(impls[index], next_request, backend_name, opener(index + 1))
            chain.track(stream)
            return stream

        return call_next

    chain.outer = opener(0)(request)
    return chain


class ChainedStream:
    """The outermost stream; ``aclose()`` closes every layer, outermost first."""

    def __init__(self) -> None:
        self.outer: AsyncIterator[GenerationChunk] | None = None
        self._opened: list[AsyncIterator[GenerationChunk]] = []

    def track(self, stream: AsyncIterator[GenerationChunk]) -> None:
        self._opened.append(stream)

    def __aiter__(self) -> ChainedStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        assert self.outer is not None
        return await anext(self.outer)

    async def aclose(self) -> None:
        """Close every stream of the chain (a closed one is skipped by its own aclose)."""
        for stream in self._opened:
            await _close(stream)


class _WrapperStream:
    """One plugin's layer: calls its hookimpl on the first chunk asked for."""

    def __init__(
        self,
        impl: pluggy.HookImpl,
        request: GenerationRequest,
        backend_name: str,
        call_next: Generate,
    ) -> None:
        self._impl = impl
        self._request = request
        self._backend_name = backend_name
        self._call_next = call_next
        self._stream: AsyncIterator[GenerationChunk] | None = None
        self._pending: Awaitable[Any] | None = None
        self._closed = False

    def __aiter__(self) -> _WrapperStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        if self._closed:
            raise StopAsyncIteration
        try:
            if self._stream is None:
                self._stream = await self._open()
            return await anext(self._stream)
        except (StopAsyncIteration, InfermuxError):
            raise
        except Exception as exc:
            raise PluginError(
                f"plugin {self._impl.plugin_name!r}: infermux_wrap_generate raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    async def _open(self) -> AsyncIterator[GenerationChunk]:
        arguments = {
            "request": self._request,
            "backend_name": self._backend_name,
            "call_next": self._call_next,
        }
        result: Any = self._impl.function(*[arguments[name] for name in self._impl.argnames])
        if inspect.isawaitable(result) and not hasattr(result, "__anext__"):
            self._pending = result
            result = await result
            self._pending = None
        if result is None:  # this plugin does not wrap this call
            return self._call_next(self._request)
        if not hasattr(result, "__anext__"):
            raise TypeError(
                f"expected an async iterator of GenerationChunk or None, got {type(result).__name__}"
            )
        stream: AsyncIterator[GenerationChunk] = result
        return stream

    async def aclose(self) -> None:
        self._closed = True
        pending, self._pending = self._pending, None
        if pending is not None and inspect.iscoroutine(pending):
            pending.close()
        if self._stream is not None:
            await _close(self._stream)


class _BackendStream:
    """The backend's own stream, with its contract breaks labelled as the backend's."""

    def __init__(self, backend_name: str, stream: AsyncIterator[GenerationChunk]) -> None:
        self._backend_name = backend_name
        self._stream = stream

    def __aiter__(self) -> _BackendStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        try:
            return await anext(self._stream)
        except (StopAsyncIteration, InfermuxError):
            raise
        except Exception as exc:
            raise BackendError(
                f"backend {self._backend_name!r} failed: {type(exc).__name__}: {exc}"
            ) from exc

    async def aclose(self) -> None:
        await _close(self._stream)


async def _close(stream: AsyncIterator[GenerationChunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:  # closing must not mask the error being handled
        logger.debug("closing a stream of the generate chain raised", exc_info=True)

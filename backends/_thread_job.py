"""The bridge between an in-process backend's worker thread and the event loop.

llama.cpp and MLX generate on a dedicated worker thread (their contexts are not thread-safe
and their calls block); each request is a :class:`ThreadJob` whose chunks the worker hands
back to the request's event loop, and whose ``cancelled`` flag the worker checks every token.
"""

from __future__ import annotations

import asyncio
import threading

from backends.base import GenerationChunk, GenerationRequest

__all__ = ["ThreadJob"]


class ThreadJob:
    """One generation handed to the worker thread, and the way back to the event loop."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        #: Chunks, then None at the end; an exception instead when generation failed.
        self.queue: asyncio.Queue[GenerationChunk | BaseException | None] = asyncio.Queue()
        self.cancelled = threading.Event()

    def send(self, item: GenerationChunk | BaseException | None) -> None:
        """Hand ``item`` to the event loop (thread-safe); a closed loop cancels the job."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()

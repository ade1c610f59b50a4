"""The bridge between an in-process backend's worker thread and the event loop.

llama.cpp and MLX generate on a dedicated worker thread (their contexts are not thread-safe
and their calls block); each request is a :class:`ThreadJob` whose chunks the worker hands
back to the request's event loop, and whose ``cancelled`` flag the worker checks every token
(llama.cpp: every batched step). MLX serves one job at a time through :func:`stream_job` /
:func:`run_job`; the llama.cpp runner takes the jobs into its own batching loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any

from backends.base import GenerationChunk, GenerationRequest
from backends.errors import BackendError, BackendUnavailableError, InfermuxError

__all__ = ["ThreadJob", "drain", "run_job", "stream_job"]

logger = logging.getLogger(__name__)


class ThreadJob:
    """One generation handed to the worker thread, and the way back to the event loop."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        #: Chunks, then None at the end; an exception instead when generation failed.
        self.queue: asyncio.Queue[GenerationChunk | BaseException | None] = asyncio.Queue()
        self.cancelled = threading.Event()
        #: The llguidance matcher of a constrained request (structured outputs), or None.
        self.matcher: Any = None
        #: A chat request's prompt text (:class:`backends.chat_plan.ChatPlan`), and its
        #: thinking budget (:class:`core_engine.chat.budget.ThinkingBudget`), or None.
        self.chat_text: str | None = None
        self.thinking: Any = None

    def send(self, item: GenerationChunk | BaseException | None) -> None:
        """Hand ``item`` to the event loop (thread-safe); a closed loop cancels the job."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()


def run_job(runner: Any, job: ThreadJob, *, library: str) -> None:
    """Worker-thread body: run the job, translate errors, always send the end marker.

    ``runner.run(request, send, is_cancelled)`` does the generation; an exception other than
    an :class:`~backends.errors.InfermuxError` crosses as a ``BackendError`` naming ``library``.
    """
    if job.cancelled.is_set():
        return
    try:
        runner.run(job.request, job.send, job.cancelled.is_set)
    except InfermuxError as exc:
        job.send(exc)
    except Exception as exc:
        logger.exception("%s generation failed", library)
        error = BackendError(f"{library} generation failed: {exc}")
        error.__cause__ = exc
        job.send(error)
    job.send(None)


async def stream_job(
    request: GenerationRequest,
    *,
    backend_name: str,
    runner: Any,
    executor: Executor | None,
    jobs: set[ThreadJob],
    library: str,
) -> AsyncIterator[GenerationChunk]:
    """Queue ``request`` on the backend's single worker and yield its chunks.

    Closing the iterator sets the job's ``cancelled`` flag, which the runner checks every
    token, so generation stops after the current one.
    """
    if runner is None or executor is None:
        raise BackendUnavailableError(f"backend {backend_name!r} is not loaded")
    job = ThreadJob(request, asyncio.get_running_loop())
    try:
        executor.submit(run_job, runner, job, library=library)
    except RuntimeError as exc:  # executor shut down between the check and here
        raise BackendUnavailableError(f"backend {backend_name!r} is shutting down") from exc
    jobs.add(job)
    try:
        async for chunk in drain(job):
            yield chunk
    finally:
        jobs.discard(job)


async def drain(job: ThreadJob) -> AsyncIterator[GenerationChunk]:
    """Yield the job's chunks until its end marker, raising the error it sent; closing the
    iterator sets the job's ``cancelled`` flag."""
    try:
        while True:
            item = await job.queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        job.cancelled.set()

"""Running the choices of a generation request and answering: one body or an SSE stream.

Errors before the first byte leave as ordinary HTTP errors (the router may have retried on
other backends already). After the first byte of a stream an error becomes a
``data: {"error": ...}`` frame and the stream ends without ``[DONE]``. A client that goes
away aborts the upstream work: streaming through Litestar's disconnect listener,
non-streaming through :func:`_while_connected`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any, Protocol, TypeVar

import anyio
import msgspec
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from backends.base import GenerationChunk, GenerationRequest
from backends.errors import GenerationAbortedError, InfermuxError
from gateway.choice_run import ChoiceRun
from gateway.errors import error_frame, to_infermux_error
from gateway.request_id import REQUEST_ID_HEADER
from gateway.schemas import UsageInfo
from gateway.sse import DONE_FRAME, SSE_HEADERS
from gateway.state import GatewayState

__all__ = ["BACKEND_HEADER", "OutputBuilder", "respond"]

logger = logging.getLogger("gateway")

#: Request: pin a backend by name. Response: the backend(s) that served.
BACKEND_HEADER = "x-infermux-backend"

# Upper bound for aborting upstream work once the client is gone.
_CLOSE_TIMEOUT_S = 10.0

T = TypeVar("T")


class OutputBuilder(Protocol):
    """What :func:`respond` needs from the chat / completion output assemblers."""

    def add(self, position: int, chunk: GenerationChunk) -> None: ...
    def body(self, run: ChoiceRun) -> msgspec.Struct: ...
    def start_frames(self) -> bytes: ...
    def chunk_frames(self, position: int, chunk: GenerationChunk) -> bytes: ...
    def end_frames(self, usage: UsageInfo) -> bytes: ...


async def respond(
    request: Request[Any, Any, Any],
    gateway: GatewayState,
    requests: Sequence[GenerationRequest],
    output: OutputBuilder,
    *,
    n: int,
    stream: bool,
    request_id: str,
) -> Response[Any]:
    """Open the choices through the router and answer with a body or a stream."""
    router = gateway.require_router()
    pinned = request.headers.get(BACKEND_HEADER) or None
    if stream:
        # Until the first chunk exists a disconnect is watched here; then by the Stream.
        run = await _while_connected(
            request,
            ChoiceRun.open(
                router=router, hooks=gateway.hooks, requests=requests, n=n, pinned_backend=pinned
            ),
        )
        frames = _sse(run, output, request_id)
        return Stream(
            frames,
            media_type="text/event-stream",
            headers={
                **SSE_HEADERS,
                BACKEND_HEADER: ", ".join(run.backend_names),
                REQUEST_ID_HEADER: request_id,
            },
            # Runs after a disconnect too; closing a finished generator is a no-op.
            background=BackgroundTask(frames.aclose),
        )

    async def collect() -> ChoiceRun:
        run = await ChoiceRun.open(
            router=router, hooks=gateway.hooks, requests=requests, n=n, pinned_backend=pinned
        )
        try:
            async for position, chunk in run.events():
                output.add(position, chunk)
        except BaseException:
            await run.aclose()
            raise
        return run

    run = await _while_connected(request, collect())
    try:
        body = msgspec.json.encode(output.body(run))
    except BaseException:
        await run.aclose()
        raise
    return Response(
        content=body,
        media_type="application/json",
        headers={BACKEND_HEADER: ", ".join(run.backend_names), REQUEST_ID_HEADER: request_id},
        # Plugins hear about the response after it was sent.
        background=BackgroundTask(run.aclose),
    )


async def _sse(
    run: ChoiceRun, output: OutputBuilder, request_id: str
) -> AsyncGenerator[bytes, None]:
    try:
        start = output.start_frames()
        if start:
            yield start
        async for position, chunk in run.events():
            frames = output.chunk_frames(position, chunk)
            if frames:
                yield frames
        end = output.end_frames(run.total_usage())
        if end:
            yield end
        yield DONE_FRAME
    except InfermuxError as exc:
        yield error_frame(exc)
    except Exception as exc:
        yield error_frame(to_infermux_error(exc, request_id))
    finally:
        # Cancelled by a disconnect: the cancellation must not interrupt the abort.
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT_S):
            await run.aclose()


async def _while_connected(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (aborting upstream)."""
    task = asyncio.current_task()
    assert task is not None
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if disconnected:
            task.uncancel()
            raise GenerationAbortedError("the client disconnected") from None
        raise
    finally:
        watcher.cancel()

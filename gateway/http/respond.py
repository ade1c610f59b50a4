"""Running the choices of a generation request and answering: one body or an SSE stream.

First the request is admitted (gateway/serving/admission.py: per-key limits, then a global slot,
possibly after waiting in the queue); the slot is held until the upstream work has ended.
Errors before the first byte are raised, and leave as ordinary HTTP errors through the
app's exception handling (the router may have retried on other backends already). After
the first byte of a stream an error becomes a ``data: {"error": ...}`` frame and the stream
ends without ``[DONE]``. A client that goes away aborts the upstream work: until the answer
starts through :func:`_while_connected`, then (streams) through the streaming response's
disconnect listener. The slot is freed as soon as the upstream work has stopped, before
plugins hear how each choice ended.

The request's clean-up has one owner, :class:`~gateway.serving.request_life.RequestLife`:
the final bytes (``data: [DONE]``, the JSON body, an SSE error frame) go out only after its
:meth:`~gateway.serving.request_life.RequestLife.finish` (upstream stopped, slot freed,
``on_request_end`` returned: the usage ledger has committed the request's record, so a
completed response is never missing from it); every way out ends in its ``aclose``.

Answers are written as ASGI messages (see gateway/http/endpoint.py for why).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import NamedTuple, Protocol, TypeVar

import anyio
import msgspec
from litestar.background_tasks import BackgroundTask
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import Receive, Scope, Send

from backends.base import GenerationChunk, GenerationRequest
from backends.errors import GenerationAbortedError, InfermuxError
from gateway.config.types import ApiKeyConfig
from gateway.http.errors import error_frame, to_infermux_error
from gateway.http.request_id import REQUEST_ID_HEADER
from gateway.openai.schemas import UsageInfo
from gateway.openai.sse import DONE_FRAME, SSE_HEADERS
from gateway.openai.usage import usage_info
from gateway.serving.choices import ChoiceRun
from gateway.serving.request_life import RequestLife
from gateway.state import GatewayState

__all__ = ["BACKEND_HEADER", "Generation", "OutputBuilder", "respond"]

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


class Generation(NamedTuple):
    """A decoded generation request: its choices and how to answer them."""

    requests: list[GenerationRequest]
    output: OutputBuilder
    n: int
    stream: bool
    #: The stream's last frame, and the frame of an error after the first byte (OpenAI's
    #: ``[DONE]`` and error envelope; Anthropic's Messages API has its own).
    done_frame: bytes = DONE_FRAME
    error_frame: Callable[[InfermuxError], bytes] = error_frame
    #: Awaited once the body or the last frames are built, before they are sent: the
    #: Responses API stores its response there (off the event loop), so that a follow-up
    #: sent as soon as the answer arrives finds it, on any replica.
    persist: Callable[[], Awaitable[None]] | None = None


async def respond(
    scope: Scope,
    receive: Receive,
    send: Send,
    gateway: GatewayState,
    generation: Generation,
    *,
    request_id: str,
    api_key: ApiKeyConfig | None,
    pinned_backend: str | None,
) -> None:
    """Open the choices through the router and answer with a body or a stream."""
    router = gateway.require_router()
    requests: Sequence[GenerationRequest] = generation.requests
    if api_key is not None:
        requests = [
            msgspec.structs.replace(r, tenant=api_key.tenant, api_key_id=api_key.id)
            for r in requests
        ]
    output = generation.output

    async def admitted(*, collect: bool) -> RequestLife:
        """Admission, then the choices opened and, for an answer in one body, read."""
        grant = await gateway.admission.admit(api_key)
        try:
            run = await ChoiceRun.open(
                router=router,
                hooks=gateway.hooks,
                requests=requests,
                n=generation.n,
                pinned_backend=pinned_backend,
                capture_output=gateway.config.telemetry.tracing.record_content,
            )
        except BaseException:
            await grant.release()  # nothing opened: the slot is all there is to give back
            raise
        life = RequestLife(run, grant)
        if collect:
            try:
                await run.collect(output.add)
            except BaseException:
                await life.aclose()
                raise
        return life

    if generation.stream:
        # Until the first chunk exists a disconnect is watched here; then by the response.
        life = await _while_connected(receive, admitted(collect=False))
        await _stream(scope, receive, send, life, generation, request_id)
        return

    life = await _while_connected(receive, admitted(collect=True))
    try:
        body = msgspec.json.encode(output.body(life.run))
        await _finish(life)
        if generation.persist is not None:
            await generation.persist()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            *_encoded(
                {
                    **life.grant.headers,
                    BACKEND_HEADER: ", ".join(life.run.backend_names),
                    REQUEST_ID_HEADER: request_id,
                }
            ),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    finally:
        # Plugins hear about the response after it was sent.
        await life.aclose()


async def _stream(
    scope: Scope,
    receive: Receive,
    send: Send,
    life: RequestLife,
    generation: Generation,
    request_id: str,
) -> None:
    frames = _sse(life, generation, request_id)

    async def finish_stream() -> None:
        # Runs after a disconnect too; closing a finished generator is a no-op, and a
        # generator that never started still gets its request's clean-up here.
        await frames.aclose()
        await life.aclose()

    response = ASGIStreamingResponse(
        iterator=frames,
        media_type="text/event-stream",
        headers={
            **SSE_HEADERS,
            **life.grant.headers,
            BACKEND_HEADER: ", ".join(life.run.backend_names),
            REQUEST_ID_HEADER: request_id,
        },
        background=BackgroundTask(finish_stream),
    )
    await response(scope, receive, send)


def _encoded(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    # Latin-1, as Litestar encodes the headers of its responses.
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]


def _shielded() -> anyio.CancelScope:
    """A scope that a cancellation from outside (the client left: the streaming response
    cancels its task group) does not interrupt, for at most ``_CLOSE_TIMEOUT_S``."""
    return anyio.CancelScope(shield=True, deadline=anyio.current_time() + _CLOSE_TIMEOUT_S)


async def _finish(life: RequestLife) -> None:
    """Before the final bytes: stop the upstream work, free the slot, end the request for
    the plugins (the usage record is committed when this returns). Not cancellable."""
    with _shielded():
        await life.finish()


async def _sse(life: RequestLife, generation: Generation, request_id: str) -> AsyncGenerator[bytes, None]:
    output = generation.output
    run = life.run
    try:
        start = output.start_frames()
        if start:
            yield start
        async for position, chunk in run.events():
            frames = output.chunk_frames(position, chunk)
            if frames:
                yield frames
        await _finish(life)
        end = output.end_frames(usage_info(run.total_usage()))
        if generation.persist is not None:
            await generation.persist()
        if end:
            yield end
        if generation.done_frame:
            yield generation.done_frame
    except InfermuxError as exc:
        await _finish(life)
        yield generation.error_frame(exc)
    except Exception as exc:
        await _finish(life)
        yield generation.error_frame(to_infermux_error(exc, request_id))
    finally:
        # Cancelled by a disconnect: the cancellation must not interrupt the clean-up. The
        # slot is freed before plugins are told, so a slow plugin cannot hold it.
        with _shielded():
            await life.aclose()


async def _while_connected(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (aborting upstream)."""
    task = asyncio.current_task()
    assert task is not None
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        while True:
            message = await receive()
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

"""One upstream HTTP exchange over httpx, owned by one task: sent, read and closed there.

Why an owner: httpx (httpcore) closes a connection behind an anyio lock whose acquisition
yields to the loop, in ``Response.aclose()`` and in the clean-up of a cancelled send or
read alike, and anyio's shield does not stop a plain ``task.cancel()``. A request's task
is cancelled by several hands (the backend's first-byte and idle deadlines, the router's
stream timer, the client's disconnect, an abort), sometimes two in the same loop turn; when
the second landed inside httpcore's close, the close stopped half-way, the connection was
never closed and the upstream generated on. No rule about *when* to cancel fixes that.

:class:`HttpxExchange` moves every network operation out of reach of those cancellations:
its owner task alone sends the request and reads the body; the request's task only waits
for the owner's next piece, so cancelling it cancels a wait and nothing else.
:meth:`HttpxExchange.aclose` is the exchange's one exit: the first call starts the single
close task (the owner cancelled once, its own clean-up awaited, then the response closed);
every call, however often its caller is cancelled meanwhile, only waits for that task.

The native HTTP/1.1 client (``backends._http1_transport``) needs no owner: its clean-ups are
synchronous (a socket's close is a call, not a wait; its ``aclose()`` marks the response
closed before its first ``await``), so a cancellation cannot land inside one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import httpx

__all__ = ["HttpxExchange"]

#: Body pieces the owner reads ahead of the request's task before it waits for room (each
#: at most one network read): the reads overlap the gateway's work on the previous piece,
#: and a slow client still slows the upstream down (TCP's window) instead of filling memory.
_MAX_PIECES_AHEAD = 4

#: Close tasks still running after every caller stopped waiting (the loop holds tasks
#: weakly).
_closing: set[asyncio.Task[None]] = set()


class HttpxExchange:
    """``client.send(request, stream=True)`` and its response body, in a task of their own.

    Offers what the ``openai`` backend reads of a response (``status_code``, ``headers``,
    ``aiter_bytes()``, ``aclose()``; see ``backends._openai_wire.UpstreamResponse``). Open
    with :meth:`open`; always :meth:`aclose`.
    """

    __slots__ = (
        "_loop",
        "_owner",
        "_response",
        "_pieces",
        "_ended",
        "_error",
        "_waiter",
        "_room",
        "_close",
    )

    def __init__(self, client: httpx.AsyncClient, request: httpx.Request) -> None:
        self._loop = asyncio.get_running_loop()
        self._response: httpx.Response | None = None
        #: Body pieces read and not taken yet.
        self._pieces: deque[bytes] = deque()
        #: The owner is done: the body was read to its end, or the send or a read failed.
        self._ended = False
        self._error: Exception | None = None
        #: The request's task waiting for the owner's next step; the owner waiting for room.
        self._waiter: asyncio.Future[None] | None = None
        self._room: asyncio.Future[None] | None = None
        self._close: asyncio.Task[None] | None = None
        self._owner = self._loop.create_task(self._run(client, request))

    @classmethod
    async def open(cls, client: httpx.AsyncClient, request: httpx.Request) -> HttpxExchange:
        """Send ``request`` and wait for the response head; raise as ``client.send`` would.
        Cancelled or failed, the exchange is closed before this returns."""
        exchange = cls(client, request)
        try:
            while exchange._response is None:
                if exchange._ended:
                    assert exchange._error is not None
                    raise exchange._error
                await exchange._next_step()
        except BaseException:
            await exchange.aclose()
            raise
        return exchange

    @property
    def status_code(self) -> int:
        assert self._response is not None
        return self._response.status_code

    @property
    def headers(self) -> httpx.Headers:
        assert self._response is not None
        return self._response.headers

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body, everything the owner has read per iteration (httpx's errors raised)."""
        pieces = self._pieces
        while True:
            if pieces:
                data = pieces.popleft() if len(pieces) == 1 else b"".join(pieces)
                pieces.clear()
                room, self._room = self._room, None
                if room is not None and not room.done():
                    room.set_result(None)
                yield data
            elif self._ended:
                if self._error is not None:
                    raise self._error
                return
            else:
                await self._next_step()

    async def aclose(self) -> None:
        """End the exchange: the owner stops, the response is closed (the connection goes back
        to the pool only when the body was read to its end). The close runs once, to its end,
        whoever calls and however often the callers are cancelled. Idempotent."""
        close = self._close
        if close is None:
            close = self._close = self._loop.create_task(self._end())
            _closing.add(close)
            close.add_done_callback(_closing.discard)
        await asyncio.shield(close)

    async def _next_step(self) -> None:
        """Wait until the owner has a response, a piece or the end (a cancellation of the
        caller cancels this wait only)."""
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _run(self, client: httpx.AsyncClient, request: httpx.Request) -> None:
        """The owner: send, then read the body ahead of the request's task. Only
        :meth:`_end` cancels it, once."""
        try:
            response = self._response = await client.send(request, stream=True)
            self._wake()
            pieces = self._pieces
            async for piece in response.aiter_bytes():
                pieces.append(piece)
                self._wake()
                if len(pieces) >= _MAX_PIECES_AHEAD:
                    room = self._room = self._loop.create_future()
                    await room
        except Exception as exc:  # handed to the request's task
            self._error = exc
        finally:
            self._ended = True
            self._wake()

    async def _end(self) -> None:
        owner = self._owner
        if not owner.done():
            owner.cancel()
            # httpcore's clean-up of the cancelled send or read (closing the half-used
            # connection) runs in the owner, which nothing else cancels.
            await asyncio.wait((owner,))
        if self._response is not None:
            await self._response.aclose()

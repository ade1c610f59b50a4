"""A lean HTTP/1.1 keep-alive client for one plain ``http://`` upstream, on asyncio streams.

Why: the gateway's overhead target is 1 ms per request in all. httpx's default transport
(httpcore over anyio and h11) costs about 1.2 ms of CPU per streamed upstream request on
the development CPU, and even over bare asyncio streams httpx's client layer (request and
URL objects, cookie, auth and redirect handling, four nested byte iterators per body
piece) costs more than the exchange itself. The ``openai`` backend therefore talks to
``http://`` upstreams through :class:`Http1Pool`: a pool of idle keep-alive connections,
one request at a time per connection, the request head and body in one write,
``content-length``, ``chunked`` and read-until-close bodies. TLS (``https://``) stays with
httpx.

Responses are parsed by httptools (llhttp, the C parser uvicorn uses; a dependency of
``uvicorn[standard]``): the head and the chunked coding cost no Python per header or per
chunk. :meth:`Http1Response.aiter_bytes` yields everything that has arrived, however many
chunks of the chunked coding that is: one iteration per network read, not one per SSE
event.

Responses offer what the backend reads of an ``httpx.Response`` (``status_code``,
``headers``, ``aiter_bytes()``, ``aclose()``) and failures are httpx's exception types
(``ConnectError``, ``ConnectTimeout``, ``PoolTimeout``, ``RemoteProtocolError``), so the
backend handles both clients alike. Reads are bounded by the caller (the ``openai`` backend
enforces its own first-byte and idle deadlines).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping

import httptools
import httpx

__all__ = ["Http1Pool", "Http1Response"]

_MAX_HEAD_BYTES = 64 * 1024
_READ_SIZE = 64 * 1024
_CLOSE_TIMEOUT_S = 1.0


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def is_usable(self) -> bool:
        # A peer that closed an idle keep-alive connection has fed EOF to the reader.
        return not (self.reader.at_eof() or self.writer.is_closing())

    def close(self) -> None:
        """Close now; the socket goes at the loop's next turn (use :meth:`aclose` to wait)."""
        self.writer.close()

    async def aclose(self) -> None:
        """Close and wait until the socket is closed, so the peer sees it at once."""
        self.writer.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                await self.writer.wait_closed()


class Http1Pool:
    """Keep-alive connections to one ``host:port``; see the module docstring.

    ``headers`` go with every request (after ``host``); :meth:`request` adds its own and
    ``content-length``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        headers: Mapping[str, str] | None = None,
        max_connections: int = 256,
    ) -> None:
        self.host = host
        self.port = port
        authority = f"[{host}]" if ":" in host else host
        if port != 80:
            authority = f"{authority}:{port}"
        fixed = {"host": authority, **(headers or {})}
        self._fixed_head = "".join(f"{name}: {value}\r\n" for name, value in fixed.items()).encode()
        _check_header_bytes(self._fixed_head)
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def request(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: bytes,
        *,
        connect_timeout: float | None = None,
        pool_timeout: float | None = None,
    ) -> Http1Response:
        """Send one request; the response's body is read through the returned object.

        The connection goes back to the pool when the body was read to its end and the
        response is closed (:meth:`Http1Response.aclose`, always call it).
        """
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode()
        _check_header_bytes(extra)
        data = b"%s %s HTTP/1.1\r\n%s%scontent-length: %d\r\n\r\n%s" % (
            method.encode("ascii"),
            target.encode("ascii"),
            self._fixed_head,
            extra,
            len(body),
            body,
        )
        if self._slots.locked():
            try:
                async with asyncio.timeout(pool_timeout):
                    await self._slots.acquire()
            except TimeoutError as exc:
                raise httpx.PoolTimeout("no free upstream connection in time") from exc
        else:
            await self._slots.acquire()  # returns at once: a slot is free
        try:
            parse, connection = await self._exchange(data, connect_timeout)
        except BaseException:
            self._slots.release()
            raise
        return Http1Response(self, connection, parse)

    async def aclose(self) -> None:
        """Close the idle connections; connections in use close when their response does."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.aclose()

    async def _exchange(
        self, data: bytes, connect_timeout: float | None
    ) -> tuple[_Parse, _Connection]:
        """Send the request and read the response head, on a pooled or a new connection."""
        while True:
            connection = self._checkout()
            reused = connection is not None
            if connection is None:
                connection = await self._connect(connect_timeout)
            parse = _Parse()
            received = 0
            try:
                connection.writer.write(data)
                await connection.writer.drain()
                while not parse.head_done:
                    chunk = await connection.reader.read(_READ_SIZE)
                    if not chunk:
                        raise ConnectionResetError("the connection closed")
                    received += len(chunk)
                    parse.feed(chunk)
                    if not parse.head_done and received > _MAX_HEAD_BYTES:
                        raise ValueError("response head too large")
                return parse, connection
            except OSError as exc:
                connection.close()
                if reused and not received:
                    # The server closed this idle keep-alive connection as we reused it:
                    # the request was not answered; send it once more on a new connection.
                    continue
                raise httpx.RemoteProtocolError(
                    "Server disconnected without sending a response."
                ) from exc
            except ValueError as exc:
                connection.close()
                raise httpx.RemoteProtocolError(f"malformed response head: {exc}") from exc
            except BaseException:
                connection.close()
                raise

    def _checkout(self) -> _Connection | None:
        idle = self._idle
        while idle:
            connection = idle.pop()
            if connection.is_usable():
                return connection
            connection.close()
        return None

    def _checkin(self, connection: _Connection) -> None:
        if self._closed or not connection.is_usable():
            connection.close()
        else:
            self._idle.append(connection)

    def _release(self) -> None:
        self._slots.release()

    async def _connect(self, timeout: float | None) -> _Connection:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, limit=_MAX_HEAD_BYTES
                )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"timed out connecting to {self.host}:{self.port}") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        return _Connection(reader, writer)


class _Parse:
    """One response as httptools reports it: status, headers, body pieces, the end.

    The callbacks are called from C; ``on_body`` is the body list's own ``append``.
    """

    __slots__ = (
        "parser",
        "status",
        "headers",
        "head_done",
        "keep_alive",
        "body",
        "on_body",
        "done",
        "extra",
    )

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.keep_alive = False
        self.body: list[bytes] = []
        self.on_body = self.body.append
        self.done = False
        #: Bytes arrived after the end of the response: the connection is not reusable.
        self.extra = False
        self.parser = httptools.HttpResponseParser(self)

    def feed(self, data: bytes) -> None:
        """Parse ``data``; ValueError if it is not HTTP."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.done:
                self.extra = True  # garbage after a complete response
                return
            raise ValueError(str(exc) or type(exc).__name__) from exc

    def take(self) -> bytes:
        """The body bytes parsed since the last call."""
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        return data

    def ends_with_the_connection(self) -> bool:
        """Neither a length nor the chunked coding: the body runs until the peer closes."""
        framing = {b"content-length", b"transfer-encoding"}
        return not any(name.lower() in framing for name, _ in self.headers)

    def on_message_begin(self) -> None:
        if self.done:
            self.extra = True
        else:
            self.headers.clear()  # a new head after an interim (1xx) one

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))  # trailers too, after the head

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            return  # an interim answer (100 Continue) precedes the real one
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True

    def on_message_complete(self) -> None:
        if self.head_done:
            self.done = True


class Http1Response:
    """Status and headers of a response whose body is still on the wire."""

    def __init__(self, pool: Http1Pool, connection: _Connection, parse: _Parse) -> None:
        self.status_code = parse.status
        self._pool = pool
        self._connection = connection
        self._parse = parse
        self._released = False

    @property
    def headers(self) -> httpx.Headers:
        """The response headers (built on first use: the success path never reads them)."""
        return httpx.Headers(self._parse.headers)

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body, as much as has arrived per iteration (chunked coding removed)."""
        parse = self._parse
        reader = self._connection.reader
        try:
            while True:
                if parse.body:
                    yield parse.take()
                if parse.done:
                    return
                data = await reader.read(_READ_SIZE)
                if data:
                    parse.feed(data)
                elif parse.ends_with_the_connection():
                    parse.done = True
                else:
                    raise asyncio.IncompleteReadError(b"", None)
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body"
            ) from exc
        except ValueError as exc:
            raise httpx.RemoteProtocolError(f"malformed response body: {exc}") from exc

    async def aclose(self) -> None:
        """Give the connection back (body read to the end) or close it. Idempotent."""
        if self._released:
            return
        self._released = True
        self._pool._release()
        parse = self._parse
        if parse.done and parse.keep_alive and not parse.extra:
            self._pool._checkin(self._connection)
        else:
            await self._connection.aclose()  # unread body: the connection cannot be reused


def _check_header_bytes(head: bytes) -> None:
    # Every header line ends in CRLF; any other CR or LF would split a header in two.
    if head.count(b"\n") != head.count(b"\r\n") or head.count(b"\r") != head.count(b"\r\n"):
        raise httpx.LocalProtocolError("a header name or value contains CR or LF")

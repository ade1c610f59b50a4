"""A lean HTTP/1.1 keep-alive transport for ``httpx`` on asyncio streams (plain ``http://``).

Why: on the development CPU, httpx's default transport (httpcore over anyio and h11) costs
about 1.2 ms of CPU per streamed upstream request with 18 SSE chunks, six times what the
same exchange costs on bare asyncio streams; the gateway's overhead target is 1 ms in all.
This transport keeps the ``httpx`` client API (requests, responses, headers, decoding, env
proxies mounted by the client) and replaces only the wire handling: a per-host pool of
idle connections, one request at a time per connection, ``content-length``, ``chunked`` and
read-until-close bodies. TLS (``https://``) stays with httpx's default transport.

Errors are raised as httpx's own exception types (``ConnectError``, ``ConnectTimeout``,
``ReadError``, ``RemoteProtocolError``, ``PoolTimeout``), so callers map one family. Read
timeouts apply to the response head; body reads are bounded by the caller (the ``openai``
backend enforces its own first-byte and idle deadlines).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

__all__ = ["Http1Transport"]

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


class Http1Transport(httpx.AsyncBaseTransport):
    """Plain-HTTP/1.1 transport with keep-alive pooling; see the module docstring."""

    def __init__(self, *, max_connections: int = 256) -> None:
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"Http1Transport serves http:// only, not {url}")
        timeouts = request.extensions.get("timeout", {})
        key = (url.host, url.port or 80)
        try:
            async with asyncio.timeout(timeouts.get("pool")):
                await self._slots.acquire()
        except TimeoutError as exc:
            raise httpx.PoolTimeout("no free upstream connection in time", request=request) from exc
        try:
            status, headers, framing, connection = await self._exchange(key, request, timeouts)
        except BaseException:
            self._slots.release()
            raise
        stream = _ResponseBody(self, key, connection, framing, request)
        return httpx.Response(
            status,
            headers=headers,
            stream=stream,
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _exchange(
        self, key: tuple[str, int], request: httpx.Request, timeouts: dict[str, float | None]
    ) -> tuple[int, list[tuple[bytes, bytes]], _Framing, _Connection]:
        """Send the request and read the response head, on a pooled or a new connection."""
        head = _request_head(request)
        body = await request.aread()
        while True:
            connection = self._checkout(key)
            reused = connection is not None
            if connection is None:
                connection = await self._connect(key, request, timeouts)
            try:
                connection.writer.write(head + body)
                await connection.writer.drain()
                async with asyncio.timeout(timeouts.get("read")):
                    status, headers, framing = await _read_head(connection.reader, request)
                return status, headers, framing, connection
            except TimeoutError as exc:
                connection.close()
                raise httpx.ReadTimeout("no response head in time", request=request) from exc
            except (OSError, asyncio.IncompleteReadError) as exc:
                connection.close()
                nothing_received = (
                    not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial
                )
                if reused and nothing_received:
                    # The server closed this idle keep-alive connection as we reused it:
                    # the request was not answered; send it once more on a new connection.
                    continue
                raise httpx.RemoteProtocolError(
                    "Server disconnected without sending a response.", request=request
                ) from exc
            except BaseException:
                connection.close()
                raise

    async def aclose(self) -> None:
        self._closed = True
        idle = [c for connections in self._idle.values() for c in connections]
        self._idle.clear()
        for connection in idle:
            await connection.aclose()

    def _checkout(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if connection.is_usable():
                return connection
            connection.close()
        return None

    def _checkin(self, key: tuple[str, int], connection: _Connection) -> None:
        if self._closed or not connection.is_usable():
            connection.close()
        else:
            self._idle.setdefault(key, []).append(connection)

    def _release(self) -> None:
        self._slots.release()

    async def _connect(
        self, key: tuple[str, int], request: httpx.Request, timeouts: dict[str, float | None]
    ) -> _Connection:
        try:
            async with asyncio.timeout(timeouts.get("connect")):
                reader, writer = await asyncio.open_connection(
                    key[0], key[1], limit=_MAX_HEAD_BYTES
                )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(
                f"timed out connecting to {key[0]}:{key[1]}", request=request
            ) from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
        return _Connection(reader, writer)


class _Framing:
    """How the body ends: a length, chunked encoding, or the connection closing."""

    __slots__ = ("length", "chunked", "keep_alive")

    def __init__(self, length: int | None, chunked: bool, keep_alive: bool) -> None:
        self.length = length
        self.chunked = chunked
        self.keep_alive = keep_alive


class _ResponseBody(httpx.AsyncByteStream):
    """The response body; returns the connection to the pool once read to the end."""

    def __init__(
        self,
        transport: Http1Transport,
        key: tuple[str, int],
        connection: _Connection,
        framing: _Framing,
        request: httpx.Request,
    ) -> None:
        self._transport = transport
        self._key = key
        self._connection = connection
        self._framing = framing
        self._request = request
        self._complete = framing.length == 0 and not framing.chunked
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        reader = self._connection.reader
        framing = self._framing
        try:
            if framing.chunked:
                while True:
                    line = await reader.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0], 16)
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":
                            pass  # trailers
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif framing.length is not None:
                remaining = framing.length
                while remaining:
                    data = await reader.read(min(remaining, _READ_SIZE))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", remaining)
                    remaining -= len(data)
                    yield data
            else:
                while data := await reader.read(_READ_SIZE):
                    yield data
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body",
                request=self._request,
            ) from exc
        except (ValueError, asyncio.LimitOverrunError) as exc:
            raise httpx.RemoteProtocolError(
                f"malformed chunked body: {exc}", request=self._request
            ) from exc
        self._complete = True

    async def aclose(self) -> None:
        if self._released:
            return
        self._released = True
        self._transport._release()
        if self._complete and self._framing.keep_alive:
            self._transport._checkin(self._key, self._connection)
        else:
            await self._connection.aclose()  # unread body: the connection cannot be reused


def _request_head(request: httpx.Request) -> bytes:
    target = request.url.raw_path
    lines = [request.method.encode("ascii") + b" " + target + b" HTTP/1.1"]
    lines.extend(name + b": " + value for name, value in request.headers.raw)
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _read_head(
    reader: asyncio.StreamReader, request: httpx.Request
) -> tuple[int, list[tuple[bytes, bytes]], _Framing]:
    while True:
        try:
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as exc:
            raise httpx.RemoteProtocolError("response head too large", request=request) from exc
        lines = raw[:-4].split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise httpx.RemoteProtocolError(f"bad status line {lines[0][:80]!r}", request=request)
        try:
            status = int(parts[1])
        except ValueError as exc:
            raise httpx.RemoteProtocolError(
                f"bad status {parts[1][:20]!r}", request=request
            ) from exc
        if not 100 <= status < 200 or status == 101:
            break  # 1xx interim answers (100 Continue) precede the real one
    headers: list[tuple[bytes, bytes]] = []
    length: int | None = None
    chunked = False
    keep_alive = parts[0] == b"HTTP/1.1"
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise httpx.RemoteProtocolError("malformed response header", request=request)
        name = name.strip()
        value = value.strip()
        headers.append((name, value))
        lowered = name.lower()
        if lowered == b"content-length":
            try:
                length = int(value)
            except ValueError as exc:
                raise httpx.RemoteProtocolError("bad content-length", request=request) from exc
        elif lowered == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif lowered == b"connection":
            token = value.lower()
            if b"close" in token:
                keep_alive = False
            elif b"keep-alive" in token:
                keep_alive = True
    if request.method == "HEAD" or status in (204, 304):
        length, chunked = 0, False
    elif chunked:
        length = None
    elif length is None:
        keep_alive = False  # the body runs until the connection closes
    return status, headers, _Framing(length, chunked, keep_alive)

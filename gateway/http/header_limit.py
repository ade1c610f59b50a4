"""431 for requests whose request line and headers exceed ``[limits] max_header_bytes``.

The check runs as app-wide middleware, before the API-key guard and before the body is read.
Beyond four times the limit (at least 64 KiB) the HTTP protocol itself refuses the request
while it is still arriving (:func:`uvicorn_header_limit`), so a client cannot make the server
buffer an unbounded request head: with httptools (uvicorn's default parser, which has no
limit of its own) a protocol subclass counts the head's bytes and answers 431 and closes; with
h11 its ``h11_max_incomplete_event_size`` does the same with a bare 400.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from litestar.middleware import DefineMiddleware
from litestar.types import ASGIApp, Receive, Scope, Send

from backends.errors import InvalidRequestError

__all__ = [
    "HeaderLimitMiddleware",
    "RequestHeaderFieldsTooLargeError",
    "header_limit_middleware",
    "uvicorn_header_limit",
]


class RequestHeaderFieldsTooLargeError(InvalidRequestError):
    """The request line plus headers are larger than the gateway accepts."""

    status_code = 431
    code = "request_header_fields_too_large"


class HeaderLimitMiddleware:
    """Refuses HTTP requests with more than ``max_bytes`` of request line and headers."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = list(scope["headers"])  # an iterable, in the ASGI spec
            size = (
                len(scope.get("raw_path") or b"")
                + len(scope.get("query_string") or b"")
                + 16
                + 4 * len(headers)  # ": " and CRLF
                + sum(map(len, chain.from_iterable(headers)))
            )
            if size > self.max_bytes:
                raise RequestHeaderFieldsTooLargeError(
                    f"the request headers are {size} bytes; this server accepts at most "
                    f"{self.max_bytes}"
                )
        await self.app(scope, receive, send)


def header_limit_middleware(max_bytes: int) -> DefineMiddleware:
    """The middleware entry for ``Litestar(middleware=[...])``."""
    return DefineMiddleware(HeaderLimitMiddleware, max_bytes=max_bytes)


def uvicorn_header_limit(max_header_bytes: int) -> dict[str, Any]:
    """uvicorn options that refuse a request head past the hard cap while it arrives, and
    leave smaller header-size refusals to :class:`HeaderLimitMiddleware` (OpenAI's envelope)."""
    cap = max(4 * max_header_bytes, 64 * 1024)
    options: dict[str, Any] = {"h11_max_incomplete_event_size": cap}
    try:
        options["http"] = _httptools_protocol(cap)
    except ImportError:  # no httptools: uvicorn runs h11, whose limit is set above
        options["http"] = "h11"
    return options


_REFUSAL = (
    b'{"error":{"message":"the request head is larger than this server accepts",'
    b'"type":"invalid_request_error","param":null,"code":"request_header_fields_too_large"}}'
)


def _httptools_protocol(cap: int) -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeadLimitedHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol, refusing a request head past ``cap`` bytes."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0
            self._in_head = True

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            # Counted after parsing: a chunk that completes the head and brings body bytes
            # is fine; a head still open past the cap is refused.
            if self._in_head and self._head_bytes > cap and not self.transport.is_closing():
                self.transport.write(
                    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_REFUSAL), _REFUSAL)
                )
                self.transport.close()

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes = True, 0  # the next request on the connection

    return HeadLimitedHttpToolsProtocol

"""431 for requests whose request line and headers exceed ``[limits] max_header_bytes``.

The check runs as app-wide middleware, before the API-key guard and before the body is read.
uvicorn's own parser limit is set above this one (:func:`uvicorn_h11_limit`) so that the
client gets the OpenAI envelope rather than uvicorn's bare 400 for any size up to that.
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
    "uvicorn_h11_limit",
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


def uvicorn_h11_limit(max_header_bytes: int) -> dict[str, Any]:
    """uvicorn options that leave header-size refusals to :class:`HeaderLimitMiddleware`.

    Beyond four times the limit (at least 64 KiB) uvicorn itself refuses the request with
    a bare 400, so a client cannot make the server buffer unbounded headers.
    """
    return {"h11_max_incomplete_event_size": max(4 * max_header_bytes, 64 * 1024)}

"""Open mode serves programs on this machine, never a web page open in a browser on it.

With no API keys (open mode) every loopback client is trusted (:func:`gateway.http.auth.
authorize`), and a browser on the same machine is a loopback client. A page from elsewhere
can reach the gateway in two ways: by DNS rebinding (its own name made to resolve to
127.0.0.1, so that the browser lets it read the answers: ``/v1/usage``, generations) and by a
cross-site "simple" request (a ``text/plain`` POST, sent without a preflight). The browser,
not the page, sets two headers that give both away: ``Host`` is the page's name, not a loopback
one, and ``Origin`` is the page's origin.

So in open mode :class:`LocalOriginMiddleware` refuses, with 403 ``permission_denied`` naming
the header, every request (every path) whose ``Host`` is not a loopback name (``localhost``,
``127.x.y.z``, ``[::1]``, with or without a port) or that carries an ``Origin`` other than a
loopback origin (``Origin: null``, sent by sandboxed and ``file:`` pages, included). HTTP
clients (the OpenAI SDKs, httpx, curl) send ``Host: 127.0.0.1:<port>`` and no ``Origin``; a
request without ``Host`` (HTTP/1.0) cannot come from a browser and passes. A reverse proxy in
front of an open gateway must pass a loopback ``Host`` (nginx's default, ``$proxy_host``).

With keys the middleware is not installed: a page cannot make the browser send the key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlsplit

from litestar.middleware import DefineMiddleware
from litestar.types import ASGIApp, Receive, Scope, Send

from backends.errors import PermissionDeniedError
from gateway.http.auth import is_loopback

__all__ = ["LocalOriginMiddleware", "is_loopback_host", "is_loopback_origin", "local_origin_middleware"]

logger = logging.getLogger("gateway.auth")


def is_loopback_host(value: str) -> bool:
    """``Host`` names this machine's loopback: ``localhost``, ``127.x.y.z`` or ``[::1]``,
    optionally with a port."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        host, bracket, port = value[1:].partition("]")
        if not bracket or (port and not (port[0] == ":" and port[1:].isdigit())):
            return False
        return ":" in host and is_loopback(host)
    host, colon, port = value.partition(":")
    if colon and not port.isdigit():
        return False
    return bool(host) and is_loopback(host)


def is_loopback_origin(value: str) -> bool:
    """``Origin`` is an ``http``/``https`` origin on a loopback host (any port)."""
    try:
        origin = urlsplit(value.strip())
        _ = origin.port  # raises ValueError on a malformed port
    except ValueError:
        return False
    return (
        origin.scheme in ("http", "https")
        and origin.hostname is not None
        and is_loopback(origin.hostname)
        and not origin.path.strip("/")
        and origin.username is None
    )


class LocalOriginMiddleware:
    """Refuses HTTP requests that a web page made a browser send (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for raw_name, raw_value in scope["headers"]:
                name = raw_name.lower()
                if name == b"host":
                    _check("Host", raw_value, is_loopback_host)
                elif name == b"origin":
                    _check("Origin", raw_value, is_loopback_origin)
        await self.app(scope, receive, send)


def _check(header: str, raw_value: bytes, accepts: Callable[[str], bool]) -> None:
    value = raw_value.decode("latin-1")
    if accepts(value):
        return
    logger.warning("refused a request with %s %.100r: open mode serves local programs only", header, value)
    raise PermissionDeniedError(
        f"the {header} header {value[:100]!r} is not a loopback one: this infermux has no API "
        "keys configured, so it serves programs on the same machine only, not web pages",
        param=header,
    )


def local_origin_middleware() -> DefineMiddleware:
    """The middleware entry for ``Litestar(middleware=[...])`` (open mode only)."""
    return DefineMiddleware(LocalOriginMiddleware)

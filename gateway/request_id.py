"""The request id: fresh for every request, echoed in ``x-request-id`` and error messages.

It is never taken from the client: engines key their work on it, so two clients (or one
retrying client) must not be able to make ids collide.
"""

from __future__ import annotations

import os
from typing import Any

from litestar.connection import ASGIConnection
from litestar.types import Scope

__all__ = ["REQUEST_ID_HEADER", "request_id_in", "request_id_of"]

REQUEST_ID_HEADER = "x-request-id"

_SCOPE_KEY = "infermux.request_id"


def request_id_in(scope: Scope) -> str:
    """The id of the request of ``scope``, created on first use and kept in the scope."""
    holder: Any = scope
    request_id = holder.get(_SCOPE_KEY)
    if request_id is None:
        request_id = holder[_SCOPE_KEY] = os.urandom(16).hex()
    return request_id


def request_id_of(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    """The id of this request (see :func:`request_id_in`)."""
    return request_id_in(connection.scope)

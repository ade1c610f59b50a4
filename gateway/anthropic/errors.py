"""Anthropic's error envelope, for the ``/v1/messages`` routes.

``{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`` with the
HTTP status of the error; the type follows Anthropic's list by status. The field a 400 is
about is named in the message (Anthropic's envelope has no ``param``), as
``messages.0.content: ...`` does on Anthropic's own API.
"""

from __future__ import annotations

import math

import msgspec
from litestar import Response

from backends.errors import InfermuxError
from gateway.http.request_id import REQUEST_ID_HEADER

__all__ = ["PATH_PREFIX", "anthropic_error_frame", "anthropic_error_response", "error_body"]

#: Requests under this path get this envelope.
PATH_PREFIX = "/v1/messages"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_encoder = msgspec.json.Encoder()


def error_body(error: InfermuxError) -> dict[str, object]:
    status = error.status_code
    kind = _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    message = error.message if error.param is None or error.param in error.message else f"{error.param}: {error.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_response(error: InfermuxError, request_id: str | None) -> Response[bytes]:
    headers: dict[str, str] = dict(error.headers)
    if error.retry_after is not None:
        headers["retry-after"] = str(max(0, math.ceil(error.retry_after)))
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
        headers["request-id"] = request_id  # Anthropic's own header name
    return Response(
        content=_encoder.encode(error_body(error)),
        status_code=error.status_code,
        media_type="application/json",
        headers=headers,
    )


def anthropic_error_frame(error: InfermuxError) -> bytes:
    """The ``error`` event that ends a stream that broke after its first byte."""
    return b"event: error\ndata: " + _encoder.encode(error_body(error)) + b"\n\n"

"""The one place where any exception becomes an HTTP error: the OpenAI envelope.

``{"error": {"message", "type", "param", "code"}}`` for :class:`InfermuxError` subclasses
(status, ``Retry-After`` and extra headers from the error), for Litestar's own 404 / 405 /
parameter-validation errors, for request bodies msgspec refused (400 with ``param`` taken
from msgspec's path: ``$.messages[0].role`` -> ``messages[0].role``, see
:func:`invalid_body_error`) and for anything unexpected (500, logged, with the request id in
the message). Streams that already started get the same body as an SSE frame
(:func:`error_frame`).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import (
    HTTPException,
    MethodNotAllowedException,
    NotFoundException,
    ValidationException,
)

from backends.errors import InfermuxError, InvalidRequestError, NotFoundError
from gateway.anthropic.errors import PATH_PREFIX as ANTHROPIC_PATH_PREFIX
from gateway.anthropic.errors import anthropic_error_response
from gateway.config.validation_message import split_validation_message
from gateway.http.request_id import REQUEST_ID_HEADER, request_id_of
from gateway.serving.failure import as_infermux_error

__all__ = [
    "MethodNotAllowedError",
    "error_frame",
    "error_response",
    "handle_exception",
    "invalid_body_error",
    "to_infermux_error",
]

_encoder = msgspec.json.Encoder()


class MethodNotAllowedError(InvalidRequestError):
    """The path exists but not with this HTTP method."""

    status_code = 405
    code = "method_not_allowed"


class _ClientError(InvalidRequestError):
    """Another 4xx raised by the framework; the status is set per instance."""

    code = "invalid_request"


def to_infermux_error(exc: BaseException, request_id: str | None = None) -> InfermuxError:
    """Map any exception onto the error tree: Litestar's own here, the rest as while serving
    (:func:`gateway.serving.failure.as_infermux_error`; unexpected ones become a 500)."""
    if isinstance(exc, ValidationException):
        return _validation_error(exc)
    if isinstance(exc, NotFoundException):
        return NotFoundError(exc.detail if exc.detail != "Not Found" else "no such endpoint")
    if isinstance(exc, MethodNotAllowedException):
        return MethodNotAllowedError("this endpoint does not accept that HTTP method")
    if isinstance(exc, HTTPException) and 400 <= exc.status_code < 500:
        error = _ClientError(_http_detail(exc), headers=dict(exc.headers or {}))
        error.status_code = exc.status_code
        return error
    return as_infermux_error(exc, request_id)


def error_response(error: InfermuxError, request_id: str | None = None) -> Response[bytes]:
    """The JSON error response for ``error``."""
    headers: dict[str, str] = dict(error.headers)
    if error.retry_after is not None:
        headers["retry-after"] = str(max(0, math.ceil(error.retry_after)))
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
    return Response(
        content=_encoder.encode(error.to_dict()),
        status_code=error.status_code,
        media_type="application/json",
        headers=headers,
    )


def error_frame(error: InfermuxError) -> bytes:
    """The SSE frame that ends a stream that broke after its first byte (no ``[DONE]``)."""
    return b"data: " + _encoder.encode(error.to_dict()) + b"\n\n"


def handle_exception(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """Litestar exception handler for ``Exception`` (registered on the app); the routes of
    Anthropic's Messages API answer in its envelope."""
    request_id = request_id_of(request)
    error = to_infermux_error(exc, request_id)
    if request.scope["path"].startswith(ANTHROPIC_PATH_PREFIX):
        return anthropic_error_response(error, request_id)
    return error_response(error, request_id)


def invalid_body_error(exc: msgspec.ValidationError) -> InvalidRequestError:
    """400 for a request body msgspec could not convert to the endpoint's type."""
    message = str(exc)
    param, reason = split_validation_message(message)
    return _invalid_value(param, reason, message)


def _validation_error(exc: ValidationException) -> InvalidRequestError:
    # Litestar's signature model refused a query or path parameter, or a body's field.
    extra = exc.extra
    if isinstance(extra, list) and extra and isinstance(extra[0], dict):
        first = extra[0]
        message = str(first.get("message", exc.detail))
        key = first.get("key")
        param, reason = split_validation_message(message)
        if key == "data":  # the body (a POST controller's ``data``): name its field alone
            pass
        elif isinstance(key, str):
            param = key if param is None else f"{key}.{param}"
        return _invalid_value(param, reason, message)
    return InvalidRequestError(str(exc.detail) or "invalid request")


def _invalid_value(param: str | None, reason: str, message: str) -> InvalidRequestError:
    if param is None and message.startswith("Expected `object`"):
        reason = "the body must be a JSON object"
    text = f"invalid value for '{param}': {reason}" if param else reason
    return InvalidRequestError(text, param=param)


def _http_detail(exc: HTTPException) -> str:
    return exc.detail or f"HTTP {exc.status_code}"

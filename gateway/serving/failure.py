"""Any exception met while serving a request, as an :class:`~backends.errors.InfermuxError`.

The errors backends, plugins and the router raise are already in that tree; msgspec's
refusals become a 400 naming the field, and anything else a 500 (logged, with the request id
in the message). The HTTP layer adds the framework's own exceptions on top
(:func:`gateway.http.errors.to_infermux_error`), which nothing below it raises.
"""

from __future__ import annotations

import logging

import msgspec

from backends.errors import InfermuxError, InvalidRequestError
from gateway.config.validation_message import split_validation_message

__all__ = ["as_infermux_error"]

logger = logging.getLogger("gateway")


def as_infermux_error(exc: BaseException, request_id: str | None = None) -> InfermuxError:
    """Map ``exc`` onto the error tree (unexpected ones become a 500)."""
    if isinstance(exc, InfermuxError):
        return exc
    if isinstance(exc, RecursionError):
        # msgspec's decoder refuses absurdly deep nesting this way.
        return InvalidRequestError("the JSON body is nested too deeply", code="invalid_json")
    if isinstance(exc, (msgspec.ValidationError, msgspec.DecodeError)):
        param, reason = split_validation_message(str(exc))
        return InvalidRequestError(reason, param=param)
    logger.error("unexpected error in request %s", request_id, exc_info=exc)
    return InfermuxError(
        f"internal error; quote request id {request_id} when reporting it",
        code="internal_error",
    )

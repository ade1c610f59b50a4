"""415 for a POST whose body is not declared ``application/json``.

Every POST the gateway serves takes a JSON body (it has no form or multipart endpoint), and
the body used to be decoded whatever the request said it was. A web page can make a browser
send a cross-site POST without asking first (no CORS preflight) only with a "simple" type:
``text/plain``, ``application/x-www-form-urlencoded`` or ``multipart/form-data``. Requiring
``application/json`` (parameters such as ``charset`` allowed) therefore turns every such
request away before its body is read, in every mode. The OpenAI and Anthropic SDKs, httpx's
``json=`` and curl's ``--json`` send it.

The generation endpoints check it themselves after the API key
(:mod:`gateway.http.endpoint`); the controllers' POSTs through :func:`json_body_hook`, the
app's ``before_request``, which Litestar runs after the API-key guard and before the body is
parsed.
"""

from __future__ import annotations

from typing import Any

from litestar import Request

from backends.errors import InvalidRequestError

__all__ = ["UnsupportedMediaTypeError", "json_body_hook", "require_json"]


class UnsupportedMediaTypeError(InvalidRequestError):
    """The request body is not declared ``application/json``."""

    status_code = 415
    code = "unsupported_media_type"


def require_json(content_type: str | None) -> None:
    """415 unless ``content_type`` (the header's value) is ``application/json``."""
    if content_type is not None:
        media_type = content_type.partition(";")[0].strip().lower()
        if media_type == "application/json":
            return
    raise UnsupportedMediaTypeError(
        f"Content-Type must be application/json, got {(content_type or '(none)')[:100]!r}",
        param="Content-Type",
    )


async def json_body_hook(request: Request[Any, Any, Any]) -> None:
    """``before_request`` of the app: a POST's body must be JSON."""
    if request.method == "POST":
        require_json(request.headers.get("content-type"))

"""``POST /v1/chat/completions`` and ``POST /v1/completions``: the HTTP side of generation.

Both are Litestar ``@asgi`` route handlers: routed by Litestar, wrapped by the app's
middleware (header limit) and exception handling like every route, but reading the body,
decoding it and answering themselves. For a request to a fast upstream, Litestar's
machinery for ordinary handlers (request object, dependency injection, signature model,
guards run through a copy of the handler, response rendering) cost about as much CPU as
everything else the gateway does; the gateway's overhead target is 1 ms per request.

What a client sees is what an ordinary Litestar POST handler gives: ``OPTIONS`` answers 204
with ``Allow`` (after the API key check), other methods 405 (before it), a body not
declared ``application/json`` 415 (after the key, before the body is read), a body over
``[server] max_body_bytes`` 413, malformed JSON 400 ``invalid_json``, and values the wire
type refuses 400 naming the parameter (decoded with msgspec as Litestar does: JSON first,
then a lax conversion, so ``"temperature": "0.5"`` is accepted). The OpenAPI operations are
added by :func:`gateway.http.openapi.complete_openapi` from each :class:`GenerationEndpoint`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar, cast

import msgspec
from litestar.exceptions import ClientException, NotFoundException
from litestar.handlers import ASGIRouteHandler, asgi
from litestar.types import HTTPScope, Receive, Scope, Send

from backends.errors import GenerationAbortedError, InvalidRequestError, RequestTooLargeError
from gateway.config.types import ApiKeyConfig, ServerConfig
from gateway.http.auth import authorize
from gateway.http.body_check import check_raw_body
from gateway.http.content_type import require_json
from gateway.http.errors import MethodNotAllowedError, invalid_body_error
from gateway.http.request_id import request_id_in
from gateway.http.respond import BACKEND_HEADER, Generation, respond
from gateway.openai.request_conversion import RequestContext, header_labels
from gateway.state import GatewayState
from plugins.builtin.slo_cost import TPOT_SLO_HEADER, TTFT_SLO_HEADER

__all__ = ["GenerationEndpoint", "generation_handlers"]

BodyT = TypeVar("BodyT", bound=msgspec.Struct)

_ALLOW = [(b"allow", b"OPTIONS, POST")]
#: A request's latency SLO (the ``slo_cost`` routing strategy reads them from the labels).
SLO_HEADERS = (TTFT_SLO_HEADER, TPOT_SLO_HEADER)


def _with_key_slo(labels: dict[str, str], api_key: ApiKeyConfig | None) -> dict[str, str]:
    """The API key's SLO (``[[auth.keys]] ttft_slo_ms / tpot_slo_ms``) where the request's
    headers set none: header, then key, then the alias's own (read by ``slo_cost``)."""
    if api_key is not None:
        for header, value in ((TTFT_SLO_HEADER, api_key.ttft_slo_ms), (TPOT_SLO_HEADER, api_key.tpot_slo_ms)):
            if value is not None and header not in labels:
                labels[header] = f"{value:g}"
    return labels


class GenerationEndpoint(Generic[BodyT]):
    """One generation endpoint: its path, wire types, OpenAPI text, and ``prepare``."""

    def __init__(
        self,
        *,
        path: str,
        operation_id: str,
        summary: str,
        description: str,
        body_type: type[BodyT],
        response_type: type[msgspec.Struct],
        prepare: Callable[[BodyT, RequestContext], Generation | Awaitable[Generation]],
        stream_type: type[msgspec.Struct] | None = None,
    ) -> None:
        self.path = path
        self.operation_id = operation_id
        self.summary = summary
        self.description = description
        self.body_type = body_type
        self.response_type = response_type
        #: Wire body -> backend requests and output builder (raises 400s naming the field);
        #: async where it reads a store (the Responses API's ``previous_response_id``).
        self.prepare = prepare
        #: What one streamed event carries (None: ``<response_type>Chunk``, as chat's).
        self.stream_type = stream_type


def generation_handlers(
    endpoints: Sequence[GenerationEndpoint[Any]], gateway: GatewayState
) -> list[ASGIRouteHandler]:
    """The route handlers of ``endpoints``, serving ``gateway`` (one set per app)."""
    return [_handler(endpoint, gateway) for endpoint in endpoints]


def _handler(endpoint: GenerationEndpoint[Any], gateway: GatewayState) -> ASGIRouteHandler:
    async def handle(scope: Scope, receive: Receive, send: Send) -> None:
        await _serve(endpoint, gateway, scope, receive, send)

    # The scope is shared with the exception handling, which quotes the request id.
    return asgi(endpoint.path, name=endpoint.operation_id, copy_scope=False)(handle)


async def _serve(
    endpoint: GenerationEndpoint[Any],
    gateway: GatewayState,
    scope: Scope,
    receive: Receive,
    send: Send,
) -> None:
    if scope["type"] != "http":
        raise NotFoundException()  # no websocket here, as on any route without a handler for it
    request_id = request_id_in(scope)
    method = cast("HTTPScope", scope)["method"]
    if method != "POST" and method != "OPTIONS":
        raise MethodNotAllowedError("this endpoint does not accept that HTTP method")
    headers = _headers(scope)
    api_key = authorize(scope, headers, gateway.key_store)
    if method == "OPTIONS":
        await send({"type": "http.response.start", "status": 204, "headers": _ALLOW})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    require_json(headers.get("content-type"))
    raw = await _read_body(receive, headers.get("content-length"), gateway.config.server)
    body = _decode(raw, endpoint.body_type)
    check_raw_body(raw)
    config = gateway.config
    prepared = endpoint.prepare(
        body,
        RequestContext(
            request_id=request_id,
            limits=config.limits,
            reasoning=config.reasoning,
            traceparent=headers.get("traceparent"),
            labels=_with_key_slo(header_labels(headers, (*config.plugins.request_headers, *SLO_HEADERS)), api_key),
            api_key_id=api_key.id if api_key is not None else None,
            tenant=api_key.tenant if api_key is not None else None,
            cache_partition=config.cache.partition_of(api_key.tenant) if api_key is not None else None,
        ),
    )
    generation = prepared if isinstance(prepared, Generation) else await prepared
    await respond(
        scope,
        receive,
        send,
        gateway,
        generation,
        request_id=request_id,
        api_key=api_key,
        pinned_backend=headers.get(BACKEND_HEADER) or None,
    )


def _headers(scope: Scope) -> dict[str, str]:
    """The request headers by (lower-case) name; the first of repeated ones."""
    headers: dict[str, str] = {}
    for name, value in scope["headers"]:
        headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return headers


async def _read_body(receive: Receive, content_length: str | None, server: ServerConfig) -> bytes:
    """The whole body; 413 as soon as it is known to be over ``server.max_body_bytes``."""
    limit = server.max_body_bytes
    if content_length is not None:
        try:
            announced = int(content_length)
        except ValueError:
            raise ClientException(f"Invalid content-length: {content_length!r}") from None
        if announced > limit:
            raise RequestTooLargeError("the request body is larger than this server accepts")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise GenerationAbortedError("the client disconnected before its request was read")
        if message["type"] != "http.request":
            continue
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise RequestTooLargeError("the request body is larger than this server accepts")
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _decode(raw: bytes, body_type: type[BodyT]) -> BodyT:
    if not raw:
        raise InvalidRequestError("the request body is empty; send a JSON object")
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(
            f"the body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    try:
        return msgspec.convert(value, body_type, strict=False)
    except msgspec.ValidationError as exc:
        raise invalid_body_error(exc) from None

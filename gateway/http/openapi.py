"""Completing the OpenAPI document (``/schema/openapi.json``) with what Litestar cannot infer.

Litestar documents each handler's success body and its own validation-error shape. The
gateway answers differently, so the document is completed here, in one place, once the app
is built:

- the generation endpoints (``@asgi`` handlers, which Litestar does not document) get their
  operations from their :class:`~gateway.http.endpoint.GenerationEndpoint`;
- the wire types' schemas come from msgspec itself (``msgspec.json.schema_components``),
  the same code that validates requests, so every range and enum is documented exactly
  (Litestar's generator drops a bound of 0, such as ``temperature >= 0``);
- every error response is the OpenAI envelope (component ``ErrorResponse``), listed per
  status the operation can really answer, plus ``default`` for the rare rest (a proxy's
  405, uvicorn's own 400 for malformed HTTP);
- generation endpoints also answer ``text/event-stream`` (``"stream": true``);
- ``/ready`` answers 503 with the readiness body while loading or draining;
- ``/v1/`` operations require the API key (``Authorization: Bearer``) when keys are
  configured: the ``apiKey`` security scheme.

The fuzzing suite (tests/reliability/test_openapi_fuzz.py) checks every response the
gateway gives against this document.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from litestar import Litestar
from litestar._openapi.plugin import OpenAPIPlugin
from litestar.openapi.spec import (
    Components,
    OpenAPIMediaType,
    OpenAPIResponse,
    Operation,
    PathItem,
    Reference,
    RequestBody,
    SecurityScheme,
)

from gateway.anthropic import schemas as anthropic_schemas
from gateway.anthropic.errors import PATH_PREFIX as ANTHROPIC_PATH_PREFIX
from gateway.http.endpoint import GenerationEndpoint
from gateway.openai import schemas

__all__ = ["complete_openapi"]

_DESCRIPTIONS = {
    "400": "Invalid request: the message says what to change and `param` names the field",
    "401": "Missing or invalid API key (`invalid_api_key`)",
    "403": "Open mode (no API keys configured) serves programs on this machine only: a "
    "non-loopback client, `Host` or `Origin` is refused",
    "404": "Unknown model (`model_not_found`) or endpoint",
    "413": "Request body larger than `[server] max_body_bytes`",
    "415": "Request body not declared `Content-Type: application/json`",
    "429": "Rate limit of the API key, or of the upstream (`Retry-After` says when to retry)",
    "431": "Request headers larger than `[limits] max_header_bytes`",
    "500": "Internal error; the message quotes the request id",
    "502": "The backend failed",
    "503": "No backend available, still loading, draining, or at capacity (`Retry-After`)",
    "504": "The backend did not answer in time",
    "default": "Any other error, as the OpenAI envelope",
}

_COMMON = ("431", "500", "default")
_V1 = ("401", "403")
_GENERATION = ("400", "404", "413", "415", "429", "502", "503", "504")
#: /tokenize and /detokenize: keyed like /v1/, answered by a backend but not admitted.
_TOKEN_PATHS = ("/tokenize", "/detokenize")
_TOKENS = ("400", "404", "413", "415", "502", "503")


def complete_openapi(app: Litestar, endpoints: Sequence[GenerationEndpoint[Any]]) -> None:
    """Add the generation operations, the gateway's error responses, SSE bodies and security
    scheme (see module doc)."""
    openapi = app.plugins.get(OpenAPIPlugin).provide_openapi()
    openapi.paths = {
        **{endpoint.path: PathItem(post=_generation_operation(endpoint)) for endpoint in endpoints},
        **(openapi.paths or {}),
    }
    components = openapi.components
    if isinstance(components, list):  # pragma: no cover - Litestar merges these itself
        components = components[0]
    assert isinstance(components, Components)
    # Raw JSON Schema dicts: Litestar serialises them as they are.
    _, wire_schemas = msgspec.json.schema_components(
        [getattr(schemas, name) for name in schemas.__all__]
        + [getattr(anthropic_schemas, name) for name in anthropic_schemas.__all__],
        ref_template="#/components/schemas/{name}",
    )
    components.schemas.update(wire_schemas)  # type: ignore[arg-type]
    components.security_schemes = {
        **(components.security_schemes or {}),
        "apiKey": SecurityScheme(
            type="http",
            scheme="bearer",
            description="An API key from [[auth.keys]] (only when keys are configured)",
        ),
    }
    stream_types = {e.path: e.stream_type.__name__ for e in endpoints if e.stream_type is not None}
    for path, item in (openapi.paths or {}).items():
        is_anthropic = path.startswith(ANTHROPIC_PATH_PREFIX)
        error_ref = Reference(ref=f"#/components/schemas/{'AnthropicErrorResponse' if is_anthropic else 'ErrorResponse'}")
        for operation in (item.get, item.post, item.put, item.delete, item.patch):
            if operation is None:
                continue
            statuses = list(_COMMON)
            if path.startswith("/v1/") or path in _TOKEN_PATHS:
                statuses += _V1
                operation.security = [{"apiKey": []}, {}]
            is_generation = operation.request_body is not None and path.startswith("/v1/")
            if path in _TOKEN_PATHS:
                statuses += _TOKENS
            elif is_generation:
                statuses += _GENERATION
            else:
                if operation.parameters:
                    statuses.append("400")
                if "{" in path:
                    statuses.append("404")
            responses = operation.responses if operation.responses is not None else {}
            for status in statuses:
                responses[status] = OpenAPIResponse(
                    description=_DESCRIPTIONS[status],
                    content={"application/json": OpenAPIMediaType(schema=error_ref)},
                )
            success = responses.get("200")
            if is_generation and isinstance(success, OpenAPIResponse) and success.content:
                body = success.content.get("application/json")
                ref = getattr(body.schema, "ref", "") if body is not None else ""
                # ChatCompletion -> ChatCompletionChunk, or the endpoint's own event type;
                # only endpoints that stream have one (embeddings never stream).
                chunk = stream_types.get(path, f"{ref.rsplit('/', 1)[-1]}Chunk")
                if ref and (is_anthropic or chunk in wire_schemas):
                    success.content["text/event-stream"] = OpenAPIMediaType(
                        # A raw dict, serialised as is.
                        schema=_anthropic_event_schema()  # type: ignore[arg-type]
                        if is_anthropic
                        else _sse_event_schema(f"#/components/schemas/{chunk}"),
                    )
            if path == "/ready" and isinstance(success, OpenAPIResponse):
                responses["503"] = OpenAPIResponse(
                    description="Loading, failed or draining (same body as 200)",
                    content=success.content,
                )
            operation.responses = responses


def _generation_operation(endpoint: GenerationEndpoint[Any]) -> Operation:
    """What Litestar documents for a POST handler taking ``body_type`` and returning
    ``response_type`` (the responses are completed by :func:`complete_openapi`)."""

    def ref(struct: type[msgspec.Struct]) -> Reference:
        return Reference(ref=f"#/components/schemas/{struct.__name__}")

    return Operation(
        tags=["generation"],
        summary=endpoint.summary,
        description=endpoint.description,
        operation_id=endpoint.operation_id,
        request_body=RequestBody(
            content={"application/json": OpenAPIMediaType(schema=ref(endpoint.body_type))},
            required=True,
        ),
        responses={
            "200": OpenAPIResponse(
                description="Request fulfilled, document follows",
                headers={},
                content={"application/json": OpenAPIMediaType(schema=ref(endpoint.response_type))},
            )
        },
        deprecated=False,
    )


def _anthropic_event_schema() -> dict[str, Any]:
    """One event of the Messages API's stream: ``event: <type>`` and its JSON ``data``."""
    return {
        "type": "object",
        "description": "Server-sent events as Anthropic sends them: message_start, ping, content_block_start, "
        "content_block_delta, content_block_stop, message_delta, message_stop; `error` ends a broken stream.",
        "required": ["event", "data"],
        "properties": {
            "event": {"type": "string"},
            "data": {"type": "string", "contentMediaType": "application/json"},
        },
    }


def _sse_event_schema(chunk_ref: str) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1: the schema describes each event): ``data`` is a
    chunk, the error envelope that ends a broken stream, or ``[DONE]``."""
    return {
        "type": "object",
        "description": "Server-sent events: `data: {chunk}` frames, then `data: [DONE]`; "
        'a stream that breaks after its first byte ends with `data: {"error": ...}` instead.',
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "anyOf": [
                                {"$ref": chunk_ref},
                                {"$ref": "#/components/schemas/ErrorResponse"},
                            ]
                        },
                    },
                ]
            }
        },
    }

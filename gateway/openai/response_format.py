"""Validation of ``response_format`` before any backend sees it.

OpenAI's three shapes are accepted: ``{"type": "text"}`` (no constraint), ``{"type":
"json_object"}`` and ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
Everything else is a 400 naming the field. The document is bounded in size and nesting
(``[limits] max_response_format_bytes`` / ``max_response_format_depth``), the walk is
iterative (no recursion a hostile schema could exhaust), and ``$ref`` must point inside the
schema: infermux never fetches a URL a request names. Whether a backend can enforce a valid
format is the capability check's business (:mod:`gateway.serving.capability_check`).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from backends.errors import InvalidRequestError
from gateway.config.types import LimitsConfig

__all__ = ["checked_response_format"]

_TYPES = ("text", "json_object", "json_schema")
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def checked_response_format(
    value: dict[str, Any] | None, limits: LimitsConfig
) -> dict[str, Any] | None:
    """The format to hand to the backend (None for plain text), or a 400."""
    if value is None:
        return None
    size = len(msgspec.json.encode(value))
    if size > limits.max_response_format_bytes:
        raise InvalidRequestError(
            f"response_format is {size} bytes; at most {limits.max_response_format_bytes} "
            "are accepted",
            param="response_format",
        )
    _check_depth(value, limits.max_response_format_depth)
    kind = value.get("type")
    if kind not in _TYPES:
        raise InvalidRequestError(
            f"response_format.type must be one of {', '.join(_TYPES)}; got {kind!r}",
            param="response_format.type",
        )
    if kind == "text":
        return None
    if kind == "json_schema":
        _check_json_schema(value.get("json_schema"))
    return value


def _check_json_schema(spec: Any) -> None:
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequestError(
            'response_format.json_schema must be an object with "name" and "schema"',
            param=param,
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise InvalidRequestError(
            "response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'",
            param=f"{param}.name",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(
            "response_format.json_schema.strict must be true or false", param=f"{param}.strict"
        )
    schema = spec.get("schema")
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            "response_format.json_schema.schema must be a JSON Schema object",
            param=f"{param}.schema",
        )
    _check_schema_nodes(schema, f"{param}.schema")


def _check_schema_nodes(schema: dict[str, Any], param: str) -> None:
    """Every ``$ref`` is local and every ``type`` / ``pattern`` has the right JSON type."""
    pending: list[Any] = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
            raise InvalidRequestError(
                f"$ref {ref!r} does not point inside the schema; infermux never fetches "
                "remote schemas",
                param=param,
            )
        kind = node.get("type")
        if kind is not None and not (
            isinstance(kind, str)
            or (isinstance(kind, list) and all(isinstance(k, str) for k in kind))
        ):
            raise InvalidRequestError(
                f"a schema 'type' must be a string or a list of strings; got {kind!r}",
                param=param,
            )
        pattern = node.get("pattern")
        if pattern is not None and not isinstance(pattern, str):
            raise InvalidRequestError("a schema 'pattern' must be a string", param=param)
        pending.extend(node.values())


def _check_depth(value: Any, max_depth: int) -> None:
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if depth > max_depth:
            raise InvalidRequestError(
                f"response_format is nested more than {max_depth} levels deep",
                param="response_format",
            )
        if isinstance(node, dict):
            pending.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            pending.extend((child, depth + 1) for child in node)

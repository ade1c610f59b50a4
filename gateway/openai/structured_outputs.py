"""The one structured-output constraint of a request, from whichever field carried it.

OpenAI's ``response_format`` (``json_object``, ``json_schema``; validated by
:mod:`gateway.openai.response_format`) and the extensions vLLM accepts - ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structured_outputs`` (``{"json"
| "regex" | "choice" | "grammar" | "json_object": ..., "disable_any_whitespace": bool}``) - become one normalised dict on
:attr:`backends.base.GenerationRequest.structured_outputs`: exactly one of those five keys,
plus ``param``, the request field it came from (errors name it; an ``openai`` remote gets
that field passed through unchanged). Two constraints in one request are a 400.
"""

from __future__ import annotations

from typing import Any

import msgspec

from backends.errors import InvalidRequestError
from gateway.config.types import LimitsConfig

__all__ = ["EXTENSION_FIELDS", "bounded_json", "structured_outputs_of"]

#: Request field -> the normalised key it fills (``structured_outputs`` carries its own).
EXTENSION_FIELDS: dict[str, str | None] = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structured_outputs": None,
}
_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def bounded_json(value: Any, param: str, limits: LimitsConfig) -> None:
    """400 naming ``param`` for JSON larger or deeper than the ``response_format`` caps."""
    size = len(msgspec.json.encode(value))
    if size > limits.max_response_format_bytes:
        raise InvalidRequestError(
            f"{param} is {size} bytes; at most {limits.max_response_format_bytes} are accepted", param=param
        )
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if depth > limits.max_response_format_depth:
            raise InvalidRequestError(
                f"{param} is nested more than {limits.max_response_format_depth} levels deep", param=param
            )
        if isinstance(node, dict):
            pending.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            pending.extend((child, depth + 1) for child in node)


def _checked(key: str, value: Any, param: str) -> Any:
    if key == "json":
        if not isinstance(value, dict | str):
            raise InvalidRequestError(f"{param} must be a JSON Schema (an object or its JSON text)", param=param)
    elif key in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
    elif key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(f"{param} must be a non-empty list of strings", param=param)
    elif value is not True:
        raise InvalidRequestError(f"{param} must be true when given", param=param)
    return value


def structured_outputs_of(
    body: Any, response_format: dict[str, Any] | None, limits: LimitsConfig
) -> dict[str, Any] | None:
    """The normalised constraint of ``body`` (``response_format`` already checked), or None."""
    given: list[tuple[str, Any]] = [
        (field, getattr(body, field)) for field in EXTENSION_FIELDS if getattr(body, field, None) is not None
    ]
    if response_format is not None:
        given.insert(0, ("response_format", response_format))
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError(
            f"give one output constraint, not {' and '.join(f for f, _ in given)}", param=given[1][0]
        )
    field, value = given[0]
    if field == "response_format":
        if value["type"] == "json_object":
            return {"json_object": True, "param": field}
        # A json_schema without a schema constrains to any JSON value.
        return {"json": value["json_schema"].get("schema") or {}, "param": field}
    bounded_json(value, field, limits)
    key = EXTENSION_FIELDS[field]
    if key is not None:
        return {key: _checked(key, value, field), "param": field}
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs must be an object", param=field)
    compact = value.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise InvalidRequestError(
            "structured_outputs.disable_any_whitespace must be a boolean", param="structured_outputs.disable_any_whitespace"
        )
    keys = [k for k in value if k != "disable_any_whitespace" and value[k] is not None and value[k] is not False]
    unknown = sorted(set(keys) - set(_KEYS))
    if unknown:
        raise InvalidRequestError(
            f"structured_outputs.{unknown[0]} is not supported (one of {', '.join(_KEYS)})",
            param=f"structured_outputs.{unknown[0]}",
        )
    if len(keys) != 1:
        raise InvalidRequestError(
            f"structured_outputs: give exactly one of {', '.join(_KEYS)}", param=field
        )
    key = keys[0]
    normalised = {key: _checked(key, value[key], f"structured_outputs.{key}"), "param": field}
    if compact:
        if key not in ("json", "json_object"):
            raise InvalidRequestError(
                "structured_outputs.disable_any_whitespace applies to json and json_object only",
                param="structured_outputs.disable_any_whitespace",
            )
        normalised["disable_any_whitespace"] = True
    return normalised

"""Checks on the raw JSON body that its typed decoding cannot make.

By the time this runs, the body was decoded into the wire Struct with msgspec
(gateway/http/endpoint.py), which already refuses what is not JSON (``NaN``,
``Infinity``, lone surrogates, invalid UTF-8, truncation) and absurd nesting. Two things
are invisible in the typed result:

- duplicate keys (``{"model": "a", "model": "b"}``): parsers disagree on which one wins, so
  a proxy in front of infermux could check one value while infermux used the other. 400.
- fields that would redirect or reprogram the backend (``api_base``, ``chat_template``...)
  or ask for a structured-output dialect no backend here implements (``guided_regex``...):
  unknown fields are otherwise ignored, as OpenAI does, which here would silently drop a
  constraint. 400 naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from backends.errors import InvalidRequestError, UnsupportedParameterError
from gateway.openai.request_conversion import check_smuggled_fields

__all__ = ["GUIDED_DECODING_FIELDS", "check_raw_body"]

#: Structured-output fields of other servers that infermux does not take (it takes
#: ``response_format`` and vLLM's ``guided_*`` / ``structured_outputs``, see
#: gateway/openai/structured_outputs.py): a 400 rather than a constraint silently dropped.
GUIDED_DECODING_FIELDS = frozenset(
    {
        "guided_whitespace_pattern",
        "guided_decoding_backend",
        "regex",
        "ebnf",
        "json_schema",
    }
)


class _DuplicateKeyError(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _pairs_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKeyError(key)
            seen.add(key)
    return result


_decoder = json.JSONDecoder(object_pairs_hook=_pairs_without_duplicates)


def check_raw_body(raw: bytes) -> None:
    """400 for duplicate keys, smuggling fields and unsupported guided-decoding fields."""
    try:
        body = _decoder.decode(raw.decode("utf-8"))
    except _DuplicateKeyError as exc:
        raise InvalidRequestError(
            f"the key {exc.key!r} appears twice in one JSON object; send it once",
            param=exc.key,
            code="invalid_json",
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:  # msgspec accepted it; be safe anyway
        raise InvalidRequestError(
            f"the body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    check_smuggled_fields(body)
    if isinstance(body, Mapping):
        for field in sorted(GUIDED_DECODING_FIELDS.intersection(body)):
            if body[field] is not None:
                raise UnsupportedParameterError(
                    f"'{field}' is not supported; constrain the output with response_format "
                    "(json_object or json_schema) or guided_json / guided_regex / guided_choice / "
                    "guided_grammar instead",
                    param=field,
                )

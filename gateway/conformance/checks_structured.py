"""Structured outputs: ``response_format`` ``json_object`` and ``json_schema`` (strict).

Written from https://platform.openai.com/docs/api-reference/chat/create#chat-create-response_format
and https://platform.openai.com/docs/guides/structured-outputs. The schema is small and
bounded, so a finished answer fits in the request's ``max_tokens``.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.conformance.checks_chat import chat
from gateway.conformance.expect import expect
from gateway.conformance.runner import CheckFailed, Exchange, Probe, check

REF = "https://platform.openai.com/docs/api-reference/chat/create#chat-create-response_format"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


def _json_content(data: dict[str, Any], exchange: Exchange) -> Any:
    choice = data["choices"][0]
    expect(choice["finish_reason"] == "stop", "the structured answer must finish (finish_reason \"stop\")", exchange)
    try:
        return json.loads(choice["message"]["content"])
    except (TypeError, ValueError):
        raise CheckFailed(f"message.content is not valid JSON\n{exchange}") from None


@check("structured.json_object", "openai", f"{REF} ({{\"type\": \"json_object\"}}: the content is a JSON object)")
def structured_json_object(probe: Probe) -> None:
    messages = [{"role": "user", "content": "Give a JSON object with the key \"city\" set to a French city. Only JSON."}]
    exchange, data = chat(probe, messages=messages, response_format={"type": "json_object"}, max_tokens=80)
    value = _json_content(data, exchange)
    expect(isinstance(value, dict), "json_object: the content must be a JSON object", exchange, offending=value)


@check("structured.json_schema", "openai", f"{REF} (json_schema strict: the content validates against the schema)")
def structured_json_schema(probe: Probe) -> None:
    messages = [{"role": "user", "content": "Is it sunny in Paris? Answer in JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "strict": True, "schema": SCHEMA}}
    exchange, data = chat(probe, messages=messages, response_format=response_format, max_tokens=60)
    value = _json_content(data, exchange)
    expect(isinstance(value, dict) and set(value) == {"city", "sunny"}, "the object must have exactly the schema's required keys", exchange, offending=value)
    expect(isinstance(value["city"], str) and len(value["city"]) <= 12, "city must be a string of at most 12 characters", exchange, offending=value)
    expect(isinstance(value["sunny"], bool), "sunny must be a boolean", exchange, offending=value)

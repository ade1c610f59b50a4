"""The grammar that makes ``tool_choice = "required"`` (or a named function) always valid.

llguidance compiles it like any other constraint (``structured_outputs.grammar``, errors
naming ``tool_choice``): Lark rules for the format's framing around an embedded JSON Schema
(``%json``) per call - ``{"name": <one of the offered functions>, "arguments": <that
function's parameters schema>}``, laid out on one line (``", "`` and ``": "``). With ``parallel_tool_calls`` several calls may follow each
other; without it, exactly one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["tool_call_grammar"]


def _call_schema(tool: Mapping[str, Any], args_key: str) -> dict[str, Any]:
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, args_key: parameters},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _lark(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def tool_call_grammar(fmt: str, tools: Sequence[Mapping[str, Any]], *, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) for one or more calls of ``tools`` in ``fmt``."""
    args_key = "parameters" if fmt == "llama3_json" else "arguments"
    schemas = [_call_schema(tool, args_key) for tool in tools]
    schema: dict[str, Any] = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
    # One layout, as the fallback prompt shows it: a small model given free whitespace can
    # spend its whole max_tokens on newlines inside the object.
    schema["x-guidance"] = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    body = "body: %json " + json.dumps(schema, ensure_ascii=False)
    if fmt == "hermes":
        call = f"call: {_lark('<tool_call>' + chr(10))} body {_lark(chr(10) + '</tool_call>')}"
        start = f"start: call ({_lark(chr(10))} call)*" if parallel else "start: call"
    elif fmt == "llama3_json":
        call = "call: body"
        start = f"start: call ({_lark('; ')} call)*" if parallel else "start: call"
    elif fmt == "mistral":
        call = "call: body"
        more = f" ({_lark(', ')} call)*" if parallel else ""
        start = f"start: {_lark('[TOOL_CALLS][')} call{more} {_lark(']')}"
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    return "\n".join((start, call, body))

"""Tool calls: ``tool_choice`` required and named, ``parallel_tool_calls``, and the streamed
deltas (index, id, type and name first, then argument fragments) reassembling to the call
the non-streamed request returns.

Written from https://platform.openai.com/docs/api-reference/chat/create (tools, tool_choice,
parallel_tool_calls) and /chat/streaming (choices[].delta.tool_calls).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.conformance.checks_chat import chat, chat_stream
from gateway.conformance.expect import expect, expect_type
from gateway.conformance.runner import CheckFailed, Exchange, Probe, check

REF = "https://platform.openai.com/docs/api-reference/chat"


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
                "additionalProperties": False,
            },
        },
    }


WEATHER = _tool("get_weather", "The current weather in a city.", {"city": {"type": "string", "maxLength": 30}})
TIME = _tool("get_time", "The local time in a time zone.", {"timezone": {"type": "string", "maxLength": 30}})
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def expect_tool_calls(message: dict[str, Any], exchange: Exchange, names: set[str]) -> list[dict[str, Any]]:
    """Each call: an id, ``type`` "function", a known name, arguments a JSON object string."""
    calls = message.get("tool_calls")
    expect(isinstance(calls, list) and len(calls) >= 1, "message.tool_calls must hold the call(s)", exchange)
    assert isinstance(calls, list)
    for i, call in enumerate(calls):
        field = f"message.tool_calls[{i}]"
        expect_type(call.get("id"), str, f"{field}.id", exchange)
        expect(call.get("type") == "function", f"{field}.type must be \"function\"", exchange, offending=call)
        function = call.get("function") or {}
        expect(function.get("name") in names, f"{field}.function.name must be one of {sorted(names)}", exchange, offending=call)
        expect_type(function.get("arguments"), str, f"{field}.function.arguments", exchange)
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            raise CheckFailed(f"{field}.function.arguments is not JSON\n{exchange}") from None
        expect(isinstance(arguments, dict), f"{field}.function.arguments must be a JSON object", exchange)
    expect(len({c["id"] for c in calls}) == len(calls), "tool call ids must be distinct", exchange)
    return calls


@check("tools.required", "openai", f"{REF}/create#chat-create-tool_choice (\"required\": tool_calls, finish_reason \"tool_calls\")")
def tools_required(probe: Probe) -> None:
    exchange, data = chat(probe, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    choice = data["choices"][0]
    expect_tool_calls(choice["message"], exchange, {"get_weather", "get_time"})
    expect(choice["finish_reason"] == "tool_calls", "finish_reason must be \"tool_calls\"", exchange)


@check("tools.named", "openai", f"{REF}/create#chat-create-tool_choice (a named function: that function is called)")
def tools_named(probe: Probe) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    exchange, data = chat(probe, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60)
    expect_tool_calls(data["choices"][0]["message"], exchange, {"get_time"})


@check("tools.parallel_off", "openai", f"{REF}/create#chat-create-parallel_tool_calls (false: at most one call)")
def tools_parallel_off(probe: Probe) -> None:
    messages = [{"role": "user", "content": "What are the weather and the time in Berlin?"}]
    exchange, data = chat(probe, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    calls = expect_tool_calls(data["choices"][0]["message"], exchange, {"get_weather", "get_time"})
    expect(len(calls) == 1, "parallel_tool_calls=false: exactly one call", exchange, offending=calls)


@check("tools.parallel", "openai", f"{REF}/create#chat-create-parallel_tool_calls (true: each call valid with its own id; streamed indexes 0..k-1)")
def tools_parallel(probe: Probe) -> None:
    messages = [{"role": "user", "content": "What are the weather and the time in Berlin?"}]
    fields: dict[str, Any] = {"messages": messages, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": True, "max_tokens": 100}
    exchange, data = chat(probe, **fields)
    choice = data["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    if choice["finish_reason"] == "length" and len(calls) > 1:
        # The last call may be cut by max_tokens; the complete ones must be valid.
        choice["message"] = {**choice["message"], "tool_calls": calls[:-1]}
    expect_tool_calls(choice["message"], exchange, {"get_weather", "get_time"})
    exchange, chunks = chat_stream(probe, **fields)
    firsts: list[int] = []
    ids: list[str] = []
    for chunk in chunks:
        for streamed in chunk.get("choices", []):
            for fragment in streamed["delta"].get("tool_calls") or []:
                if fragment.get("index") not in firsts:
                    firsts.append(fragment.get("index"))
                    ids.append(fragment.get("id"))
    expect(firsts == list(range(len(firsts))) and len(firsts) >= 1, "streamed calls must be indexed 0, 1, ... in order", exchange, offending=firsts)
    expect(len(set(ids)) == len(ids), "streamed calls must have distinct ids", exchange, offending=ids)


@check("tools.stream", "openai", f"{REF}/streaming (delta.tool_calls: index, id, type, function.name, then arguments fragments)")
def tools_stream(probe: Probe) -> None:
    fields: dict[str, Any] = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60}
    reference, data = chat(probe, **fields)
    expected = expect_tool_calls(data["choices"][0]["message"], reference, {"get_weather", "get_time"})
    exchange, chunks = chat_stream(probe, **fields)
    assembled: dict[int, dict[str, Any]] = {}
    finish = None
    for i, chunk in enumerate(chunks):
        for choice in chunk.get("choices", []):
            finish = choice.get("finish_reason") or finish
            for fragment in choice["delta"].get("tool_calls") or []:
                index = fragment.get("index")
                expect_type(index, int, f"chunk {i}: delta.tool_calls[].index", exchange)
                function = fragment.get("function") or {}
                if index not in assembled:
                    expect_type(fragment.get("id"), str, f"chunk {i}: the first fragment of call {index}: id", exchange)
                    expect(fragment.get("type") == "function", f"chunk {i}: the first fragment of call {index}: type \"function\"", exchange, offending=fragment)
                    expect_type(function.get("name"), str, f"chunk {i}: the first fragment of call {index}: function.name", exchange)
                    assembled[index] = {"name": function["name"], "arguments": function.get("arguments") or ""}
                    continue
                expect(fragment.get("id") is None and function.get("name") is None, f"chunk {i}: a later fragment of call {index} repeats id or name", exchange, offending=fragment)
                expect_type(function.get("arguments"), str, f"chunk {i}: delta.tool_calls[].function.arguments", exchange)
                assembled[index]["arguments"] += function["arguments"]
    expect(finish == "tool_calls", "a streamed required call ends with finish_reason \"tool_calls\"", exchange)
    got = [(c["name"], json.loads(c["arguments"] or "null")) for _, c in sorted(assembled.items())]
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in expected]
    expect(got == want, f"the reassembled streamed calls must equal the non-streamed ones {want}", exchange, offending=got)

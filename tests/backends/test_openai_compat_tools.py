"""Tools and reasoning through an ``openai``-kind backend: passed through unchanged.

The gateway sends the upstream (a fake OpenAI-compatible server on loopback) the tools,
``tool_choice``, ``parallel_tool_calls``, the earlier calls and tool results, and the
reasoning fields as the client sent them; the upstream's ``delta.tool_calls`` and
``reasoning_content`` come back to the official client in OpenAI's shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from upstream_server import Behaviour, UpstreamServer

from backends.base import BackendConfig
from gateway.testing import gateway_config

StartUpstream = Callable[..., UpstreamServer]

TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
#: A vLLM-style streamed answer: thinking, then one call whose arguments come in fragments.
RECORDED = [
    {"role": "assistant", "content": ""},
    {"reasoning_content": "The user wants "},
    {"reasoning_content": "the weather."},
    {"tool_calls": [{"index": 0, "id": "call_up1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
]


def test_tools_and_reasoning_pass_through_an_openai_remote(
    upstream_servers: StartUpstream, live_gateway: Any
) -> None:
    upstream = upstream_servers(Behaviour(deltas=RECORDED, finish_reason="tool_calls"))
    config = gateway_config(
        BackendConfig(name="remote", kind="openai", options={"base_url": upstream.base_url}),
        models={"remote": ["remote"]},
    )
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "-3 C"},
        {"role": "user", "content": "And in Paris?"},
    ]
    with live_gateway(config) as gw:
        client = gw.openai_client(timeout=30)
        whole = client.chat.completions.create(
            model="remote", messages=history, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False, reasoning_effort="low", extra_body={"max_reasoning_tokens": 64},
        )
        sent = upstream.requests[-1].json
        with client.beta.chat.completions.stream(model="remote", messages=history, tools=[TOOL]) as stream:
            final = stream.get_final_completion()
    assert sent["tools"] == [TOOL]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert sent["parallel_tool_calls"] is False
    assert sent["reasoning_effort"] == "low" and sent["max_reasoning_tokens"] == 64
    assert sent["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert sent["messages"][2] == {"role": "tool", "content": "-3 C", "tool_call_id": "call_0"}
    for completion in (whole, final):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.reasoning_content == "The user wants the weather."  # type: ignore[attr-defined]
        [call] = choice.message.tool_calls or []
        assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
            "call_up1", "get_weather", {"city": "Paris"},
        )

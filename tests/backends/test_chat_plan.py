"""The chat plan's parse step (backends/chat_plan.py): what every native backend streams out."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from backends.base import ChatMessage, GenerationChunk, GenerationRequest
from backends.chat_plan import load_chat, plan_chat

TOOLS = tuple(
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    for name in ("get_time", "get_weather")
)
#: Two Hermes-format calls, as a model that ignores ``parallel_tool_calls`` may write them.
TWO_CALLS = (
    '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


async def _chunks(text: str) -> AsyncIterator[GenerationChunk]:
    for i in range(0, len(text), 7):  # split anywhere, markers included
        yield GenerationChunk(text=text[i : i + 7])
    yield GenerationChunk(text="", finish_reason="stop")


@pytest.mark.parametrize("parallel", [True, False])
async def test_auto_with_parallel_tool_calls_false_gives_at_most_one_call(parallel: bool) -> None:
    template, fmt = load_chat(None, None)  # ChatML: the Hermes fallback prompt and parser
    request = GenerationRequest(
        request_id="r", model="m", kind="chat",
        messages=(ChatMessage(role="user", content="Time and weather in Oslo?"),),
        tools=TOOLS, tool_choice="auto", parallel_tool_calls=parallel,
    )  # fmt: skip
    plan = plan_chat(request, template, fmt)
    calls: dict[int, list[str]] = {}
    finish = None
    async for chunk in plan.parse(_chunks(TWO_CALLS)):
        finish = chunk.finish_reason or finish
        for delta in chunk.tool_calls:
            calls.setdefault(delta.index, ["", ""])
            calls[delta.index][0] += delta.name or ""
            calls[delta.index][1] += delta.arguments or ""
    names = [calls[i][0] for i in sorted(calls)]
    assert names == (["get_time", "get_weather"] if parallel else ["get_time"])
    assert all(json.loads(arguments) == {"city": "Oslo"} for _, arguments in calls.values())
    assert finish == "tool_calls"


async def test_a_harmony_answer_without_tools_is_its_final_channel() -> None:
    # gpt-oss frames every answer in channels; its markers reach the parser (special tokens
    # named in core_engine.chat.formats.SPECIAL_MARKERS), tools offered or not.
    from tests.real_artifacts import templates_dir

    source = (templates_dir() / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")
    template, fmt = load_chat(None, source)
    request = GenerationRequest(
        request_id="r", model="m", kind="chat", messages=(ChatMessage(role="user", content="Hi"),)
    )
    plan = plan_chat(request, template, fmt)
    answer = "<|channel|>analysis<|message|>Say hello.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
    content = reasoning = ""
    async for chunk in plan.parse(_chunks(answer)):
        content += chunk.text
        reasoning += chunk.reasoning or ""
    assert content == "Hello!" and reasoning == "Say hello."

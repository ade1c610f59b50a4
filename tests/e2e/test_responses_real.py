"""The Responses API on the real default model (llama.cpp and the core engine): a stream
whose text is the stored response's, ``text.format`` json_schema enforced by the engines'
structured outputs, and a ``previous_response_id`` chain whose prompt grows by the turns."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

pytestmark = pytest.mark.slow

BACKENDS = ["llamacpp", "core_engine"]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_streamed_response_is_what_retrieve_returns(default_client: Any, backend: str) -> None:
    events = list(
        default_client.responses.create(
            model="smollm2",
            input="Say hello.",
            max_output_tokens=12,
            temperature=0,
            stream=True,
            extra_headers={"x-infermux-backend": backend},
        )
    )
    final = events[-1].response
    # Cut at max_output_tokens the stream ends with response.incomplete, as OpenAI's does
    # (the SDK's stream() helper wants response.completed: tests/gateway covers it).
    assert events[-1].type == {"incomplete": "response.incomplete", "completed": "response.completed"}[final.status]
    if final.status == "incomplete":
        assert final.incomplete_details.reason == "max_output_tokens"
        assert final.usage.output_tokens == 12
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(deltas) == final.output_text
    assert default_client.responses.retrieve(final.id).output_text == final.output_text


@pytest.mark.parametrize("backend", BACKENDS)
def test_text_format_json_schema_is_enforced(default_client: Any, backend: str) -> None:
    response = default_client.responses.create(
        model="smollm2",
        input="Name a big city as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}},
        max_output_tokens=60,
        temperature=0,
        extra_headers={"x-infermux-backend": backend},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema"


def test_a_chain_sends_the_earlier_turns(default_client: Any) -> None:
    first = default_client.responses.create(
        model="smollm2", input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    second = default_client.responses.create(
        model="smollm2",
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    alone = default_client.responses.create(
        model="smollm2", input="What is my name?", max_output_tokens=8, temperature=0, store=False
    )
    # The second prompt holds the first turn and its answer on top of the question.
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens + 5


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_function_tool_round_trip(default_client: Any, backend: str) -> None:
    pin = {"x-infermux-backend": backend}
    events = list(
        default_client.responses.create(
            model="smollm2",
            input="What is the weather in Paris?",
            tools=[WEATHER],
            tool_choice="required",  # enforced by a grammar: the call comes whatever the model
            parallel_tool_calls=False,  # one call, then the grammar ends the output
            max_output_tokens=100,
            temperature=0,
            stream=True,
            extra_headers=pin,
        )
    )
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    final = events[-1].response
    assert kinds[-1] == "response.completed", final.output
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == calls[0].arguments
    # The client runs the function and sends its output back on the chain.
    answer = default_client.responses.create(
        model="smollm2",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 24 C"}],
        previous_response_id=final.id,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=20,
        temperature=0,
        extra_headers=pin,
    )
    assert answer.output[0].type == "message" and answer.output_text
    question_alone = default_client.responses.create(
        model="smollm2",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=1,
        store=False,
        extra_headers=pin,
    )
    # The follow-up's prompt holds the question, the call and its output.
    assert answer.usage.input_tokens > question_alone.usage.input_tokens + 10

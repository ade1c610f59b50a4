"""Anthropic's Messages API with the official ``anthropic`` client, on the real default model
(core engine in its engine process, and llama.cpp): create, the ``messages.stream()`` helper,
a tool-use round trip, and errors as the SDK's ``APIStatusError`` subclasses."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from backends.base import BackendConfig
from gateway.config.types import ApiKeyConfig, AuthConfig
from gateway.testing import LiveGateway, gateway_config

pytestmark = pytest.mark.slow

KEY = "sk-messages-test"
BACKENDS = ("core", "llamacpp")
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
#: Greedy, its answer "The capital city of France is Paris." wins each step by at least 1.1 logits
#: (exact fp32, 2026-12-04): "What is the capital of France?" starts with a near-tie (0.05)
#: between "The", "Al" and "L", which llama.cpp and the engine break differently by CPU.
QUESTION = [{"role": "user", "content": "What is the capital city of France? Answer in English."}]
#: The current SDK has no sampling arguments; the API (and infermux) still take them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def gw(live_gateway: Any) -> Iterator[LiveGateway]:
    config = gateway_config(
        BackendConfig(name="core", kind="core_engine", options={"kv_cache_memory_mb": 64}),
        BackendConfig(name="llamacpp", kind="llamacpp", options={"n_ctx": 1024, "parallel": 2}),
        # A small KV cache, which a few long prompts fill: for cache_control pins. float32 on
        # every CPU (bf16 where the CPU has it would hold twice the blocks in the same memory).
        BackendConfig(
            name="small-kv", kind="core_engine", options={"kv_cache_memory_mb": 32, "dtype": "float32"}
        ),
        models={name: [name] for name in (*BACKENDS, "small-kv")},
        auth=AuthConfig(keys=[ApiKeyConfig(id="test", key_sha256=hashlib.sha256(KEY.encode()).hexdigest())]),
    )
    with live_gateway(config) as gateway:
        yield gateway


def _client(gw: LiveGateway, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(gw), api_key=key, max_retries=0, timeout=120)


@pytest.mark.parametrize("model", BACKENDS)
def test_create_answers_a_message_with_usage(gw: LiveGateway, model: str) -> None:
    message = _client(gw).messages.create(
        model=model, max_tokens=24, messages=QUESTION, system="You are terse.", extra_body=GREEDY,
        metadata={"user_id": "u-1"},
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and "Paris" in message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 5 and 0 < message.usage.output_tokens <= 24


@pytest.mark.parametrize("model", BACKENDS)
def test_the_stream_helper_gets_the_same_text_as_create(gw: LiveGateway, model: str) -> None:
    client = _client(gw)
    whole = client.messages.create(model=model, max_tokens=32, messages=QUESTION, extra_body=GREEDY)
    with client.messages.stream(model=model, max_tokens=32, messages=QUESTION, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1
    assert "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The raw event sequence, as Anthropic sends it.
    with httpx.stream(
        "POST", f"{gw}/v1/messages", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        json={"model": model, "max_tokens": 8, "messages": QUESTION, "stream": True}, timeout=120,
    ) as response:
        events = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) == {"content_block_delta"}


@pytest.mark.parametrize("model", BACKENDS)
def test_a_tool_use_round_trip(gw: LiveGateway, model: str) -> None:
    client = _client(gw)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(
        model=model, max_tokens=80, messages=messages, tools=[WEATHER], extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    )
    assert first.stop_reason == "tool_use"
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    # The streamed call has the same input, from input_json_delta fragments.
    with client.messages.stream(
        model=model, max_tokens=80, messages=messages, tools=[WEATHER], extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": json.dumps({"temperature_c": 21})}]})
    second = client.messages.create(model=model, max_tokens=30, messages=messages, tools=[WEATHER], extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert any(b.type == "text" and b.text for b in second.content) or second.stop_reason == "tool_use"


def test_errors_are_the_sdk_s_status_errors_in_anthropic_s_envelope(gw: LiveGateway) -> None:
    client = _client(gw)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="core", max_tokens=0, messages=QUESTION)
    assert bad.value.status_code == 400
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=QUESTION)
    with pytest.raises(anthropic.AuthenticationError):
        _client(gw, "sk-wrong").messages.create(model="core", max_tokens=4, messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError) as tool:
        client.messages.create(model="core", max_tokens=4, messages=QUESTION, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "nope"})
    assert "tool_choice.name" in tool.value.body["error"]["message"]
    raw = httpx.post(f"{gw}/v1/messages", headers={"x-api-key": KEY}, json={"model": "core", "messages": QUESTION})
    assert raw.status_code == 400 and "max_tokens" in raw.json()["error"]["message"]
    # The OpenAI routes keep OpenAI's envelope.
    openai_style = httpx.post(f"{gw}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, json={})
    assert "param" in openai_style.json()["error"]


SYSTEM = " ".join(f"Rule {i}: answer in one short sentence about topic number {i}." for i in range(12))


def _flood(client: anthropic.Anthropic) -> None:
    for i in range(6):  # long, distinct prompts: together more than the whole KV cache
        text = " ".join(f"item{i}-{j}" for j in range(40))
        client.messages.create(model="small-kv", max_tokens=2, messages=[{"role": "user", "content": text}])


def test_cache_control_pins_the_marked_prefix_through_other_traffic(gw: LiveGateway) -> None:
    client = _client(gw)
    marked = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    for system, pinned in (([{"type": "text", "text": SYSTEM}], False), (marked, True)):
        first = client.messages.create(model="small-kv", max_tokens=2, system=system, messages=QUESTION)
        _flood(client)
        again = client.messages.create(model="small-kv", max_tokens=2, system=system, messages=QUESTION)
        cached = again.usage.cache_read_input_tokens or 0
        assert again.usage.input_tokens + cached == first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
        if pinned:
            assert cached >= 64  # the system prompt's whole blocks, read from the cache
        else:
            assert cached == 0  # evicted by the other prompts


def test_a_message_is_one_ledger_row_with_its_tokens(gw: LiveGateway) -> None:
    def totals() -> dict[str, Any]:
        return httpx.get(f"{gw}/v1/usage", headers={"x-api-key": KEY}, timeout=30).json()["totals"]

    before = totals()
    message = _client(gw).messages.create(model="core", max_tokens=8, messages=QUESTION)
    after = totals()
    assert after["requests"] == before["requests"] + 1
    assert after["input_tokens"] - before["input_tokens"] == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0
    )
    assert after["output_tokens"] - before["output_tokens"] == message.usage.output_tokens


@pytest.mark.parametrize("model", BACKENDS)
def test_count_tokens_is_what_a_message_reports_as_input(gw: LiveGateway, model: str) -> None:
    client = _client(gw)
    for extra in ({}, {"tools": [WEATHER]}, {"system": "You are terse."}):
        counted = client.messages.count_tokens(model=model, messages=QUESTION, **extra)
        message = client.messages.create(model=model, max_tokens=1, messages=QUESTION, **extra)
        assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=QUESTION)

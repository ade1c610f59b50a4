"""The official ``openai`` client against a live gateway (mock backends, real HTTP)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.testing import LiveGateway, gateway_config, mock_backend

CHAT = [{"role": "user", "content": "the quick brown fox jumps"}]


@pytest.fixture(scope="module")
def gw(live_gateway: Any) -> Iterator[LiveGateway]:
    config = gateway_config(
        mock_backend("mock"),
        mock_backend("sampler", sample_words=True),
        models={"echo": ["mock"], "sampled": ["sampler"]},
    )
    with live_gateway(config) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def client(gw: LiveGateway) -> Any:
    return gw.openai_client()


def test_models_list_and_get(client: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["echo", "sampled"]
    assert all(m.object == "model" and m.owned_by == "infermux" for m in models.data)
    model = client.models.retrieve("echo")
    assert model.id == "echo"


def test_chat_completion(client: Any) -> None:
    raw = client.chat.completions.with_raw_response.create(model="echo", messages=CHAT)
    completion = raw.parse()
    assert raw.headers["x-infermux-backend"] == "mock"
    assert raw.headers["x-request-id"]
    assert completion.object == "chat.completion"
    assert completion.model == "echo"
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "the quick brown fox jumps"
    assert choice.finish_reason == "stop"
    assert completion.usage.prompt_tokens == 5
    assert completion.usage.completion_tokens == 5
    assert completion.usage.total_tokens == 10
    assert completion.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_content_parts_are_joined(gw: LiveGateway, client: Any) -> None:
    completion = client.chat.completions.create(
        model="echo",
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "one two"}, {"type": "text", "text": "three"}],
            }
        ],
    )
    assert completion.choices[0].message.content == "one two three"
    assert gw.backend("mock").received[-1].messages[-1].content == "one two\nthree"


def test_chat_max_tokens_and_stop(client: Any) -> None:
    limited = client.chat.completions.create(model="echo", messages=CHAT, max_tokens=2)
    assert limited.choices[0].message.content == "the quick"
    assert limited.choices[0].finish_reason == "length"
    newer = client.chat.completions.create(model="echo", messages=CHAT, max_completion_tokens=3)
    assert newer.choices[0].message.content == "the quick brown"
    stopped = client.chat.completions.create(model="echo", messages=CHAT, stop=[" fox", "zzz"])
    assert stopped.choices[0].message.content == "the quick brown"
    assert stopped.choices[0].finish_reason == "stop"


def test_chat_stream_sends_role_first_usage_last(client: Any) -> None:
    chunks = list(
        client.chat.completions.create(
            model="echo", messages=CHAT, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "the quick brown fox jumps"
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["stop"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 5
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1


def test_raw_stream_frames_end_with_done(gw: LiveGateway) -> None:
    with httpx.stream(
        "POST",
        f"{gw}/v1/chat/completions",
        json={"model": "echo", "messages": CHAT, "stream": True},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-infermux-backend"] == "mock"
        body = response.read().decode()
    frames = [f for f in body.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"
    assert '"role":"assistant"' in frames[0]
    assert '"usage"' not in body  # only with stream_options.include_usage


def test_chat_n2_fans_out_with_consecutive_seeds(gw: LiveGateway, client: Any) -> None:
    completion = client.chat.completions.create(model="sampled", messages=CHAT, n=2, seed=41)
    assert [c.index for c in completion.choices] == [0, 1]
    received = list(gw.backend("sampler").received)[-2:]
    assert sorted(r.params.seed for r in received) == [41, 42]
    assert sorted(r.choice_index for r in received) == [0, 1]
    # Prompt counted once, completions summed (as OpenAI reports n > 1).
    assert completion.usage.prompt_tokens == 5
    assert completion.usage.completion_tokens == 10

    again = client.chat.completions.create(model="sampled", messages=CHAT, n=2, seed=41)
    assert [c.message.content for c in again.choices] == [
        c.message.content for c in completion.choices
    ]


def test_chat_n2_stream_carries_both_indices(client: Any) -> None:
    chunks = list(client.chat.completions.create(model="echo", messages=CHAT, n=2, stream=True))
    texts = {0: "", 1: ""}
    roles = set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert roles == {0, 1}
    assert texts == {0: "the quick brown fox jumps", 1: "the quick brown fox jumps"}


def test_chat_logprobs_shape(client: Any) -> None:
    completion = client.chat.completions.create(
        model="echo", messages=CHAT, logprobs=True, top_logprobs=3, max_tokens=2
    )
    content = completion.choices[0].logprobs.content
    assert [t.token for t in content] == ["the", " quick"]
    for entry in content:
        assert entry.logprob <= 0
        assert bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token

    streamed = client.chat.completions.create(
        model="echo", messages=CHAT, logprobs=True, max_tokens=2, stream=True
    )
    tokens = [
        t.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert tokens == ["the", " quick"]


def test_completion_non_stream_and_stream(client: Any) -> None:
    completion = client.completions.create(model="echo", prompt="alpha beta gamma", max_tokens=5)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == "alpha beta gamma"
    assert completion.usage.prompt_tokens == 3

    chunks = list(
        client.completions.create(
            model="echo",
            prompt="alpha beta gamma",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "alpha beta gamma"
    assert chunks[-1].usage.completion_tokens == 3


def test_completion_default_max_tokens_is_openais_16(client: Any) -> None:
    prompt = " ".join(f"w{i}" for i in range(30))
    completion = client.completions.create(model="echo", prompt=prompt)
    assert completion.usage.completion_tokens == 16
    assert completion.choices[0].finish_reason == "length"


def test_completion_prompt_lists_fan_out_per_prompt(client: Any) -> None:
    completion = client.completions.create(model="echo", prompt=["a b", "c d e"], n=2)
    assert [(c.index, c.text) for c in completion.choices] == [
        (0, "a b"),
        (1, "a b"),
        (2, "c d e"),
        (3, "c d e"),
    ]
    assert completion.usage.prompt_tokens == 5  # 2 + 3, each prompt once
    token_prompt = client.completions.create(model="echo", prompt=[[11, 12], [13]])
    assert [c.text for c in token_prompt.choices] == ["11 12", "13"]


def test_completion_echo_with_prompt_logprobs(client: Any) -> None:
    completion = client.completions.create(
        model="echo", prompt="one two three", echo=True, logprobs=2, max_tokens=2
    )
    choice = completion.choices[0]
    assert choice.text == "one two threeone two"
    logprobs = choice.logprobs
    assert logprobs.tokens == ["one", " two", " three", "one", " two"]
    assert logprobs.token_logprobs[0] is None  # nothing predicts the first prompt token
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.top_logprobs[0] is None
    assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == [0, 3, 7, 13, 16]

    scored = client.completions.create(
        model="echo", prompt="one two three", echo=True, logprobs=0, max_tokens=0
    )
    assert scored.choices[0].text == "one two three"
    assert scored.choices[0].logprobs.tokens == ["one", " two", " three"]
    assert scored.usage.completion_tokens == 0


def test_pinned_backend_header_is_honoured(live_gateway: Any) -> None:
    config = gateway_config(mock_backend("first"), mock_backend("second"))
    with live_gateway(config) as gateway:
        client = gateway.openai_client()
        raw = client.chat.completions.with_raw_response.create(
            model="echo", messages=CHAT, extra_headers={"x-infermux-backend": "second"}
        )
        assert raw.headers["x-infermux-backend"] == "second"
        assert gateway.backend("second").num_finished == 1
        assert gateway.backend("first").num_started == 0


def test_fallback_before_the_first_byte_names_the_serving_backend(live_gateway: Any) -> None:
    config = gateway_config(
        mock_backend("down", fail_before_first_token="unavailable"), mock_backend("up")
    )
    with live_gateway(config) as gateway:
        raw = gateway.openai_client().chat.completions.with_raw_response.create(
            model="echo", messages=CHAT
        )
        assert raw.headers["x-infermux-backend"] == "up"
        assert raw.parse().choices[0].message.content == "the quick brown fox jumps"


def test_openapi_schema_is_served(gw: LiveGateway) -> None:
    schema = httpx.get(f"{gw}/schema/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready"} <= set(
        schema["paths"]
    )
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]

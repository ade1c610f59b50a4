"""The mock/echo backend the gateway tests rely on: echo, limits, stops, logprobs, faults."""

from __future__ import annotations

import pytest

from backends.base import (
    BackendConfig,
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
)
from backends.errors import (
    BackendError,
    ContextLengthExceededError,
    UpstreamRateLimitError,
    UpstreamStatusError,
)
from backends.mock import MockBackend, create_backend


def _mock(**options: object) -> MockBackend:
    return create_backend(BackendConfig(name="m", kind="mock", options=dict(options)))


def _chat(text: str, **params: object) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        model="echo",
        kind="chat",
        messages=(
            ChatMessage(role="system", content="be brief"),
            ChatMessage(role="user", content=text),
        ),
        params=SamplingParams(**params),  # type: ignore[arg-type]
    )


async def _collect(backend: MockBackend, request: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in backend.generate(request)]


def _text(chunks: list[GenerationChunk]) -> str:
    return "".join(c.text for c in chunks)


async def test_echoes_the_last_user_message_with_usage() -> None:
    chunks = await _collect(_mock(), _chat("one two three"))
    assert _text(chunks) == "one two three"
    assert chunks[-1].finish_reason == "stop"
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (5, 3)  # system words count too


async def test_max_tokens_cuts_with_length() -> None:
    chunks = await _collect(_mock(), _chat("one two three four", max_tokens=2))
    assert _text(chunks) == "one two"
    assert chunks[-1].finish_reason == "length"


async def test_stop_string_across_tokens_is_not_leaked() -> None:
    chunks = await _collect(_mock(), _chat("alpha beta gamma delta", stop=("ta gam",)))
    assert _text(chunks) == "alpha be"
    assert chunks[-1].finish_reason == "stop"


async def test_logprobs_are_well_formed_and_seeded() -> None:
    request = _chat("a b c", logprobs=True, top_logprobs=3, seed=7)
    first = await _collect(_mock(), request)
    again = await _collect(_mock(), request)
    entries = [e for c in first if c.logprobs for e in c.logprobs]
    assert [e.token for e in entries] == ["a", " b", " c"]
    for entry in entries:
        assert entry.logprob is not None and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
    assert entries == [e for c in again if c.logprobs for e in c.logprobs]


async def test_sample_words_depends_on_seed_only() -> None:
    mock = _mock(sample_words=True)
    text = "w1 w2 w3 w4 w5 w6 w7 w8"
    a = _text(await _collect(mock, _chat(text, seed=1)))
    b = _text(await _collect(mock, _chat(text, seed=1)))
    c = _text(await _collect(mock, _chat(text, seed=2)))
    assert a == b
    assert a != c


async def test_completion_echo_carries_prompt_and_prompt_logprobs() -> None:
    request = GenerationRequest(
        request_id="r",
        model="echo",
        kind="completion",
        prompt="say this",
        params=SamplingParams(echo=True, logprobs=True, max_tokens=1),
    )
    chunks = await _collect(_mock(), request)
    assert chunks[0].prompt_text == "say this"
    assert chunks[0].prompt_logprobs is not None
    assert chunks[0].prompt_logprobs[0].logprob is None  # nothing predicts the first token
    assert _text(chunks) == "say"


async def test_context_length_names_the_parameter() -> None:
    with pytest.raises(ContextLengthExceededError) as caught:
        await _collect(_mock(context_length=8), _chat("a b c", max_tokens=5))
    assert caught.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("kind", "error_type"),
    [("upstream_status", UpstreamStatusError), ("rate_limit", UpstreamRateLimitError)],
)
async def test_fails_before_the_first_token(kind: str, error_type: type[Exception]) -> None:
    mock = _mock(fail_before_first_token=kind)
    with pytest.raises(error_type) as caught:
        await _collect(mock, _chat("a b"))
    assert getattr(caught.value, "retryable", False)
    assert mock.num_failed == 1


async def test_fails_mid_stream_after_n_tokens() -> None:
    mock = _mock(fail_after_tokens=2)
    received: list[str] = []
    with pytest.raises(BackendError) as caught:
        async for chunk in mock.generate(_chat("a b c d")):
            received.append(chunk.text)
    assert "".join(received) == "a b"
    assert not caught.value.retryable


async def test_closing_the_stream_counts_as_aborted() -> None:
    mock = _mock(token_delay_s=0.01)
    stream = mock.generate(_chat("a b c d e f"))
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    assert (mock.num_aborted, mock.num_active) == (1, 0)


def test_unknown_option_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"backends\.m\.options\.token_dalay_s"):
        _mock(token_dalay_s=1)

"""The official ``openai`` client against a live infermux serving the real model via llama.cpp.

One gateway for the module (SmolLM2-135M-Instruct through the ``llamacpp`` backend) on a
free loopback port; every test is a call a user of the OpenAI SDK would make, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import openai
import pytest

from backends.base import BackendConfig
from gateway.testing import LiveGateway, gateway_config

pytestmark = pytest.mark.slow

MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gateway(
    live_gateway: Callable[..., AbstractContextManager[LiveGateway]],
) -> Iterator[LiveGateway]:
    # One thread: on a shared 2-core machine llama.cpp's spinning worker threads slow down
    # badly when another process holds a core.
    backend = BackendConfig(name="llamacpp", kind="llamacpp", options={"n_threads": 1})
    with live_gateway(gateway_config(backend, models={MODEL: ["llamacpp"]})) as running:
        yield running


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> openai.OpenAI:
    return gateway.openai_client()


def test_models_are_listed(client: openai.OpenAI) -> None:
    assert MODEL in [m.id for m in client.models.list().data]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_completion(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert response.model == MODEL
    assert response.usage is not None
    assert response.usage.completion_tokens <= 12
    assert (
        response.usage.total_tokens
        == response.usage.prompt_tokens + response.usage.completion_tokens
    )


def test_text_completion(client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert response.choices[0].text
    assert response.usage is not None and response.usage.completion_tokens <= 8


def test_streaming_with_usage_and_cached_tokens(client: openai.OpenAI) -> None:
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)  # warm the prefix
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(deltas) > 1  # token by token
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.completion_tokens == sum(1 for _ in deltas) or usage.completion_tokens >= len(
        deltas
    )
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt was just served


def test_chat_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=5, logprobs=True, top_logprobs=2, temperature=0
    )
    content = response.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == response.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
    assert "".join(e.token for e in content) == response.choices[0].message.content


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def ask(seed: int) -> str | None:
        response = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Invent a name for a cat."}],
            max_tokens=16,
            temperature=1.0,
            seed=seed,
        )
        return response.choices[0].message.content

    assert ask(7) == ask(7)
    assert ask(7) != ask(8)


def test_stop_strings_are_not_returned(client: openai.OpenAI) -> None:
    prompt = "Monday, Tuesday, Wednesday,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"model output too short to cut: {text!r}"
    cut = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_n_choices(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, n=2, seed=3, temperature=1.0
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert all(c.message.content for c in response.choices)
    assert response.usage is not None
    assert response.usage.completion_tokens <= 16


def test_completion_echo_with_prompt_logprobs(client: openai.OpenAI) -> None:
    prompt = "The cat sat on the"
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, echo=True, logprobs=1, temperature=0
    )
    choice = response.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert "".join(logprobs.tokens).startswith(prompt)
    assert logprobs.token_logprobs is not None
    assert logprobs.token_logprobs[0] is None  # nothing predicts the first prompt token
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])


def test_context_overflow_is_a_400_naming_the_parameter(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4000)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.param == "max_tokens"

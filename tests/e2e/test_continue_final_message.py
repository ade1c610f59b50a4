"""vLLM's ``continue_final_message`` on ``POST /v1/chat/completions``, live.

The default model on the core engine (greedy, float32 dense weights: a prefill computes the
logits a token-by-token decode does), on llama.cpp and on MLX, asked through the official
``openai`` client with a partial assistant answer as the last message: the reply is the rest
of the answer the model gives unbroken, and only the rest.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from backends.base import BackendConfig
from gateway.testing import LiveGateway, gateway_config

pytestmark = pytest.mark.slow

CORE = {"num_threads": 1, "kv_cache_memory_mb": 64, "dtype": "float32", "weight_format": "dense"}
CHAT = [{"role": "user", "content": "Say hello in French, with accents."}]
MAX_TOKENS = 20
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def gw(live_gateway: Any) -> Iterator[LiveGateway]:
    config = gateway_config(
        BackendConfig(name="core", kind="core_engine", options=CORE, worker_process=False),
        BackendConfig(name="llama", kind="llamacpp", options={"n_ctx": 512, "n_threads": 1}, worker_process=False),
        BackendConfig(name="mlx", kind="mlx", options={"n_ctx": 512}, worker_process=False),
        # A remote whose upstream is not said to speak vLLM's extension (never reached here).
        BackendConfig(name="plain", kind="openai", options={"base_url": "http://127.0.0.1:9/v1"}),
        models={"core": ["core"], "llama": ["llama"], "mlx": ["mlx"], "plain": ["plain"]},
    )
    with live_gateway(config) as gateway:
        yield gateway


def _stream(
    client: Any, messages: list[dict[str, str]], max_tokens: int, model: str = "core", **extra: Any
) -> tuple[list[str], str | None]:
    """The content deltas and the finish reason of a streamed greedy answer."""
    deltas: list[str] = []
    finish = None
    for event in client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=max_tokens, stream=True, **extra
    ):
        if event.choices:
            if event.choices[0].delta.content:
                deltas.append(event.choices[0].delta.content)
            finish = event.choices[0].finish_reason or finish
    return deltas, finish


@pytest.fixture(scope="module")
def unbroken(gw: LiveGateway) -> list[str]:
    deltas, finish = _stream(gw.openai_client(timeout=300.0), CHAT, MAX_TOKENS)
    assert finish == "length" and len(deltas) > 8
    return deltas


@pytest.mark.parametrize("model", ["llama", "mlx"])
@pytest.mark.parametrize("stream", [True, False])
def test_llamacpp_and_mlx_continue_a_partial_answer_to_their_unbroken_answer(
    gw: LiveGateway, model: str, stream: bool
) -> None:
    client = gw.openai_client(timeout=300.0)
    whole, finish = _stream(client, CHAT, MAX_TOKENS, model=model)
    assert finish == "length" and len(whole) > 8
    given = "".join(whole[:5])
    messages = [*CHAT, {"role": "assistant", "content": given}]
    rest = MAX_TOKENS - 5
    if stream:
        deltas, finish = _stream(client, messages, rest, model=model, extra_body=CONTINUE)
        text = "".join(deltas)
    else:
        reply = client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=rest, extra_body=CONTINUE
        )
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert text == "".join(whole[5:])
    assert finish == "length"


@pytest.mark.parametrize("num_given", [3, 8])
@pytest.mark.parametrize("stream", [True, False])
def test_a_partial_assistant_answer_is_continued_to_the_unbroken_answer(
    gw: LiveGateway, unbroken: list[str], num_given: int, stream: bool
) -> None:
    client = gw.openai_client(timeout=300.0)
    given = "".join(unbroken[:num_given])
    messages = [*CHAT, {"role": "assistant", "content": given}]
    rest = MAX_TOKENS - num_given
    if stream:
        deltas, finish = _stream(client, messages, rest, extra_body=CONTINUE)
        text = "".join(deltas)
    else:
        reply = client.chat.completions.create(
            model="core", messages=messages, temperature=0, max_tokens=rest, extra_body=CONTINUE
        )
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert reply.usage.completion_tokens == rest
    # Only the continuation comes back, and it is the rest of the unbroken answer.
    assert text == "".join(unbroken[num_given:])
    assert finish == "length"


def _refusal(client: Any, model: str = "core", messages: list[dict[str, str]] | None = None, **extra: Any) -> Any:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model,
            messages=messages or [*CHAT, {"role": "assistant", "content": "Bonjour"}],
            max_tokens=4,
            extra_body=extra,
        )
    return caught.value.body


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        # add_generation_prompt defaults to true: the pair is refused as vLLM refuses it.
        ({"continue_final_message": True}, "continue_final_message"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
    ],
)
def test_the_flags_are_refused_in_the_combinations_vllm_refuses(
    gw: LiveGateway, extra: dict[str, Any], param: str
) -> None:
    assert _refusal(gw.openai_client(), **extra)["param"] == param


@pytest.mark.parametrize(
    "last",
    [
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ]},
    ],
)
def test_continuing_needs_a_final_assistant_message_with_text(gw: LiveGateway, last: dict[str, Any]) -> None:
    body = _refusal(gw.openai_client(), messages=[*CHAT, last], **CONTINUE)
    assert body["param"] == "messages"


def test_a_backend_that_cannot_continue_refuses_naming_the_parameter(gw: LiveGateway) -> None:
    body = _refusal(gw.openai_client(), model="plain", **CONTINUE)
    assert body["param"] == "continue_final_message"
    assert "plain" in body["message"]


def test_continuing_with_a_constraint_on_the_output_is_refused(gw: LiveGateway) -> None:
    body = _refusal(gw.openai_client(), response_format={"type": "json_object"}, **CONTINUE)
    assert body["param"] == "continue_final_message"


def test_a_stop_string_in_the_given_text_does_not_end_the_continuation(
    gw: LiveGateway, unbroken: list[str]
) -> None:
    """As vLLM: stop strings are matched over the generated text only."""
    given = "".join(unbroken[:6])
    rest = "".join(unbroken[6:])
    assert given not in rest
    deltas, finish = _stream(
        gw.openai_client(timeout=300.0),
        [*CHAT, {"role": "assistant", "content": given}],
        MAX_TOKENS - 6,
        stop=[given],
        extra_body=CONTINUE,
    )
    assert "".join(deltas) == rest
    assert finish == "length"

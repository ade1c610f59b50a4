"""Which stop string ended an answer, as each API reports it: Anthropic's ``stop_reason:
"stop_sequence"`` with ``stop_sequence`` the match (body and ``message_delta``), and vLLM's
``stop_reason`` on chat and completion choices (body and the finishing stream chunk), with
the official clients, on the mock backend and on an ``openai`` remote that is that gateway
over loopback HTTP (its ``stop_reason`` read back into the chunk)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from backends.base import BackendConfig
from gateway.testing import LiveGateway, gateway_config, mock_backend

#: The mock echoes the last user turn word by word; the second stop string is the one found.
PROMPT = "alpha beta gamma delta"
STOPS = ["zeta", " gamma"]
MODELS = ("mock", "remote")


@pytest.fixture(scope="module")
def gw(live_gateway: Any) -> Iterator[LiveGateway]:
    with live_gateway(gateway_config(mock_backend("mock"), models={"mock": ["mock"]})) as upstream:
        remote = BackendConfig(
            name="remote", kind="openai", options={"base_url": upstream.openai_base_url, "model": "mock"}
        )
        config = gateway_config(mock_backend("mock"), remote, models={"mock": ["mock"], "remote": ["remote"]})
        with live_gateway(config) as gateway:
            yield gateway


def _anthropic(gw: LiveGateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(gw), api_key="unused", max_retries=0, timeout=30)


def _openai(gw: LiveGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.openai_base_url, api_key="unused", max_retries=0, timeout=30)


@pytest.mark.parametrize("model", MODELS)
def test_a_message_names_the_stop_sequence_that_ended_it(gw: LiveGateway, model: str) -> None:
    client = _anthropic(gw)
    messages: Any = [{"role": "user", "content": PROMPT}]
    message = client.messages.create(model=model, max_tokens=16, messages=messages, stop_sequences=STOPS)
    assert [block.model_dump() for block in message.content] == [
        {"type": "text", "text": "alpha beta", "citations": None}
    ]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", " gamma")

    with client.messages.stream(model=model, max_tokens=16, messages=messages, stop_sequences=STOPS) as stream:
        streamed = stream.get_final_message()  # stop_reason and stop_sequence from message_delta
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", " gamma")

    unmatched = client.messages.create(model=model, max_tokens=16, messages=messages, stop_sequences=["zeta"])
    assert (unmatched.stop_reason, unmatched.stop_sequence) == ("end_turn", None)


@pytest.mark.parametrize("model", MODELS)
def test_chat_and_completion_choices_carry_vllm_s_stop_reason(gw: LiveGateway, model: str) -> None:
    client = _openai(gw)
    messages: Any = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model=model, max_tokens=16, messages=messages, stop=STOPS)
    choice = chat.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("alpha beta", "stop")
    assert choice.model_dump()["stop_reason"] == " gamma"

    stream = client.chat.completions.create(model=model, max_tokens=16, messages=messages, stop=STOPS, stream=True)
    finishing = [c.choices[0].model_dump() for c in stream if c.choices and c.choices[0].finish_reason]
    assert [(c["finish_reason"], c["stop_reason"]) for c in finishing] == [("stop", " gamma")]

    completion = client.completions.create(model=model, max_tokens=16, prompt=PROMPT, stop=STOPS)
    assert completion.choices[0].text == "alpha beta"
    assert completion.choices[0].model_dump()["stop_reason"] == " gamma"

    # No stop string matched: null, as vLLM says it.
    unmatched = client.chat.completions.create(model=model, max_tokens=16, messages=messages, stop=["zeta"])
    assert unmatched.choices[0].model_dump()["stop_reason"] is None

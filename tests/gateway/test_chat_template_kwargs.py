"""``chat_template_kwargs`` over HTTP: accepted on chat completions, checked, and rendered.

The backend here is the mock with its answer replaced by the prompt a native backend would
prefill: :func:`backends.chat_plan.plan_chat` rendering the request through Qwen3's real
template (llama.cpp's corpus), the path core_engine, llamacpp and mlx serve chat by. Qwen3's
template closes an empty thinking block when ``enable_thinking`` is false.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from backends.base import GenerationChunk, GenerationRequest, Usage
from backends.chat_plan import load_chat, plan_chat
from backends.mock import MockBackend
from gateway.openai.request_conversion import RESERVED_TEMPLATE_KWARGS
from gateway.testing import LiveGateway, gateway_config, mock_backend
from tests.real_artifacts import templates_dir

MESSAGES = [{"role": "user", "content": "Hello"}]
EMPTY_THINKING = "<think>\n\n</think>\n\n"


class PromptBackend(MockBackend):
    """Answers with the chat prompt it would generate from (rendered as native backends do)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        source = (templates_dir() / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
        self.template, self.chat_format = load_chat(None, source, eos_token="<|im_end|>")

    async def _produce(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        plan = plan_chat(request, self.template, self.chat_format)
        yield GenerationChunk(
            text=plan.text, finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1)
        )


@pytest.fixture(scope="module")
def gw(live_gateway: Any) -> Iterator[LiveGateway]:
    config = gateway_config(mock_backend("prompt"))
    with live_gateway(config, backends={"prompt": PromptBackend(config.backends[0])}) as gateway:
        yield gateway


def _chat(gw: LiveGateway, **fields: Any) -> httpx.Response:
    body = {"model": "echo", "messages": MESSAGES, **fields}
    return httpx.post(f"{gw}/v1/chat/completions", json=body, timeout=30)


def _prompt(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def test_enable_thinking_false_reaches_the_template(gw: LiveGateway) -> None:
    default = _prompt(_chat(gw))
    off = _prompt(_chat(gw, chat_template_kwargs={"enable_thinking": False}))
    on = _prompt(_chat(gw, chat_template_kwargs={"enable_thinking": True}))
    assert default.endswith("<|im_start|>assistant\n") and EMPTY_THINKING not in default
    assert on == default
    assert off == default + EMPTY_THINKING


def test_an_empty_object_and_unused_variables_change_nothing(gw: LiveGateway) -> None:
    default = _prompt(_chat(gw))
    assert _prompt(_chat(gw, chat_template_kwargs={})) == default
    assert _prompt(_chat(gw, chat_template_kwargs={"unused": [1, {"a": None}]})) == default


@pytest.mark.parametrize("value", ["enable_thinking", ["enable_thinking"], 1, True])
def test_a_value_that_is_not_an_object_is_a_400_naming_it(gw: LiveGateway, value: Any) -> None:
    response = _chat(gw, chat_template_kwargs=value)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("key", sorted(RESERVED_TEMPLATE_KWARGS))
def test_variables_the_server_sets_are_refused(gw: LiveGateway, key: str) -> None:
    response = _chat(gw, chat_template_kwargs={key: "x"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and repr(key) in error["message"]


def test_request_supplied_templates_are_still_refused(gw: LiveGateway) -> None:
    response = _chat(gw, chat_template="{{ messages }}", chat_template_kwargs={"enable_thinking": False})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template"

"""Reasoning output and the thinking budget on the real default model, through the gateway.

SmolLM2 is no reasoning model, so the backends are given (option ``chat.template``) a ChatML
template whose generation prompt opens a ``<think>`` block, as DeepSeek-R1 distills' and
Qwen3's do: the model's text is then thinking until ``</think>``. It rarely closes the block
on its own, so without a budget the whole answer is reasoning (it ends with the end of turn); with ``max_reasoning_tokens``
(or ``reasoning_effort``, through ``[reasoning] effort_budgets``) the engine forces
``</think>`` when the budget is spent and the answer follows as ``content``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.base import BackendConfig
from gateway.config.types import ReasoningConfig
from gateway.testing import LiveGateway, gateway_config

pytestmark = pytest.mark.slow

BACKENDS = ("core", "llamacpp")
THINKING_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "How many legs does a spider have?"}]
#: Spent, the model answers after the forced </think> (with 6 or 8 it ends its turn there).
BUDGET = 10
#: "</think>" in SmolLM2's vocabulary, forced after the budget (counted as reasoning).
MAX_MARKER_TOKENS = 6


@pytest.fixture(scope="module")
def gw(live_gateway: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    template = tmp_path_factory.mktemp("templates") / "thinking-chatml.jinja"
    template.write_text(THINKING_CHATML, encoding="utf-8")
    chat = {"template": str(template)}
    config = gateway_config(
        # float32 on every CPU: in bf16 (AMX) the model ended its turn right after the forced
        # </think>, leaving no answer to check.
        BackendConfig(
            name="core", kind="core_engine",
            options={"kv_cache_memory_mb": 64, "chat": chat, "dtype": "float32"},
        ),
        BackendConfig(name="llamacpp", kind="llamacpp", options={"n_ctx": 1024, "parallel": 2, "chat": chat}),
        models={name: [name] for name in BACKENDS},
    )
    config = type(config)(**{**{f: getattr(config, f) for f in config.__struct_fields__},
                            "reasoning": ReasoningConfig(effort_budgets={"low": BUDGET, "high": 64})})
    with live_gateway(config) as gateway:
        yield gateway


@pytest.mark.parametrize("model", BACKENDS)
def test_without_a_budget_the_output_is_all_reasoning(gw: LiveGateway, model: str) -> None:
    client = gw.openai_client(timeout=120)
    completion = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, temperature=0)
    message = completion.choices[0].message
    usage = completion.usage
    assert message.reasoning_content  # type: ignore[attr-defined]
    assert "<think>" not in message.reasoning_content and "</think>" not in (message.content or "")  # type: ignore[attr-defined]
    assert not message.content  # it never closed the block: no answer
    assert usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens


@pytest.mark.parametrize("model", BACKENDS)
def test_a_spent_budget_forces_the_end_of_thinking_and_the_answer_follows(gw: LiveGateway, model: str) -> None:
    client = gw.openai_client(timeout=120)
    completion = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=60, temperature=0, extra_body={"max_reasoning_tokens": BUDGET},
    )
    message = completion.choices[0].message
    details = completion.usage.completion_tokens_details
    assert message.reasoning_content  # type: ignore[attr-defined]
    assert message.content and "</think>" not in message.content
    assert BUDGET <= details.reasoning_tokens <= BUDGET + MAX_MARKER_TOKENS
    assert completion.usage.completion_tokens > details.reasoning_tokens
    # reasoning_effort maps to [reasoning] effort_budgets (low = BUDGET here): the same answer.
    low = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=60, temperature=0, reasoning_effort="low",
    )
    assert low.choices[0].message.content == message.content
    assert low.usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


@pytest.mark.parametrize("model", BACKENDS)
def test_streamed_reasoning_and_content_deltas_join_to_the_whole_answer(gw: LiveGateway, model: str) -> None:
    client = gw.openai_client(timeout=120)
    request: dict[str, Any] = {
        "model": model, "messages": MESSAGES, "max_tokens": 60, "temperature": 0,
        "extra_body": {"max_reasoning_tokens": BUDGET},
    }
    whole = client.chat.completions.create(**request).choices[0].message
    reasoning, content = [], []
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    assert "".join(reasoning) == whole.reasoning_content  # type: ignore[attr-defined]
    assert "".join(content) == whole.content
    assert len([r for r in reasoning if r]) > 1  # it streamed


def test_a_template_file_that_cannot_be_read_stops_the_backend_with_its_name(tmp_path: Path) -> None:
    from backends.chat_plan import ChatOptions, load_chat
    from core_engine.chat.template import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="chat.template"):
        load_chat(ChatOptions(template=str(tmp_path / "missing.jinja")), None)

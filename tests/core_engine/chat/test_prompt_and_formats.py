"""Formats read from templates, tools rendered natively or through the fallback prompt, the
tool-call grammar, and the thinking budget's byte-level marker tracking."""

from __future__ import annotations

import json

import llguidance
import pytest

from core_engine.chat.budget import ThinkingBudget, ThinkingParams
from core_engine.chat.formats import ChatFormat, detect_chat_format
from core_engine.chat.prompt import render_chat, tool_call_format
from core_engine.chat.template import FALLBACK_CHATML_TEMPLATE, ChatTemplate
from core_engine.chat.tool_grammar import tool_call_grammar

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# A Qwen-2.5-like template: renders `tools` and tool turns itself.
NATIVE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% elif m.tool_calls is defined %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
]


def test_formats_are_read_from_the_template() -> None:
    assert detect_chat_format(NATIVE) == ChatFormat(tool_calls="hermes", native_tools=True)
    assert detect_chat_format(FALLBACK_CHATML_TEMPLATE) == ChatFormat()
    assert detect_chat_format("{{ '[TOOL_CALLS]' }}{% if tools %}{% endif %}").tool_calls == "mistral"
    assert detect_chat_format("{{ '<|python_tag|>' }}").tool_calls == "llama3_json"
    assert detect_chat_format("{{ '<think>' }}").reasoning == "think"
    assert detect_chat_format("{{ '<think>' }}", reasoning="none").reasoning is None
    with pytest.raises(ValueError, match="unknown tool-call format"):
        detect_chat_format(None, tool_calls="xml")


def test_a_template_that_knows_tools_renders_them_itself() -> None:
    text = render_chat(ChatTemplate(NATIVE), detect_chat_format(NATIVE), CONVERSATION, tools=[TOOL]).text
    assert '"name": "get_weather"' in text and "<tool_response>-3 C</tool_response>" in text
    # Arguments reach the template decoded (Hugging Face's convention), so tojson writes an object.
    assert '"arguments": {"city": "Oslo"}' in text


def test_a_template_without_tools_gets_the_fallback_prompt() -> None:
    fmt = detect_chat_format(FALLBACK_CHATML_TEMPLATE)
    text = render_chat(ChatTemplate(FALLBACK_CHATML_TEMPLATE), fmt, CONVERSATION, tools=[TOOL]).text
    assert text.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(TOOL) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n-3 C\n</tool_response><|im_end|>" in text
    assert tool_call_format(fmt) == "hermes"


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_tool_call_grammar_compiles_in_llguidance(fmt: str, parallel: bool) -> None:
    grammar = llguidance.LLMatcher.grammar_from_lark(tool_call_grammar(fmt, [TOOL, TOOL], parallel=parallel))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


def _budget(budget: int, *, open_at_start: bool) -> ThinkingBudget:
    # A byte-level toy vocabulary: token t is the t-th piece.
    pieces = [b"<th", b"ink>", b"a", b"b", b"</", b"think", b">", b"!"]
    return ThinkingBudget(
        ThinkingParams(start="<think>", end="</think>", budget=budget, open_at_start=open_at_start),
        end_token_ids=[4, 5, 6],
        token_bytes=lambda t: pieces[t],
    )


def test_a_spent_budget_forces_the_end_marker_then_lets_the_answer_go() -> None:
    state = _budget(3, open_at_start=False)
    produced = []
    for sampled in [0, 1, 2, 3, 2, 3, 3, 7, 7]:  # the model would think on and on
        forced = state.forced_token()
        token = forced if forced is not None else sampled
        state.observe(token)
        produced.append(token)
    assert produced == [0, 1, 2, 3, 4, 5, 6, 7, 7]  # "<think>ab" then "</think>" forced
    assert state.is_done and state.forced_token() is None


def test_a_model_that_closes_its_block_in_budget_is_never_forced() -> None:
    state = _budget(10, open_at_start=True)
    for token in [2, 4, 5, 6, 3, 3]:
        assert state.forced_token() is None
        state.observe(token)
    assert state.is_done and state.num_reasoning_tokens == 4


def test_an_answer_without_a_thinking_block_is_left_alone() -> None:
    state = _budget(0, open_at_start=False)
    for token in [7, 2, 3]:
        assert state.forced_token() is None
        state.observe(token)
    assert state.is_done

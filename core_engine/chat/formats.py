"""Which tool-call and reasoning formats a chat template speaks, read from its source.

A model's chat template says how it was trained to call tools and to think: Hermes/Qwen
templates wrap calls in ``<tool_call>`` tags, Llama 3.1+ templates answer a bare JSON object
(``<|python_tag|>`` for its built-in tools), Mistral templates emit ``[TOOL_CALLS]``; reasoning
models put their thinking between markers (``<think>``, ``[THINK]``, ``<seed:think>``). The
parsers of :mod:`core_engine.chat.tool_calls` and :mod:`core_engine.chat.reasoning` are chosen
from it, as vLLM's ``--tool-call-parser`` / ``--reasoning-parser`` are chosen by hand.

A template that does not render ``tools`` itself gets the documented fallback prompt of
:mod:`core_engine.chat.prompt` (Hermes format), so every model can be asked to call tools.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["REASONING_MARKERS", "TOOL_CALL_FORMATS", "ChatFormat", "detect_chat_format"]

ToolCallFormat = Literal["hermes", "llama3_json", "mistral"]
TOOL_CALL_FORMATS: tuple[str, ...] = ("hermes", "llama3_json", "mistral")

#: Reasoning format -> (start marker, end marker).
REASONING_MARKERS: dict[str, tuple[str, str]] = {
    "think": ("<think>", "</think>"),
    "mistral_think": ("[THINK]", "[/THINK]"),
    "seed_think": ("<seed:think>", "</seed:think>"),
}

# A template renders tools itself when it reads the `tools` variable (Jinja expressions).
_USES_TOOLS = re.compile(r"\{[{%][^}]*\btools\b")


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """How one template's model calls tools and thinks."""

    #: The tool-call syntax the model emits (and the grammar that forces it).
    tool_calls: ToolCallFormat = "hermes"
    #: The template renders ``tools=`` and tool messages itself; False: the fallback prompt.
    native_tools: bool = False
    #: A key of :data:`REASONING_MARKERS`, or None for a model that does not think aloud.
    reasoning: str | None = None

    @property
    def reasoning_markers(self) -> tuple[str, str] | None:
        return None if self.reasoning is None else REASONING_MARKERS[self.reasoning]


def detect_chat_format(
    template_source: str | None, *, tool_calls: str | None = None, reasoning: str | None = None
) -> ChatFormat:
    """The format of ``template_source``; ``tool_calls`` / ``reasoning`` override the guess
    (backend options, for templates that do not show it; ``"none"`` turns reasoning off)."""
    source = template_source or ""
    if tool_calls is None:
        if "[TOOL_CALLS]" in source:
            tool_calls = "mistral"
        elif "<tool_call>" in source:
            tool_calls = "hermes"
        elif "<|python_tag|>" in source or "ipython" in source:
            tool_calls = "llama3_json"
        else:
            tool_calls = "hermes"
    elif tool_calls not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool-call format {tool_calls!r} (one of {', '.join(TOOL_CALL_FORMATS)})")
    if reasoning is None:
        if "<seed:think>" in source:
            reasoning = "seed_think"
        elif "[THINK]" in source:
            reasoning = "mistral_think"
        elif "<think>" in source or "</think>" in source:
            reasoning = "think"
    elif reasoning == "none":
        reasoning = None
    elif reasoning not in REASONING_MARKERS:
        raise ValueError(f"unknown reasoning format {reasoning!r} (one of none, {', '.join(REASONING_MARKERS)})")
    return ChatFormat(
        tool_calls=tool_calls,  # type: ignore[arg-type]
        native_tools=bool(_USES_TOOLS.search(source)),
        reasoning=reasoning,
    )

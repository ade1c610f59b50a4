"""Which tool-call and reasoning formats a chat template speaks, read from its source.

A model's chat template says how it was trained to call tools and to think: Hermes/Qwen
templates wrap calls in ``<tool_call>`` tags, Llama 3.1+ templates answer a bare JSON object
(``<|python_tag|>`` for its built-in tools), Mistral templates emit ``[TOOL_CALLS]``, and so on
for DeepSeek, gpt-oss (harmony), Kimi K2, GLM, Qwen3-Coder, MiniMax, Command R, functionary
(:data:`TOOL_CALL_FORMATS`, :mod:`core_engine.chat.tool_calls` describes each); reasoning
models put their thinking between markers (``<think>``, ``[THINK]``, ``<seed:think>``,
``<|START_THINKING|>``, harmony's analysis channel). The
parsers of :mod:`core_engine.chat.tool_calls` and :mod:`core_engine.chat.reasoning` are chosen
from it, as vLLM's ``--tool-call-parser`` / ``--reasoning-parser`` are chosen by hand.

A template that does not render ``tools`` itself gets the documented fallback prompt of
:mod:`core_engine.chat.prompt` (Hermes format), so every model can be asked to call tools.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["REASONING_MARKERS", "SPECIAL_MARKERS", "TOOL_CALL_FORMATS", "ChatFormat", "detect_chat_format"]

ToolCallFormat = Literal[
    "hermes", "llama3_json", "mistral", "deepseek", "kimi_k2", "solar", "functionary_v3_1", "functionary_v3_2",
    "glm", "hunyuan", "qwen_xml", "minimax_xml", "dsml", "json_list", "command_r", "harmony",
    "gigachat", "minicpm", "pythonic", "gemma4", "kimi_k3", "muse", "minimax_m3",
]
TOOL_CALL_FORMATS: tuple[str, ...] = (
    "hermes", "llama3_json", "mistral", "deepseek", "kimi_k2", "solar", "functionary_v3_1", "functionary_v3_2",
    "glm", "hunyuan", "qwen_xml", "minimax_xml", "dsml", "json_list", "command_r", "harmony",
    "gigachat", "minicpm", "pythonic", "gemma4", "kimi_k3", "muse", "minimax_m3",
)

#: (tool-call format, markers of which one in the template's source shows it), first match
#: wins: the more specific syntaxes come before the ``<tool_call>`` they also contain.
_TOOL_CALL_SIGNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mistral", ("[TOOL_CALLS]",)),
    ("dsml", ("<｜DSML｜", "dsml_token")),
    ("muse", ("<atem:function_calls>",)),
    ("minimax_m3", ("]<]minimax[>[",)),
    ("minimax_xml", ("<minimax:tool_call>",)),
    ("harmony", ("<|call|>",)),
    ("deepseek", ("tool▁calls▁begin",)),
    ("gemma4", ("<|tool_call>call:",)),
    ("kimi_k3", ("'<|open|>'",)),
    ("pythonic", ("<|tool_call_start|>",)),
    ("minicpm", ("<param name=",)),
    ("gigachat", ("<|function_call|>", "'function call'")),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("solar", ("<|tool_call:begin|>",)),
    ("hunyuan", ("<tool_call:opensource>", "<tool_call{}>")),
    ("glm", ("<arg_key>",)),
    ("qwen_xml", ("<parameter=",)),
    ("json_list", ("<tool_calls>[",)),  # Apriel, whose prompt also names <tool_call>
    ("hermes", ("<tool_call>",)),
    ("functionary_v3_2", (">>>all",)),
    ("functionary_v3_1", ("<function=",)),
    ("command_r", ("<|START_ACTION|>", "Action: ```json")),
    ("json_list", ("<TOOLCALL>", "<tool_calls>", "<|tool_call|>", "<|tools_prefix|>")),
    ("llama3_json", ("<|python_tag|>", "ipython")),
)

#: Reasoning format -> (start marker, end marker).
REASONING_MARKERS: dict[str, tuple[str, str]] = {
    "think": ("<think>", "</think>"),
    "mistral_think": ("[THINK]", "[/THINK]"),
    "seed_think": ("<seed:think>", "</seed:think>"),
    # Apriel 1.5/1.6: the generation prompt opens the thinking with its own sentence.
    "apriel": ("Here are my reasoning steps:\n", "[BEGIN FINAL RESPONSE]"),
    "hunyuan_think": ("<think:opensource>", "</think:opensource>"),
    "command_r": ("<|START_THINKING|>", "<|END_THINKING|>"),
    "gemma4": ("<|channel>thought\n", "<channel|>"),
    "kimi_k3": ("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
    "muse": ("to=self<|message|>", "<|eom|>"),
    "mm_think": ("<mm:think>", "</mm:think>"),
    # gpt-oss: the analysis channel's message (the harmony tool parser reads the rest).
    "harmony": ("<|channel|>analysis<|message|>", "<|end|>"),
}

#: Marker texts the parsers read that vocabularies often make *special* tokens (hidden from
#: output text by ``skip_special_tokens``): the detokenizers of the core engine, llama.cpp and
#: MLX keep a special token whose text is one of these, unless it ends generation (a stop
#: token: the text would leak; parsers accept a call or message whose end marker is missing).
SPECIAL_MARKERS: frozenset[str] = frozenset({
    "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]", "<|python_tag|>",
    "<tool_call>", "</tool_call>", "<think>", "</think>", "<seed:think>", "</seed:think>",
    "<seed:tool_call>", "</seed:tool_call>", "<TOOLCALL>", "</TOOLCALL>", "<tool_calls>", "</tool_calls>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<minimax:tool_call>", "</minimax:tool_call>",
    "<|channel|>", "<|message|>", "<|start|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "<|tool_calls|>", "<|tool_call:begin|>", "<|tool_call:name|>", "<|tool_call:args|>", "<|tool_call:end|>",
    "<|tool_call|>", "<|tools_prefix|>", "<|tools_suffix|>",
    "<|START_ACTION|>", "<|END_ACTION|>", "<|START_THINKING|>", "<|END_THINKING|>",
    "<think:opensource>", "</think:opensource>", "<tool_calls:opensource>", "</tool_calls:opensource>",
    "<tool_call:opensource>", "</tool_call:opensource>", "<tool_sep:opensource>",
    "<arg_key:opensource>", "</arg_key:opensource>", "<arg_value:opensource>", "</arg_value:opensource>",
    "<|tool_call_start|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>",
    "<|function_call|>", "<|open|>", "<|close|>", "<|sep|>", "<|eom|>",
})

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
        tool_calls = next(
            (name for name, signs in _TOOL_CALL_SIGNS if any(sign in source for sign in signs)), "hermes"
        )
    elif tool_calls not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool-call format {tool_calls!r} (one of {', '.join(TOOL_CALL_FORMATS)})")
    if reasoning is None:
        if "<|channel|>analysis" in source:
            reasoning = "harmony"
        elif "<|channel>thought" in source:
            reasoning = "gemma4"
        elif "<mm:think>" in source:
            reasoning = "mm_think"
        elif "assistant to=self<|message|>" in source:
            reasoning = "muse"
        elif "'<|open|>'" in source and "open_tag('think')" in source:
            reasoning = "kimi_k3"
        elif "[BEGIN FINAL RESPONSE]" in source:
            reasoning = "apriel"
        elif "<|START_THINKING|>" in source:
            reasoning = "command_r"
        elif "<think:opensource>" in source or "<think{}>" in source:
            reasoning = "hunyuan_think"
        elif "<seed:think>" in source:
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

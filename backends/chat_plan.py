"""One chat request made ready for a native backend: prompt, constraint, budget, parsers.

The core engine, llama.cpp and MLX backends all serve chat the same way, from here:

1. the messages and the offered tools are rendered through the model's template
   (:func:`core_engine.chat.prompt.render_chat`; ``tool_choice = "none"`` offers none), with
   the request's ``chat_template_kwargs`` as extra template variables; control-token texts
   written in any of them stay text (:mod:`core_engine.chat.content_text`);
2. ``tool_choice = "required"`` or a named function becomes a grammar constraint
   (:func:`core_engine.chat.tool_grammar.tool_call_grammar`, errors naming ``tool_choice``);
3. a reasoning template with a budget gets :class:`~core_engine.chat.budget.ThinkingParams`
   for the engine to enforce;
4. the output stream is split into reasoning, content and tool-call deltas
   (:meth:`ChatPlan.parse`); ``finish_reason`` becomes ``tool_calls`` when the model called
   tools, and usage counts the reasoning tokens.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from backends.base import ChatMessage, GenerationChunk, GenerationRequest, ToolCallDelta
from backends.errors import InvalidRequestError
from core_engine.chat.budget import ThinkingParams
from core_engine.chat.content_text import ControlTexts
from core_engine.chat.formats import ChatFormat, detect_chat_format
from core_engine.chat.prompt import render_chat, tool_call_format
from core_engine.chat.reasoning import ReasoningParser
from core_engine.chat.template import FALLBACK_CHATML_TEMPLATE, ChatTemplate, ChatTemplateError
from core_engine.chat.tool_calls import make_tool_call_parser
from core_engine.chat.tool_grammar import tool_call_grammar

__all__ = ["ChatOptions", "ChatPlan", "load_chat", "message_dicts", "pinned_prefixes", "plan_chat"]


class ChatOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[backends.options.chat]`` of the native kinds: how the model's chat is formatted."""

    #: A Jinja chat template file used instead of the model's own (vLLM's ``--chat-template``).
    template: str | None = None
    #: The tool-call format (``hermes``, ``llama3_json``, ``mistral``); None: from the template.
    tool_call_format: str | None = None
    #: The reasoning format (``think``, ``mistral_think``, ``seed_think``, ``none``); None:
    #: from the template.
    reasoning_format: str | None = None


def load_chat(
    options: ChatOptions | None,
    model_template: str | None,
    *,
    bos_token: str = "",
    eos_token: str = "",
    control_texts: ControlTexts | None = None,
) -> tuple[ChatTemplate, ChatFormat]:
    """The template (``options.template``, else the model's, else ChatML) and its format;
    ``ChatTemplateError`` for an unreadable file, a template that does not compile or an
    unknown format name. ``control_texts``: the vocabulary's, kept as text in content
    (:mod:`core_engine.chat.content_text`)."""
    options = options or ChatOptions()
    source = model_template
    if options.template is not None:
        try:
            source = Path(options.template).read_text(encoding="utf-8")
        except OSError as exc:
            raise ChatTemplateError(f"chat.template: cannot read {options.template}: {exc}") from exc
    source = source or FALLBACK_CHATML_TEMPLATE
    template = ChatTemplate(source, bos_token=bos_token, eos_token=eos_token, control_texts=control_texts)
    try:
        fmt = detect_chat_format(source, tool_calls=options.tool_call_format, reasoning=options.reasoning_format)
    except ValueError as exc:
        raise ChatTemplateError(f"chat: {exc}") from exc
    return template, fmt


def message_dicts(messages: tuple[ChatMessage, ...] | None) -> list[dict[str, Any]]:
    """The OpenAI-shaped dicts templates are rendered from."""
    out = []
    for m in messages or ():
        item: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name is not None:
            item["name"] = m.name
        if m.tool_calls:
            item["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out


@dataclass(frozen=True, slots=True)
class ChatPlan:
    #: The rendered prompt, the control-token texts of the request's content marked: tokenize
    #: it with the template's ``control_texts.encode`` (:mod:`core_engine.chat.content_text`).
    text: str
    #: The constraint to enforce: the request's own, or the tool-call grammar.
    structured_outputs: dict[str, Any] | None
    thinking: ThinkingParams | None
    #: The tool-call format to parse, None when no tools are offered.
    tool_format: str | None
    reasoning_markers: tuple[str, str] | None
    reasoning_open: bool
    #: ``parallel_tool_calls = false``: calls after the first are dropped (``auto`` has no
    #: grammar to stop a model that makes two), as OpenAI gives at most one.
    max_tool_calls: int | None = None

    async def parse(self, chunks: AsyncIterator[GenerationChunk]) -> AsyncGenerator[GenerationChunk, None]:
        """``chunks`` with their text split into reasoning, content and tool calls; closing
        this iterator closes ``chunks`` (which aborts the backend's work)."""
        try:
            async for chunk in self._parsed(chunks):
                yield chunk
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _parsed(self, chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[GenerationChunk]:
        if self.tool_format is None and self.reasoning_markers is None:
            async for chunk in chunks:
                yield chunk
            return
        reasoning = (
            ReasoningParser(*self.reasoning_markers, open_at_start=self.reasoning_open)
            if self.reasoning_markers is not None else None
        )
        tools = make_tool_call_parser(self.tool_format) if self.tool_format is not None else None
        num_reasoning = 0
        async for chunk in chunks:
            final = chunk.finish_reason is not None
            was_in = reasoning is not None and reasoning.in_reasoning
            thought, content = reasoning.feed(chunk.text) if reasoning is not None else ("", chunk.text)
            if final and reasoning is not None:
                more_thought, more_content = reasoning.finish()
                thought, content = thought + more_thought, content + more_content
            if reasoning is not None and (was_in or thought or reasoning.in_reasoning):
                num_reasoning += len(chunk.token_ids) or chunk.token_count or (1 if chunk.text else 0)
            calls: tuple[ToolCallDelta, ...] = ()
            if tools is not None:
                parsed = tools.feed(content)
                if final:
                    parsed.extend(tools.finish())
                content = parsed.content
                calls = tuple(
                    ToolCallDelta(index=d.index, id=d.id, name=d.name, arguments=d.arguments)
                    for d in parsed.tool_calls
                    if self.max_tool_calls is None or d.index < self.max_tool_calls
                )
            changes: dict[str, Any] = {"text": content, "reasoning": thought, "tool_calls": calls}
            if final:
                if tools is not None and tools.num_calls and chunk.finish_reason == "stop":
                    changes["finish_reason"] = "tool_calls"
                if reasoning is not None and chunk.usage is not None:
                    changes["usage"] = msgspec.structs.replace(chunk.usage, reasoning_tokens=num_reasoning)
            yield msgspec.structs.replace(chunk, **changes)


#: Tool-call formats whose parser must read every answer, not only those with tools offered.
_ALWAYS_PARSED_FORMATS = frozenset({"harmony"})


def plan_chat(request: GenerationRequest, template: ChatTemplate, fmt: ChatFormat) -> ChatPlan:
    """Render and plan ``request`` (a chat) for a backend whose template is ``template``."""
    offered = list(request.tools) if request.tools and request.tool_choice != "none" else None
    try:
        rendered = render_chat(
            template,
            fmt,
            message_dicts(request.messages),
            tools=offered,
            add_generation_prompt=request.add_generation_prompt,
            template_kwargs=request.chat_template_kwargs,
        )
    except ChatTemplateError as exc:
        raise InvalidRequestError(str(exc), param="messages") from exc
    structured = request.structured_outputs
    tool_format = tool_call_format(fmt) if offered else None
    if tool_format is None and fmt.tool_calls in _ALWAYS_PARSED_FORMATS:
        # Every answer of such a model is framed by markers (gpt-oss's harmony channels):
        # its parser turns the final channel into content, tools offered or not.
        tool_format = fmt.tool_calls
    if offered and request.tool_choice in ("required", "function"):
        forced = offered
        if request.tool_choice == "function":
            forced = [t for t in offered if t["function"]["name"] == request.tool_function]
        assert tool_format is not None
        try:
            grammar = tool_call_grammar(tool_format, forced, parallel=request.parallel_tool_calls)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequestError(f"the tools cannot be made into a grammar: {exc}", param="tools") from exc
        structured = {"grammar": grammar, "param": "tool_choice"}
    markers = fmt.reasoning_markers
    thinking = None
    if markers is not None and request.reasoning_budget is not None:
        thinking = ThinkingParams(
            start=markers[0], end=markers[1], budget=request.reasoning_budget, open_at_start=rendered.reasoning_open
        )
    return ChatPlan(
        text=rendered.text,
        structured_outputs=structured,
        thinking=thinking,
        tool_format=tool_format,
        reasoning_markers=markers,
        reasoning_open=rendered.reasoning_open,
        max_tool_calls=1 if offered and request.parallel_tool_calls is False else None,
    )


def pinned_prefixes(request: GenerationRequest, template: ChatTemplate, fmt: ChatFormat) -> list[tuple[str, float]]:
    """The text of each prefix ``request.prefix_pins`` names, with its TTL."""
    offered = list(request.tools) if request.tools and request.tool_choice != "none" else None
    messages = message_dicts(request.messages)
    out = []
    for pin in request.prefix_pins:
        try:
            rendered = render_chat(
                template,
                fmt,
                messages[: pin.num_messages],
                tools=offered,
                add_generation_prompt=False,
                template_kwargs=request.chat_template_kwargs,
            )
        except ChatTemplateError:
            continue  # a template that cannot end on this message: nothing to pin
        out.append((rendered.text, pin.ttl_s))
    return out

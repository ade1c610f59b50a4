"""A conversation with tools rendered into the prompt text, through the model's template.

Messages are OpenAI-shaped dicts: ``role``, ``content``, and ``tool_calls`` (assistant: a
list of ``{"id", "type": "function", "function": {"name", "arguments"}}`` with ``arguments``
as JSON text) or ``tool_call_id`` (role ``tool``).

- A template that renders tools itself (:attr:`ChatFormat.native_tools`) gets ``tools=`` and
  the messages as Hugging Face templates expect them (``arguments`` decoded into an object).
- Any other template gets the **fallback tool prompt**: the tool list and the Hermes call
  syntax appended to the system message (one is added when there is none), earlier calls
  written into the assistant turns as ``<tool_call>`` blocks, and tool results passed as a
  user turn of ``<tool_response>`` blocks, so every model can be asked to call tools; the
  output is then parsed in the Hermes format.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core_engine.chat.formats import ChatFormat
from core_engine.chat.template import ChatTemplate, ChatTemplateError

__all__ = ["FALLBACK_TOOL_INSTRUCTIONS", "RenderedChat", "render_chat", "tool_call_format"]

FALLBACK_TOOL_INSTRUCTIONS = (
    "# Tools\n\n"
    "You can call functions to help answer. Their signatures, as JSON, are listed between "
    "<tools> and </tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with one JSON object per call, each between <tool_call> and "
    "</tool_call>:\n<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON "
    "object>}}\n</tool_call>"
)


@dataclass(frozen=True, slots=True)
class RenderedChat:
    #: The prompt, content's control-token texts marked (see :func:`render_chat`).
    text: str
    #: The prompt ends inside an opened thinking block: the output starts with reasoning.
    reasoning_open: bool = False


def tool_call_format(fmt: ChatFormat) -> str:
    """The format calls come back in: the template's own, or Hermes for the fallback prompt."""
    return fmt.tool_calls if fmt.native_tools else "hermes"


def _decoded_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _native(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        item = dict(message)
        if item.get("tool_calls"):
            item["tool_calls"] = [
                {
                    "id": call.get("id"),
                    "type": "function",
                    "function": {
                        "name": call["function"]["name"],
                        "arguments": _decoded_arguments(call["function"].get("arguments")),
                    },
                }
                for call in item["tool_calls"]
            ]
        out.append(item)
    return out


def _call_block(call: Mapping[str, Any]) -> str:
    function = call["function"]
    body = {"name": function["name"], "arguments": _decoded_arguments(function.get("arguments") or "{}")}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>"


def _fallback(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = "<tool_response>\n" + content + "\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        item = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        item["content"] = content
        if role == "assistant" and message.get("tool_calls"):
            blocks = "\n".join(_call_block(call) for call in message["tool_calls"])
            item["content"] = (content + "\n" if content else "") + blocks
        out.append(item)
    for item in out:
        item.pop("_tool_results", None)
    if tools:
        instructions = FALLBACK_TOOL_INSTRUCTIONS.format(
            tools="\n".join(json.dumps(dict(tool), ensure_ascii=False) for tool in tools)
        )
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + instructions
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def _system_into_first_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the leading system message's text put before the first user turn's."""
    system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
    for item in rest:
        if item["role"] == "user":
            item["content"] = system + "\n\n" + (item.get("content") or "")
            return rest
    return [{"role": "user", "content": system}, *rest]


def render_chat(
    template: ChatTemplate,
    fmt: ChatFormat,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
) -> RenderedChat:
    """The prompt text of ``messages`` (``tools``: OpenAI tool objects to offer, or None);
    without ``add_generation_prompt``, a prefix of the conversation (cache pins, and
    ``POST /tokenize`` with ``add_generation_prompt = false``). ``template_kwargs``: extra
    template variables (a request's ``chat_template_kwargs``, e.g. ``enable_thinking``);
    ``ChatTemplateError`` when one is a variable the renderer sets itself.

    The control-token texts written in the messages, tools and variables are marked
    (:meth:`ControlTexts.mark <core_engine.chat.content_text.ControlTexts.mark>` with the
    template's ``control_texts``): tokenize the text with
    :meth:`ControlTexts.encode <core_engine.chat.content_text.ControlTexts.encode>`, and read
    it with :meth:`ControlTexts.text <core_engine.chat.content_text.ControlTexts.text>`."""
    control = template.control_texts
    # Call arguments are decoded before marking: a JSON escape (\u003c for <, a surrogate
    # pair) would otherwise hide a control text from the marks until the template decodes it.
    messages = control.mark(_native(messages))
    tools = control.mark([dict(t) for t in tools]) if tools else None
    has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    extra = control.mark(dict(template_kwargs or {}))
    if fmt.native_tools:
        offered = [dict(t) for t in tools] if tools else None
        text = template.render(
            _native(messages), add_generation_prompt=add_generation_prompt, tools=offered, **extra
        )
    elif tools or has_tool_turns:
        fallback = _fallback(messages, tools)
        try:
            text = template.render(fallback, add_generation_prompt=add_generation_prompt, **extra)
        except ChatTemplateError:
            # A template without a system role (Gemma 2's refuses one): the instructions go at
            # the head of the first user turn, as such models' own system prompts do.
            if not (tools and fallback and fallback[0]["role"] == "system"):
                raise
            text = template.render(
                _system_into_first_user(fallback), add_generation_prompt=add_generation_prompt, **extra
            )
    else:
        text = template.render([dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **extra)
    markers = fmt.reasoning_markers
    reasoning_open = markers is not None and text.rstrip().endswith(markers[0])
    return RenderedChat(text=text, reasoning_open=reasoning_open)

"""Wire types of Anthropic's Messages API (request, response, stream events).

Content blocks are tagged unions on ``type``, so a bad block is a 400 naming it
(``messages[0].content[1].type``). Image, document and server-tool blocks are not served.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

__all__ = [
    "AnthropicErrorResponse",
    "CountTokensRequest",
    "CountTokensResponse",
    "Message",
    "MessagesRequest",
]

PositiveTokens = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
ToolName = Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]


class CacheControl(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``{"type": "ephemeral", "ttl": "5m" | "1h"}``: a prompt-cache breakpoint."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlockParam(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="type", tag="text"):
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlockParam(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlockParam(
    msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="type", tag="tool_result"
):
    tool_use_id: str
    content: str | list[TextBlockParam] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlockParam(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="type", tag="thinking"):
    """An earlier turn's thinking, sent back; not shown to the model again (as Anthropic)."""

    thinking: str
    signature: str | None = None


ContentBlockParam = TextBlockParam | ToolUseBlockParam | ToolResultBlockParam | ThinkingBlockParam


class MessageParam(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class MessagesToolParam(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class MessagesToolChoice(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``auto`` (default), ``any`` (some tool), ``tool`` (the named one), ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    user_id: str | None = None


class ThinkingConfig(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``{"type": "enabled", "budget_tokens": N}`` or ``{"type": "disabled"}``."""

    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None


class MessagesRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The body of ``POST /v1/messages``."""

    model: str
    max_tokens: PositiveTokens
    messages: Annotated[list[MessageParam], msgspec.Meta(min_length=1)]
    system: str | list[TextBlockParam] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    metadata: Metadata | None = None
    stream: bool | None = None
    tools: list[MessagesToolParam] | None = None
    tool_choice: MessagesToolChoice | None = None
    thinking: ThinkingConfig | None = None
    #: Automatic caching: the whole prompt is a breakpoint.
    cache_control: CacheControl | None = None


class CountTokensRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The body of ``POST /v1/messages/count_tokens``."""

    model: str
    messages: Annotated[list[MessageParam], msgspec.Meta(min_length=1)]
    system: str | list[TextBlockParam] | None = None
    tools: list[MessagesToolParam] | None = None
    tool_choice: MessagesToolChoice | None = None


# -- answers -------------------------------------------------------------------------------


class Usage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class TextBlock(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="type", tag="text"):
    text: str


class ThinkingBlock(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""


class ToolUseBlock(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: Any


class Message(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The non-streaming answer (and, empty, the ``message_start`` event's message)."""

    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[TextBlock | ThinkingBlock | ToolUseBlock]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    input_tokens: int


class AnthropicError(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    type: str
    message: str


class AnthropicErrorResponse(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``{"type": "error", "error": {"type", "message"}}``: every error of these routes."""

    type: Literal["error"]
    error: AnthropicError

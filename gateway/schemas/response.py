"""Wire types of the Responses API (``POST /v1/responses``, ``GET``/``DELETE
/v1/responses/{id}``): text in, text out (tools are refused for now)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gateway.schemas.chat import Probability, Temperature

__all__ = [
    "InputContentPart",
    "InputMessage",
    "OutputMessage",
    "OutputText",
    "ResponseDeleted",
    "ResponseIncompleteDetails",
    "ResponseObject",
    "ResponseRequest",
    "ResponseStreamEvent",
    "ResponseTextConfig",
    "ResponseTextFormat",
    "ResponseUsage",
]

OutputTokens = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]


class InputContentPart(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``input_text`` (or, in an assistant turn sent back, ``output_text``)."""

    type: str
    text: str | None = None


class InputMessage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """An input item: a message (``type`` "message" or absent)."""

    type: str | None = None
    role: str
    content: str | list[InputContentPart]


class ResponseTextFormat(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``text.format``: plain text, any JSON object, or JSON valid against ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseTextConfig(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    format: ResponseTextFormat | None = None


class ResponseRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The body of ``POST /v1/responses``."""

    model: str
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: OutputTokens | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    text: ResponseTextConfig | None = None
    stream: bool | None = None
    #: Keep the response (OpenAI's default: true) so that ``GET`` and
    #: ``previous_response_id`` can find it.
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    #: Not served yet: a non-empty list is a 400 naming ``tools``.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None


class OutputText(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    type: str = "output_text"
    text: str
    annotations: list[Any] = []


class OutputMessage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    type: str = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: str = "assistant"
    content: list[OutputText]


class ResponseUsage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseIncompleteDetails(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    reason: str


class ResponseObject(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A response (the body of ``POST``, ``GET`` and the stream's ``response.*`` events)."""

    id: str
    object: str = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputMessage]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    store: bool
    text: dict[str, Any]
    metadata: dict[str, str] = {}
    incomplete_details: ResponseIncompleteDetails | None = None
    error: None = None
    parallel_tool_calls: bool = False
    tool_choice: str = "none"
    tools: list[Any] = []
    user: str | None = None


class ResponseStreamEvent(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One event of a streamed response (``event:`` names it too); the fields beyond these
    depend on ``type`` (OpenAI's typed events: ``response.output_text.delta`` ...)."""

    type: str
    sequence_number: int


class ResponseDeleted(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    id: str
    object: str = "response"
    deleted: bool = True

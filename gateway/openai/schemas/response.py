"""Wire types of the Responses API (``POST /v1/responses``, ``GET``/``DELETE
/v1/responses/{id}``): text and function tools."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gateway.openai.schemas.chat import Probability, Temperature

__all__ = [
    "FunctionCallItem",
    "FunctionTool",
    "FunctionToolChoice",
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
    """An input item: a message (``type`` "message" or absent: ``role``, ``content``), a
    ``function_call`` the model made (``call_id``, ``name``, ``arguments``), or the
    ``function_call_output`` answering it (``call_id``, ``output``)."""

    type: str | None = None
    role: str | None = None
    content: str | list[InputContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class FunctionTool(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``{"type": "function", "name", "description", "parameters", "strict"}``."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``tool_choice = {"type": "function", "name": ...}``."""

    type: Literal["function"]
    name: str


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
    #: Function tools (other kinds are a 400 naming ``tools[i].type``).
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None


class OutputText(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    type: str = "output_text"
    text: str
    annotations: list[Any] = []


class OutputMessage(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="message", tag_field="type"):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: str = "assistant"
    content: list[OutputText]


class FunctionCallItem(
    msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="function_call", tag_field="type"
):
    """A call of one of the request's function tools (answer it with a
    ``function_call_output`` input item carrying the same ``call_id``)."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


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
    output: list[OutputMessage | FunctionCallItem]
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
    parallel_tool_calls: bool = True
    tool_choice: Any = "auto"
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

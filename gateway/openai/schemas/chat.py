"""Wire types of ``POST /v1/chat/completions`` (request, response, stream chunk).

Unknown request fields are ignored, as OpenAI does, except the ones that try to redirect
or reprogram the backend (``api_base``, ``chat_template``...), which the controller rejects.
``chat_template_kwargs`` (plain variables for the model's own template) is accepted.
Type and range errors become 400s naming the field (``messages[0].role``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gateway.openai.schemas.common import StreamOptions, UsageInfo

__all__ = [
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatDelta",
    "ChatLogprobs",
    "ChatMessageParam",
    "ChatResponseMessage",
    "ChatTokenLogprob",
    "ChatTopLogprob",
    "ContentPart",
    "FunctionCall",
    "FunctionCallDelta",
    "NamedToolChoice",
    "ToolCall",
    "ToolCallDeltaItem",
    "ToolCallParam",
    "ToolParam",
]

# Shared parameter ranges (OpenAI's, plus vLLM's extensions).
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=10.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
PositiveTokens = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
ChoiceCount = Annotated[int, msgspec.Meta(ge=1)]
TopLogprobCount = Annotated[int, msgspec.Meta(ge=0)]
#: vLLM's ``cache_salt``: a client's own narrowing of its tenant's prefix-cache partition.
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class ContentPart(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One element of a content-part array; only ``{"type": "text", "text": ...}`` is served."""

    type: str
    text: str | None = None


#: "developer" is OpenAI's newer name for "system"; "tool" carries a tool call's result.
Role = Literal["system", "developer", "user", "assistant", "tool"]

#: OpenAI's rule for function names.
FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")]


class FunctionCallParam(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    name: FunctionName
    #: The arguments as JSON text (as the model wrote them).
    arguments: str


class ToolCallParam(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One input message: ``content`` is a string or an array of text parts."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    #: An assistant turn's tool calls.
    tool_calls: list[ToolCallParam] | None = None
    #: A tool message: the id of the call it answers.
    tool_call_id: str | None = None


class FunctionDefinition(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    name: FunctionName
    description: str | None = None
    #: A JSON Schema of the arguments (an object); absent: no arguments.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One offered tool: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``tool_choice = {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The body of ``POST /v1/chat/completions``."""

    model: str
    messages: Annotated[list[ChatMessageParam], msgspec.Meta(min_length=1)]
    max_tokens: PositiveTokens | None = None
    max_completion_tokens: PositiveTokens | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: ChoiceCount | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobCount | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    #: vLLM extension: keep generating past the end-of-sequence token (benchmarks).
    ignore_eos: bool | None = None
    #: vLLM's structured-output extensions (see gateway/openai/structured_outputs.py).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    #: Reasoning models: OpenAI's effort (mapped to a thinking budget by ``[reasoning]``)
    #: and the explicit budget (vLLM, SGLang and llama-server have one under various names).
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    max_reasoning_tokens: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] | None = None
    #: vLLM's extensions: continue the last message (an assistant's partial answer) instead
    #: of opening a new turn; only the continuation comes back. ``continue_final_message``
    #: needs ``add_generation_prompt`` false (its default, None, is true), as in vLLM.
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    #: vLLM's extension: extra variables for the model's chat template (a JSON object, e.g.
    #: ``{"enable_thinking": false}``); checked in gateway/openai/request_conversion.py.
    chat_template_kwargs: dict[str, Any] | None = None
    #: vLLM's extension: only requests with the same salt (within the key's tenant, which
    #: always partitions) share cached prompt prefixes; see docs/kv-cache.md "Tenants".
    cache_salt: CacheSalt | None = None


class ChatTopLogprob(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    content: list[ChatTokenLogprob] | None


class FunctionCall(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatResponseMessage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    role: str = "assistant"
    content: str | None
    #: vLLM's, SGLang's and llama-server's name for a reasoning model's thinking.
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[ToolCall] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    #: vLLM's: the stop string that ended the choice, else null; on a finished choice only.
    stop_reason: str | None | msgspec.UnsetType = msgspec.UNSET


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The non-streaming response body."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class FunctionCallDelta(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    name: str | msgspec.UnsetType = msgspec.UNSET
    arguments: str = ""


class ToolCallDeltaItem(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``delta.tool_calls[i]``: ``index``, then ``id``/``type``/``function.name`` on a call's
    first piece, ``function.arguments`` fragments on the next ones."""

    index: int
    id: str | msgspec.UnsetType = msgspec.UNSET
    type: str | msgspec.UnsetType = msgspec.UNSET
    function: FunctionCallDelta


class ChatDelta(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    role: str | msgspec.UnsetType = msgspec.UNSET
    content: str | msgspec.UnsetType = msgspec.UNSET
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[ToolCallDeltaItem] | msgspec.UnsetType = msgspec.UNSET


class ChatChunkChoice(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    #: vLLM's: the stop string that ended the choice, else null; on a finished choice only.
    stop_reason: str | None | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One SSE ``data:`` payload; ``usage`` appears (null, then set) only with include_usage."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None | msgspec.UnsetType = msgspec.UNSET
    system_fingerprint: str | None = None

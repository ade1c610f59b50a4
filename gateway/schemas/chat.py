"""Wire types of ``POST /v1/chat/completions`` (request, response, stream chunk).

Unknown request fields are ignored, as OpenAI does, except the ones that try to redirect
or reprogram the backend (``api_base``, ``chat_template``...), which the controller rejects.
Type and range errors become 400s naming the field (``messages[0].role``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gateway.schemas.common import StreamOptions, UsageInfo

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


class ContentPart(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One element of a content-part array; only ``{"type": "text", "text": ...}`` is served."""

    type: str
    text: str | None = None


#: "developer" is OpenAI's newer name for "system".
Role = Literal["system", "developer", "user", "assistant"]


class ChatMessageParam(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One input message: ``content`` is a string or an array of text parts."""

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None


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
    #: vLLM's structured-output extensions (see gateway/structured_outputs.py).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    #: Not served (no backend declares tools yet); a non-empty list is a 400.
    tools: list[dict[str, Any]] | None = None


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


class ChatResponseMessage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    role: str = "assistant"
    content: str | None


class ChatChoice(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The non-streaming response body."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ChatDelta(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    role: str | msgspec.UnsetType = msgspec.UNSET
    content: str | msgspec.UnsetType = msgspec.UNSET


class ChatChunkChoice(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One SSE ``data:`` payload; ``usage`` appears (null, then set) only with include_usage."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None | msgspec.UnsetType = msgspec.UNSET
    system_fingerprint: str | None = None

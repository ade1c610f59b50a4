"""msgspec wire types of the OpenAI-compatible API (they never travel past the controllers)."""

from gateway.schemas.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessageParam,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    ContentPart,
)
from gateway.schemas.common import (
    ErrorBody,
    ErrorResponse,
    PromptTokensDetails,
    StreamOptions,
    UsageInfo,
)
from gateway.schemas.completion import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
)
from gateway.schemas.model import HealthResponse, ModelCard, ModelList, ReadinessResponse

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
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "CompletionRequest",
    "ContentPart",
    "ErrorBody",
    "ErrorResponse",
    "HealthResponse",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "ReadinessResponse",
    "StreamOptions",
    "UsageInfo",
]

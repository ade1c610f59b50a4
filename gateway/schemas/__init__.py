"""msgspec wire types of the OpenAI-compatible API (they never travel past the controllers).

The request and answer types hold JSON values only, never reference cycles, so they opt out
of the cycle collector (``gc=False``: cheaper to create and free; a streamed answer makes
several per chunk).
"""

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
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    ToolCall,
    ToolCallDeltaItem,
    ToolCallParam,
    ToolParam,
)
from gateway.schemas.common import (
    CompletionTokensDetails,
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
from gateway.schemas.embedding import (
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
)
from gateway.schemas.model import HealthResponse, ModelCard, ModelList, ReadinessResponse
from gateway.schemas.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

__all__ = [
    "CompletionTokensDetails",
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
    "DetokenizeRequest",
    "DetokenizeResponse",
    "Embedding",
    "EmbeddingList",
    "EmbeddingRequest",
    "EmbeddingUsage",
    "FunctionCall",
    "FunctionCallDelta",
    "NamedToolChoice",
    "ToolCall",
    "ToolCallDeltaItem",
    "ToolCallParam",
    "ToolParam",
    "ErrorBody",
    "ErrorResponse",
    "HealthResponse",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "ReadinessResponse",
    "TokenizeRequest",
    "TokenizeResponse",
    "StreamOptions",
    "UsageInfo",
]

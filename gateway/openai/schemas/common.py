"""Wire types shared by several endpoints: usage, stream options, the error envelope."""

from __future__ import annotations

import msgspec

__all__ = [
    "CompletionTokensDetails",
    "ErrorBody",
    "ErrorResponse",
    "PromptTokensDetails",
    "StreamOptions",
    "UsageInfo",
]


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``stream_options``: ``include_usage`` adds a final chunk with usage and no choices."""

    include_usage: bool | None = None


class PromptTokensDetails(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    #: Prompt tokens served from the backend's prefix cache.
    cached_tokens: int


class CompletionTokensDetails(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    #: Output tokens a reasoning model spent thinking (``reasoning_content``).
    reasoning_tokens: int


class UsageInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """Token counts of a response; ``prompt_tokens_details`` only when the backend knows."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``{"error": {"message", "type", "param", "code"}}``: every 4xx/5xx body."""

    error: ErrorBody

"""A request's token counts on the wire: :class:`~backends.base.Usage` as OpenAI's ``usage``."""

from __future__ import annotations

from backends.base import Usage
from gateway.openai.schemas import CompletionTokensDetails, PromptTokensDetails, UsageInfo

__all__ = ["usage_info"]


def usage_info(usage: Usage) -> UsageInfo:
    """A request's total (:func:`gateway.serving.summary.openai_usage`) as ``usage``;
    ``prompt_tokens_details`` / ``completion_tokens_details`` only when the backend knows."""
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=None
        if usage.cached_tokens is None
        else PromptTokensDetails(cached_tokens=usage.cached_tokens),
        completion_tokens_details=None
        if usage.reasoning_tokens is None
        else CompletionTokensDetails(reasoning_tokens=usage.reasoning_tokens),
    )

"""The parts of OpenAI's streaming chunk format the ``openai`` backend reads.

Lenient on purpose: unknown fields are ignored and most fields are optional, since vLLM,
SGLang, TensorRT-LLM, llama-server and OpenAI itself each add or omit a few.
"""

from __future__ import annotations

from typing import Any

import msgspec

from backends.base import TokenLogprob, TopLogprob, Usage

__all__ = ["StreamChunk", "UpstreamError", "ErrorBody", "chat_logprobs", "completion_logprobs"]


class TopLogprobEntry(msgspec.Struct, kw_only=True):
    token: str = ""
    logprob: float = 0.0
    bytes: list[int] | None = None


class ContentLogprobEntry(msgspec.Struct, kw_only=True):
    token: str = ""
    logprob: float | None = None
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprobEntry] | None = None


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    # chat
    content: list[ContentLogprobEntry] | None = None
    # completions (legacy shape)
    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] | None = None


class Delta(msgspec.Struct, kw_only=True):
    role: str | None = None
    content: str | None = None


class Choice(msgspec.Struct, kw_only=True):
    index: int = 0
    delta: Delta | None = None  # chat
    text: str | None = None  # completions
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int | None = None


class UsageBody(msgspec.Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    def to_usage(self) -> Usage:
        details = self.prompt_tokens_details
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=details.cached_tokens if details is not None else None,
        )


class UpstreamError(msgspec.Struct, kw_only=True):
    message: str = ""
    type: str | None = None
    param: str | None = None
    code: Any = None


class StreamChunk(msgspec.Struct, kw_only=True):
    choices: list[Choice] = []
    usage: UsageBody | None = None
    error: UpstreamError | None = None  # vLLM and others report mid-stream errors this way


class ErrorBody(msgspec.Struct, kw_only=True):
    error: UpstreamError | str | None = None
    message: str | None = None
    detail: Any = None


def chat_logprobs(logprobs: ChoiceLogprobs | None) -> tuple[TokenLogprob, ...] | None:
    if logprobs is None or logprobs.content is None:
        return None
    return tuple(
        TokenLogprob(
            token=entry.token,
            logprob=entry.logprob,
            bytes=entry.bytes,
            top_logprobs=tuple(
                TopLogprob(token=top.token, logprob=top.logprob, bytes=top.bytes)
                for top in entry.top_logprobs or ()
            ),
        )
        for entry in logprobs.content
    )


def completion_logprobs(logprobs: ChoiceLogprobs | None) -> tuple[TokenLogprob, ...] | None:
    if logprobs is None or logprobs.tokens is None:
        return None
    values = logprobs.token_logprobs or []
    tops = logprobs.top_logprobs or []
    offsets = logprobs.text_offset or []
    entries = []
    for i, token in enumerate(logprobs.tokens):
        top = tops[i] if i < len(tops) and tops[i] else {}
        entries.append(
            TokenLogprob(
                token=token,
                logprob=values[i] if i < len(values) else None,
                top_logprobs=tuple(
                    TopLogprob(token=t, logprob=lp)
                    for t, lp in sorted(top.items(), key=lambda item: -item[1])
                ),
                text_offset=offsets[i] if i < len(offsets) else None,
            )
        )
    return tuple(entries)

"""Wire types of ``POST /v1/completions`` (OpenAI's legacy text completions)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from gateway.openai.schemas.chat import (
    CacheSalt,
    ChoiceCount,
    Penalty,
    Probability,
    RepetitionPenalty,
    Seed,
    Temperature,
    TopK,
    TopLogprobCount,
)
from gateway.openai.schemas.common import StreamOptions, UsageInfo

__all__ = [
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "CompletionRequest",
]

#: 0 is allowed with ``echo`` (score the prompt without generating).
Tokens = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]

#: A string, a list of strings, a list of token ids, or a list of token-id lists.
Prompt = str | list[str | int | list[int]]


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The body of ``POST /v1/completions``."""

    model: str
    prompt: Prompt
    max_tokens: Tokens | None = None
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
    #: Legacy: how many alternatives per position (0 = only the sampled token's logprob).
    logprobs: TopLogprobCount | None = None
    #: Return the prompt in front of the completion (with its logprobs if asked).
    echo: bool | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    #: vLLM's structured-output extensions (see gateway/openai/structured_outputs.py).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    #: vLLM's extension: as chat's ``cache_salt``.
    cache_salt: CacheSalt | None = None
    #: Not served; a non-null value is a 400 rather than silently dropped.
    suffix: str | None = None
    best_of: int | None = None


class CompletionLogprobs(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """OpenAI's legacy shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    #: vLLM's: the stop string that ended the choice, else null; on a finished choice only.
    stop_reason: str | None | msgspec.UnsetType = msgspec.UNSET


class Completion(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The non-streaming response body."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionChunk(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One SSE ``data:`` payload of a streamed completion."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None | msgspec.UnsetType = msgspec.UNSET
    system_fingerprint: str | None = None

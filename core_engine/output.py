"""What the engine hands back per request and step (deltas), and the final offline result."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["GenerationOutput", "RequestMetrics", "RequestOutput", "SpeculationMetrics", "TokenLogprobs"]


class TokenLogprobs(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Logprob of one token under the model (raw logits, before sampling transforms) and the
    top alternatives at that position, most likely first."""

    token_id: int
    logprob: float
    #: ``(token_id, logprob)`` pairs; as many as the request asked for.
    top: tuple[tuple[int, float], ...] = ()


class RequestMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """``time.monotonic()`` stamps of one request (None until reached)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


class SpeculationMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """Speculative decoding of one request (engines with speculation configured)."""

    #: The method of the last proposal ("ngram" / "draft"), None if nothing was proposed.
    method: str | None = None
    #: Proposals verified, tokens proposed, proposed tokens accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class RequestOutput(msgspec.Struct, frozen=True, kw_only=True):
    """One step's news for one request: tokens and text produced since the previous output.

    Text never splits a UTF-8 character and never contains a (partial) stop string; the last
    output of a request has ``finished=True`` and its ``finish_reason``.
    """

    req_id: str
    new_token_ids: tuple[int, ...] = ()
    new_text: str = ""
    #: One record per new token (when ``logprobs`` was asked for), else None.
    logprobs: tuple[TokenLogprobs, ...] | None = None
    #: Per prompt token (the first is None: nothing predicts it); on the first output only.
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    finished: bool = False
    #: "stop" | "length" | "abort" when finished.
    finish_reason: str | None = None
    #: The stop string or stop token id that matched, if any.
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    #: Output tokens so far (cumulative).
    num_output_tokens: int = 0
    #: Prompt tokens served from the prefix cache (None before first scheduling).
    num_cached_tokens: int | None = None
    #: The cached prompt tokens by the KV tier they came from ("device", "host", "disk"),
    #: on the last output of an engine with KV tiers.
    cached_tokens_by_tier: dict[str, int] | None = None
    metrics: RequestMetrics | None = None
    #: On the last output, when the engine has speculation configured.
    speculation: SpeculationMetrics | None = None
    #: On the last output of a prefill-only request: its prompt's KV blocks and first token
    #: (a :class:`~core_engine.kv_transfer.payload.PrefilledKV`), for a decode engine.
    prefilled: Any = None


class GenerationOutput(msgspec.Struct, kw_only=True):
    """The whole result of one offline generation (``LLM.generate``)."""

    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int | None = None
    metrics: RequestMetrics | None = None
    speculation: SpeculationMetrics | None = None

"""The timing of one HTTP generation request and the summary plugins get when it ends.

:class:`ChoiceRun` owns a :class:`RequestClock` and its :class:`ChoiceState` s record when
chunks arrive; the functions here turn that into the
:class:`~plugins.request_summary.RequestSummary` of ``infermux_on_request_end``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from backends.base import GenerationRequest, Usage
from backends.errors import GenerationAbortedError, InfermuxError
from gateway.serving.stream_resume import ResumingStream
from plugins.request_summary import (
    ChoiceOutcome,
    ChoiceSummary,
    RequestStatus,
    RequestSummary,
)

if TYPE_CHECKING:
    from gateway.serving.choice_state import ChoiceState

__all__ = ["RequestClock", "failure_summary", "openai_usage", "run_summary"]


class RequestClock:
    """When the request started, on both clocks."""

    __slots__ = ("started", "started_wall")

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.started_wall = time.time()

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def run_summary(clock: RequestClock, choices: Sequence[ChoiceState], *, n: int) -> RequestSummary:
    """The summary of a request whose choices all opened (they are all reported now)."""
    summaries = tuple(_choice_summary(clock, choice) for choice in choices)
    failed = next((c for c in summaries if c.outcome == "failed"), None)
    status: RequestStatus
    if failed is not None:
        status, error = "error", failed.error
    elif any(c.outcome == "aborted" for c in summaries):
        status = "aborted"
        error = next(c.error for c in summaries if c.outcome == "aborted")
    else:
        status, error = "ok", None
    ttfts = [c.ttft_s for c in summaries if c.ttft_s is not None]
    return RequestSummary(
        request=choices[0].request,
        choices=summaries,
        status=status,
        error=error,
        usage=openai_usage([c.usage for c in summaries], n),
        started_at=clock.started_wall,
        duration_s=clock.elapsed(),
        ttft_s=min(ttfts) if ttfts else None,
        tpot_s=_mean_tpot(summaries),
    )


def failure_summary(
    clock: RequestClock,
    requests: Sequence[GenerationRequest],
    exc: BaseException,
    *,
    routed: bool,
) -> RequestSummary:
    """The summary of a request that failed before every choice had a stream.

    ``routed`` is False when ``transform_request`` refused it (it never reached the router).
    """
    error = _as_error(exc)
    outcome: ChoiceOutcome
    status: RequestStatus
    if isinstance(error, GenerationAbortedError):
        outcome, status = "aborted", "aborted"
    else:
        outcome, status = ("failed" if routed else "rejected"), "error"
    return RequestSummary(
        request=requests[0],
        choices=tuple(
            ChoiceSummary(
                choice_index=r.choice_index, backend_name=None, outcome=outcome, error=error
            )
            for r in requests
        ),
        status=status,
        error=error,
        usage=Usage(prompt_tokens=0, completion_tokens=0),
        started_at=clock.started_wall,
        duration_s=clock.elapsed(),
    )


def _as_error(exc: BaseException) -> InfermuxError:
    if isinstance(exc, InfermuxError):
        return exc
    if isinstance(exc, asyncio.CancelledError):
        return GenerationAbortedError("the client disconnected")
    return InfermuxError(f"internal error: {type(exc).__name__}")


def _choice_summary(clock: RequestClock, choice: ChoiceState) -> ChoiceSummary:
    usage = choice.usage_so_far()  # abort() normally stored it already
    # Backends report usage on their last chunk only: an unfinished choice's is counted.
    partial = usage is not None and choice.outcome != "finished"
    num_output = usage.completion_tokens if usage is not None else 0
    tpot = None
    if num_output >= 2 and choice.last_output_at is not None:
        tpot = max(0.0, choice.last_output_at - choice.first_chunk_at) / (num_output - 1)
    outcome: ChoiceOutcome = "finished"
    if choice.outcome in ("failed", "aborted"):
        outcome = choice.outcome  # type: ignore[assignment]
    return ChoiceSummary(
        choice_index=choice.request.choice_index,
        backend_name=choice.backend_name,
        outcome=outcome,
        finish_reason=choice.finish_reason,
        usage=usage,
        usage_is_partial=partial,
        error=choice.error,
        ttft_s=max(0.0, choice.first_chunk_at - clock.started),
        tpot_s=tpot,
        inter_token_s=tuple(choice.output_gaps),
        phases=choice.phases,
        speculation=choice.speculation,
        output_text="".join(choice.text_parts) if choice.text_parts is not None else None,
        backend_usages=tuple(choice.stream.segments) if isinstance(choice.stream, ResumingStream) else (),
    )


def openai_usage(usages: Sequence[Usage | None], n: int) -> Usage:
    """A request's total by OpenAI's rule: each prompt counted once (not ``n`` times; choice
    k of prompt p sits at position p * n + k), every output summed. The response's ``usage``
    (:meth:`~gateway.serving.choices.ChoiceRun.total_usage`) and the summary's both."""
    prompt_tokens = completion_tokens = 0
    cached: int | None = None
    by_tier: dict[str, int] | None = None
    reasoning: int | None = None
    for position, usage in enumerate(usages):
        if usage is None:
            continue
        completion_tokens += usage.completion_tokens
        if usage.reasoning_tokens is not None:
            reasoning = (reasoning or 0) + usage.reasoning_tokens
        if position % n == 0:
            prompt_tokens += usage.prompt_tokens
            if usage.cached_tokens is not None:
                cached = (cached or 0) + usage.cached_tokens
            if usage.cached_tokens_by_tier:
                by_tier = by_tier or {}
                for tier, count in usage.cached_tokens_by_tier.items():
                    by_tier[tier] = by_tier.get(tier, 0) + count
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached,
        cached_tokens_by_tier=by_tier,
        reasoning_tokens=reasoning,
    )


def _mean_tpot(choices: Sequence[ChoiceSummary]) -> float | None:
    total_time = 0.0
    total_tokens = 0
    for choice in choices:
        if choice.tpot_s is None or choice.usage is None:
            continue
        tokens = choice.usage.completion_tokens - 1
        total_time += choice.tpot_s * tokens
        total_tokens += tokens
    return total_time / total_tokens if total_tokens else None

"""What the benchmark client measures of one request (its own module: the SLO checks of
:mod:`gateway.bench.config` read records that :mod:`gateway.bench.client` writes)."""

from __future__ import annotations

import msgspec

__all__ = ["RequestRecord"]


class RequestRecord(msgspec.Struct, kw_only=True):
    """What one request measured. Latencies in milliseconds; None where not reached."""

    index: int  # position of the prompt in the workload
    target: str  # Target.label
    request_rate: float | None  # offered rate of its run; None: all at once
    scheduled_s: float  # arrival time, seconds after its block started
    start_s: float  # when it was sent, seconds after the run started
    queued_ms: float  # waited for a free concurrency slot after arriving
    ttft_ms: float | None = None
    itl_ms: list[float] = []  # every gap between content chunks
    tpot_ms: float | None = None  # None when fewer than two output tokens
    e2e_ms: float | None = None
    prompt_tokens: int | None = None  # from usage
    output_tokens: int | None = None  # from usage, else the number of content chunks
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    usage_reported: bool = False
    num_chunks: int = 0  # chunks that carried content
    input_len: int = 0  # the workload's estimate of the prompt's tokens
    output_len: int = 0  # max_tokens sent
    output_chars: int = 0
    status_code: int | None = None
    error: str | None = None  # None when the request succeeded

    @property
    def ok(self) -> bool:
        return self.error is None

"""The question and the answer of ``GET /v1/usage`` (hook ``infermux_query_usage``).

These are also the wire shapes: the gateway encodes a :class:`UsageReport` as the response
body as it is.
"""

from __future__ import annotations

import msgspec

__all__ = ["UsageDay", "UsageQuery", "UsageReport", "UsageTotals"]


class UsageQuery(msgspec.Struct, frozen=True, kw_only=True):
    """Filters; ``None`` means "any". The window is ``start <= created_at < end``."""

    api_key_id: str | None = None
    tenant: str | None = None
    model: str | None = None
    #: Unix seconds (the request's start time is what is compared).
    start: float | None = None
    end: float | None = None


class UsageTotals(msgspec.Struct, frozen=True, kw_only=True):
    """Sums over the usage records that match."""

    requests: int = 0
    #: Requests whose status was "error" or "aborted" (included in ``requests``).
    failed_requests: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0


class UsageDay(msgspec.Struct, frozen=True, kw_only=True):
    """One UTC calendar day of matching records."""

    date: str  # YYYY-MM-DD (UTC)
    requests: int = 0
    failed_requests: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0


class UsageReport(msgspec.Struct, frozen=True, kw_only=True):
    """The body of ``GET /v1/usage``."""

    object: str = "usage"
    query: UsageQuery
    totals: UsageTotals
    #: Oldest day first; days without records are left out.
    per_day: list[UsageDay] = []
    #: The currency of ``cost`` (``[cost] currency``).
    currency: str = "USD"

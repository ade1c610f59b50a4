"""Figures of a run: latency percentiles, throughput, goodput, prefix-cache hit rate and cost.

- Percentiles interpolate linearly between the sorted values (numpy's default). TTFT, TPOT and
  E2E have one value per successful request; ITL pools every gap of every successful request.
- Throughput divides by the run's duration: from its first dispatch to its last completion
  (summed over blocks in alternate compare mode).
- Goodput: successful requests that met every SLO given, per second of the same duration.
  SLO keys: ``ttft``, ``tpot`` (the request's TPOT), ``itl`` (the request's largest gap) and
  ``e2e``; values take ``ms``, ``s`` or ``us``, a bare number is milliseconds.
- Prefix-cache hit rate: sum of ``usage.prompt_tokens_details.cached_tokens`` over sum of
  ``usage.prompt_tokens``, over the requests whose usage reports cached tokens; ``None`` when
  none does.
- Cost: prices in currency per 1M tokens; cached prompt tokens at the ``cached`` price (the
  ``input`` price when not given), the other prompt tokens at ``input``, output at ``output``.
  Requests without usage count an estimate of their prompt: the workload's ``input_len`` plus
  the template overhead measured by calibration (when there was one).
"""

from __future__ import annotations

import msgspec
import numpy as np

from gateway.bench.config import Prices, Slo
from gateway.bench.record import RequestRecord

__all__ = ["RunSummary", "Stats", "summarise"]

PERCENTILES = (50, 90, 95, 99)


class Stats(msgspec.Struct, kw_only=True, frozen=True):
    """Distribution of one latency in milliseconds; all None when there is no value."""

    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        if not values:
            return cls(count=0)
        array = np.asarray(values, dtype=np.float64)
        p50, p90, p95, p99 = (float(v) for v in np.percentile(array, PERCENTILES))
        return cls(
            count=len(values),
            mean=float(array.mean()),
            p50=p50,
            p90=p90,
            p95=p95,
            p99=p99,
            max=float(array.max()),
        )


class RunSummary(msgspec.Struct, kw_only=True, frozen=True):
    """The figures of one target at one request rate."""

    num_requests: int
    num_completed: int
    num_failed: int
    duration_s: float
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # prompt + output tokens per second
    total_prompt_tokens: int
    total_output_tokens: int
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    usage_reported_fraction: float  # completed requests whose stream carried usage
    goodput: float | None  # requests/s meeting every SLO; None without --slo
    slo_attainment: float | None  # fraction of all requests meeting every SLO
    cache_hit_rate: float | None  # cached / prompt tokens; None when no usage reports it
    cost: float | None  # total, in the currency of --price
    cost_per_1k_requests: float | None
    errors: dict[str, int]  # error message (first 120 chars) -> count


def _prompt_tokens(record: RequestRecord, overhead: float | None) -> int:
    if record.prompt_tokens is not None:
        return record.prompt_tokens
    return record.input_len + round(overhead or 0)


def _request_cost(record: RequestRecord, prices: Prices, overhead: float | None) -> float:
    prompt = _prompt_tokens(record, overhead)
    cached = min(record.cached_tokens or 0, prompt)
    cached_price = prices.cached if prices.cached is not None else prices.input
    output = record.output_tokens or 0
    return ((prompt - cached) * prices.input + cached * cached_price + output * prices.output) / 1e6


def summarise(
    records: list[RequestRecord],
    *,
    duration_s: float,
    slo: Slo,
    prices: Prices | None,
    prompt_overhead_tokens: float | None = None,
) -> RunSummary:
    """Reduce one run's records to its figures; ``prompt_overhead_tokens`` (the chat
    template's tokens, from calibration) completes prompt estimates where usage is missing."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    prompt_tokens = [_prompt_tokens(r, prompt_overhead_tokens) for r in done]
    output_tokens = [r.output_tokens or 0 for r in done]
    duration = max(duration_s, 1e-9)
    errors: dict[str, int] = {}
    for record in failed:
        key = (record.error or "")[:120]
        errors[key] = errors.get(key, 0) + 1
    num_good = sum(1 for r in done if slo.is_met_by(r))
    with_cache = [r for r in done if r.cached_tokens is not None and r.prompt_tokens]
    cost = (
        sum(_request_cost(r, prices, prompt_overhead_tokens) for r in done)
        if prices is not None
        else None
    )
    return RunSummary(
        num_requests=len(records),
        num_completed=len(done),
        num_failed=len(failed),
        duration_s=duration_s,
        request_throughput=len(done) / duration,
        output_throughput=sum(output_tokens) / duration,
        total_token_throughput=(sum(prompt_tokens) + sum(output_tokens)) / duration,
        total_prompt_tokens=sum(prompt_tokens),
        total_output_tokens=sum(output_tokens),
        mean_prompt_tokens=float(np.mean(prompt_tokens)) if done else None,
        mean_output_tokens=float(np.mean(output_tokens)) if done else None,
        ttft_ms=Stats.of([r.ttft_ms for r in done if r.ttft_ms is not None]),
        tpot_ms=Stats.of([r.tpot_ms for r in done if r.tpot_ms is not None]),
        itl_ms=Stats.of([gap for r in done for gap in r.itl_ms]),
        e2e_ms=Stats.of([r.e2e_ms for r in done if r.e2e_ms is not None]),
        usage_reported_fraction=(sum(r.usage_reported for r in done) / len(done)) if done else 0.0,
        goodput=None if slo.is_empty else num_good / duration,
        slo_attainment=None if slo.is_empty or not records else num_good / len(records),
        cache_hit_rate=(
            sum(r.cached_tokens or 0 for r in with_cache)
            / sum(r.prompt_tokens or 0 for r in with_cache)
            if with_cache
            else None
        ),
        cost=cost,
        cost_per_1k_requests=(cost / len(done) * 1000 if cost is not None and done else None),
        errors=errors,
    )

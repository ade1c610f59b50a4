"""SLO and price flags, and the figures derived from records: percentiles, goodput, hit rate,
cost."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from gateway.bench import (
    BenchConfigError,
    Prices,
    RequestRecord,
    Slo,
    Stats,
    WorkloadSpec,
    build_workload,
    parse_prices,
    parse_slo,
    run_benchmark,
)
from gateway.bench.metrics import summarise

from .fake_server import Behaviour, bench_config, word_tokens


def record(index: int, **fields: object) -> RequestRecord:
    base: dict[str, object] = {
        "index": index,
        "target": "A",
        "request_rate": None,
        "scheduled_s": 0.0,
        "start_s": 0.0,
        "queued_ms": 0.0,
    }
    base.update(fields)
    return RequestRecord(**base)  # type: ignore[arg-type]


def test_slo_flag_units_and_aliases() -> None:
    slo = parse_slo("ttft=500ms, tpot=0.05s,e2el=2,itl=800us")
    assert slo == Slo(ttft_ms=500, tpot_ms=50, e2e_ms=2, itl_ms=0.8)
    assert parse_slo(None).is_empty


@pytest.mark.parametrize("text", ["ttft=fast", "latency=5ms", "ttft"])
def test_bad_slo_names_the_flag(text: str) -> None:
    with pytest.raises(BenchConfigError, match="--slo") as info:
        parse_slo(text)
    assert info.value.param == "--slo"


def test_price_flag() -> None:
    assert parse_prices("input=0.15,output=0.6,cached=0.075") == Prices(
        input=0.15, output=0.6, cached=0.075
    )
    assert parse_prices(None) is None
    for bad in ("input=0.15", "input=x,output=1", "input=1,output=1,vat=2", "input=-1,output=1"):
        with pytest.raises(BenchConfigError, match="--price"):
            parse_prices(bad)


def test_percentiles_interpolate_like_numpy() -> None:
    values = [float(v) for v in range(1, 101)]
    stats = Stats.of(values)
    expected = np.percentile(values, [50, 90, 95, 99])
    assert [stats.p50, stats.p90, stats.p95, stats.p99] == pytest.approx(list(expected))
    assert stats.mean == pytest.approx(50.5) and stats.max == 100
    assert Stats.of([]) == Stats(count=0)


def test_goodput_hit_rate_and_cost_from_records() -> None:
    records = [
        # Meets ttft<=300 and tpot<=50.
        record(0, ttft_ms=100.0, tpot_ms=40.0, e2e_ms=500.0, itl_ms=[40.0],
               prompt_tokens=1000, cached_tokens=0, output_tokens=100, usage_reported=True),
        # TPOT too slow.
        record(1, ttft_ms=100.0, tpot_ms=60.0, e2e_ms=700.0, itl_ms=[60.0],
               prompt_tokens=1000, cached_tokens=800, output_tokens=100, usage_reported=True),
        # TTFT too slow.
        record(2, ttft_ms=400.0, tpot_ms=40.0, e2e_ms=800.0, itl_ms=[40.0],
               prompt_tokens=1000, cached_tokens=800, output_tokens=100, usage_reported=True),
        record(3, error="HTTP 500: boom", input_len=1000),
    ]  # fmt: skip
    summary = summarise(
        records,
        duration_s=2.0,
        slo=parse_slo("ttft=300ms,tpot=50ms"),
        prices=Prices(input=1.0, output=2.0, cached=0.5),
    )
    assert (summary.num_completed, summary.num_failed) == (3, 1)
    assert summary.goodput == pytest.approx(0.5)  # 1 good request in 2 s
    assert summary.slo_attainment == pytest.approx(0.25)  # of all 4, the failed one included
    assert summary.request_throughput == pytest.approx(1.5)
    assert summary.output_throughput == pytest.approx(150)
    assert summary.cache_hit_rate == pytest.approx(1600 / 3000)
    # Uncached 1000 + 200 + 200 at 1.0, cached 1600 at 0.5, output 300 at 2.0, per 1M tokens.
    assert summary.cost == pytest.approx((1400 * 1.0 + 1600 * 0.5 + 300 * 2.0) / 1e6)
    assert summary.errors == {"HTTP 500: boom": 1}
    assert summary.itl_ms.count == 3


def test_without_cached_tokens_the_hit_rate_is_absent() -> None:
    summary = summarise(
        [record(0, ttft_ms=1.0, e2e_ms=2.0, prompt_tokens=10, output_tokens=1)],
        duration_s=1.0,
        slo=Slo(),
        prices=None,
    )
    assert summary.cache_hit_rate is None
    assert summary.goodput is None and summary.cost is None


async def test_shared_prefix_hit_rate_from_server_usage(
    fake_server: Callable[[Behaviour], str],
) -> None:
    # The fake server reports a system prompt it has seen before as cached.
    url = fake_server(Behaviour(ttft_s=0.0, gap_s=0.0))
    result = await run_benchmark(
        bench_config(
            url,
            concurrency=1,
            workload=WorkloadSpec(
                name="shared-prefix", num_requests=6, input_len=200, output_len=2
            ),
        )
    )
    records = result.runs[0].records
    prompts = build_workload(
        result.config.workload, seed=0, tokens_per_word=result.calibration.tokens_per_word
    )
    prefix_tokens = word_tokens(prompts[0].messages[0]["content"])
    expected = 5 * prefix_tokens / sum(r.prompt_tokens or 0 for r in records)
    assert result.runs[0].summary.cache_hit_rate == pytest.approx(expected)
    assert [r.cached_tokens for r in records] == [0] + [prefix_tokens] * 5

"""The tool measures what a server really does: injected TTFT, gaps, slow requests, failures.

The timed runs use a :class:`VirtualClock` the fake server advances, so each figure must equal
the injected delay exactly (see ``assert_latency``): these check the measurement's definitions,
not anyone's speed, and a loaded machine cannot change them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from gateway.bench import (
    BenchResult,
    WorkloadSpec,
    parse_slo,
    run_benchmark,
)

from .fake_server import (
    Behaviour,
    FakeOpenAI,
    ServerThread,
    VirtualClock,
    assert_latency,
    bench_config,
)


@pytest.fixture(scope="module")
def timed_run() -> Iterator[BenchResult]:
    """10 requests of 10 tokens; first token after 200 ms, then one every 20 ms; every 5th
    request waits 600 ms for its first token; goodput SLO: TTFT <= 400 ms. Run once, one
    request at a time on a virtual clock."""
    clock = VirtualClock()
    server = ServerThread(
        FakeOpenAI(Behaviour(ttft_s=0.2, gap_s=0.02, slow_every=5, slow_ttft_s=0.6, clock=clock))
    )
    url = server.start()
    try:
        config = bench_config(url, concurrency=1, slo=parse_slo("ttft=400ms"))
        yield asyncio.run(run_benchmark(config, clock=clock))
    finally:
        server.stop()


async def test_ttft_ignores_the_empty_role_chunk_and_matches_the_injected_delay(
    timed_run: BenchResult,
) -> None:
    # One at a time: the server made the 5th and the 10th request slow.
    for record in timed_run.runs[0].records:
        assert_latency(record.ttft_ms, 600 if record.index in (4, 9) else 200)


async def test_itl_and_tpot_match_the_injected_gap(timed_run: BenchResult) -> None:
    summary = timed_run.runs[0].summary
    for record in timed_run.runs[0].records:
        assert len(record.itl_ms) == 9  # 10 tokens, 9 gaps
        assert record.output_tokens == 10
        assert record.itl_ms == pytest.approx([20.0] * 9)
        assert_latency(record.tpot_ms, 20)
    assert summary.itl_ms.count == 90
    assert_latency(summary.itl_ms.mean, 20)
    assert_latency(summary.tpot_ms.p50, 20)
    # E2E = TTFT + 9 gaps.
    assert_latency(summary.e2e_ms.p50, 380)
    assert_latency(summary.e2e_ms.max, 780)


async def test_percentiles_reflect_the_slow_requests(timed_run: BenchResult) -> None:
    ttft = timed_run.runs[0].summary.ttft_ms
    # 8 values near 200 and 2 near 600, interpolated linearly: p50 sits at sorted position
    # 4.5 (two fast values), p90 at 8.1 and p99 at 8.91 (both between the two slow ones).
    assert_latency(ttft.p50, 200)
    assert_latency(ttft.p90, 600)
    assert_latency(ttft.p99, 600)
    assert_latency(ttft.mean, 280)


async def test_goodput_counts_only_requests_within_the_slo(timed_run: BenchResult) -> None:
    summary = timed_run.runs[0].summary
    assert summary.slo_attainment == pytest.approx(0.8)
    assert summary.duration_s == pytest.approx(8 * 0.38 + 2 * 0.78)  # back to back, virtual
    assert summary.goodput == pytest.approx(8 / summary.duration_s)
    assert summary.request_throughput == pytest.approx(10 / summary.duration_s)
    assert summary.output_throughput == pytest.approx(100 / summary.duration_s)


async def test_concurrency_limit_and_rate_shape_the_run(
    fake_server: Callable[[Behaviour], str],
) -> None:
    clock = VirtualClock()
    behaviour = Behaviour(ttft_s=0.1, gap_s=0.0, clock=clock)
    url = fake_server(behaviour)
    result = await run_benchmark(
        bench_config(
            url,
            concurrency=1,
            workload=WorkloadSpec(name="fixed", num_requests=4, input_len=16, output_len=2),
        ),
        clock=clock,
    )
    # One at a time: the server never had two streams open, and the run took four TTFTs.
    assert behaviour.num_streamed == 4 and behaviour.max_in_flight == 1
    assert result.runs[0].summary.duration_s == pytest.approx(0.4)


async def test_failures_are_counted_and_kept_out_of_the_latencies(
    fake_server: Callable[[Behaviour], str],
) -> None:
    url = fake_server(Behaviour(ttft_s=0.05, gap_s=0.01, fail_every=3))
    result = await run_benchmark(
        bench_config(
            url, workload=WorkloadSpec(name="fixed", num_requests=9, input_len=16, output_len=4)
        )
    )
    summary = result.runs[0].summary
    assert (summary.num_completed, summary.num_failed) == (6, 3)
    assert summary.errors == {"HTTP 500: injected failure": 3}
    assert summary.ttft_ms.count == 6


@pytest.mark.parametrize(
    ("behaviour", "error"),
    [
        (
            Behaviour(ttft_s=0.0, gap_s=0.0, error_frame_after=2),
            "stream error: injected mid-stream failure",
        ),
        (Behaviour(ttft_s=0.0, gap_s=0.0, truncate_after=2), "the stream ended without [DONE]"),
    ],
)
async def test_streams_that_break_mid_way_are_failures(
    fake_server: Callable[[Behaviour], str], behaviour: Behaviour, error: str
) -> None:
    url = fake_server(behaviour)
    result = await run_benchmark(
        bench_config(
            url, workload=WorkloadSpec(name="fixed", num_requests=2, input_len=16, output_len=5)
        )
    )
    summary = result.runs[0].summary
    assert (summary.num_completed, summary.num_failed) == (0, 2)
    assert summary.errors == {error: 2}


async def test_without_usage_output_tokens_come_from_chunks(
    fake_server: Callable[[Behaviour], str],
) -> None:
    # Usage in non-streaming replies (so calibration works) but none in streams, like
    # llama-cpp-python's server.
    url = fake_server(Behaviour(ttft_s=0.05, gap_s=0.01, report_usage=False))
    result = await run_benchmark(
        bench_config(
            url, workload=WorkloadSpec(name="fixed", num_requests=3, input_len=16, output_len=5)
        )
    )
    summary = result.runs[0].summary
    assert summary.usage_reported_fraction == 0
    assert summary.mean_output_tokens == 5
    assert summary.cache_hit_rate is None
    records = result.runs[0].records
    assert all(r.prompt_tokens is None for r in records)
    # Prompt size estimated as the workload's length plus the measured template overhead.
    overhead = result.calibration.overhead_tokens
    assert overhead is not None
    assert summary.mean_prompt_tokens == records[0].input_len + round(overhead)


async def test_completions_endpoint_and_request_options(
    fake_server: Callable[[Behaviour], str],
) -> None:
    behaviour = Behaviour(ttft_s=0.05, gap_s=0.01)
    url = fake_server(behaviour)
    result = await run_benchmark(
        bench_config(
            url + "/v1",
            endpoint="completions",
            ignore_eos=True,
            extra_body={"top_k": 5},
            workload=WorkloadSpec(name="fixed", num_requests=2, input_len=16, output_len=3),
        )
    )
    assert result.runs[0].summary.num_completed == 2
    body = behaviour.bodies[0]
    assert isinstance(body["prompt"], str) and "messages" not in body
    assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"] == 3
    assert body["top_k"] == 5
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == "fake-model"  # discovered through GET /v1/models

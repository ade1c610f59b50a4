"""--compare: two endpoints in one run, the same prompts, interleaved, side by side with B/A."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gateway.bench import (
    BenchResult,
    Target,
    WorkloadSpec,
    format_report,
    parse_slo,
    run_benchmark,
)

from .fake_server import Behaviour, VirtualClock, assert_latency, bench_config


def overlaps(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> bool:
    return any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)


async def run_pair(
    fake_server: Callable[[Behaviour], str], **overrides: object
) -> tuple[BenchResult, Behaviour, Behaviour]:
    # B is three times slower than A on every figure. Both servers share a virtual clock;
    # the caller that uses it must run one request at a time.
    clock = VirtualClock() if overrides.pop("virtual", False) else None
    a = Behaviour(ttft_s=0.1, gap_s=0.01, model="model-a", clock=clock)
    b = Behaviour(ttft_s=0.3, gap_s=0.03, model="model-b", clock=clock)
    url_a, url_b = fake_server(a), fake_server(b)
    settings: dict[str, object] = {
        "targets": [Target(label="A", url=url_a), Target(label="B", url=url_b)],
        "workload": WorkloadSpec(name="chat", num_requests=8, input_len=64, output_len=6),
        "slo": parse_slo("ttft=200ms"),
    }
    settings.update(overrides)
    config = bench_config(url_a, **settings)
    if clock is None:
        return await run_benchmark(config), a, b
    return await run_benchmark(config, clock=clock), a, b


async def test_alternate_mode_same_prompts_no_overlap_and_ratios(
    fake_server: Callable[[Behaviour], str],
) -> None:
    result, a, b = await run_pair(fake_server, compare_block=2, concurrency=1, virtual=True)
    # Both endpoints got the same prompts, and never at the same time (ABBA blocks of 2).
    assert sorted(map(repr, (x["messages"] for x in a.bodies))) == sorted(
        map(repr, (x["messages"] for x in b.bodies))
    )
    assert not overlaps(a.intervals, b.intervals)
    starts = sorted([(s, "A") for s, _ in a.intervals] + [(s, "B") for s, _ in b.intervals])
    order = "".join(label for _, label in starts)
    assert order == "AABBBBAAAABBBBAA"
    run_a, run_b = result.run_for("A", None), result.run_for("B", None)
    assert (run_a.model, run_b.model) == ("model-a", "model-b")
    assert run_a.summary.num_completed == run_b.summary.num_completed == 8
    assert_latency(run_a.summary.ttft_ms.p50, 100)
    assert_latency(run_b.summary.ttft_ms.p50, 300)
    assert run_a.summary.slo_attainment == 1.0 and run_b.summary.slo_attainment == 0.0

    report = format_report(result)
    assert "ratio column: B/A" in report
    assert "A = model-a at" in report and "B = model-b at" in report
    ttft_line = next(line for line in report.splitlines() if line.startswith("TTFT p50"))
    *_, shown_a, shown_b, shown_ratio = ttft_line.split()
    # Shown figures are rounded: the ratio is of the exact values.
    assert (float(shown_a), float(shown_b)) == (100.0, 300.0)
    assert float(shown_ratio) == pytest.approx(3.0)  # 300 / 100 ms injected


async def test_concurrent_mode_loads_both_at_once(
    fake_server: Callable[[Behaviour], str],
) -> None:
    result, a, b = await run_pair(fake_server, compare_mode="concurrent")
    assert overlaps(a.intervals, b.intervals)
    assert len(a.intervals) == len(b.intervals) == 8
    assert {run.target for run in result.runs} == {"A", "B"}

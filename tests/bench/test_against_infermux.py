"""The benchmark against the real infermux gateway: two mock backends with known delays behind
one alias, each pinned with ``x-infermux-backend`` and compared in one run — the way the lead's
serving benchmark pins ``core_engine`` against ``llamacpp``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest

from gateway.bench import BenchConfig, Target, WorkloadSpec, run_benchmark
from gateway.testing import gateway_config, mock_backend


async def test_compare_two_pinned_backends_of_one_gateway(
    live_gateway: Callable[..., AbstractContextManager[Any]],
) -> None:
    config = gateway_config(
        # The mock sleeps first_token_delay_s, then token_delay_s before every token.
        mock_backend("slow", first_token_delay_s=0.15, token_delay_s=0.03),
        mock_backend("fast", first_token_delay_s=0.03, token_delay_s=0.01),
        models={"echo": ["slow", "fast"]},
    )
    with live_gateway(config) as gateway:
        result = await run_benchmark(
            BenchConfig(
                targets=[
                    Target(label="A", url=gateway, headers={"x-infermux-backend": "slow"}),
                    Target(label="B", url=gateway, headers={"x-infermux-backend": "fast"}),
                ],
                workload=WorkloadSpec(name="fixed", num_requests=6, input_len=40, output_len=8),
                concurrency=2,
                ignore_eos=True,
                progress=False,
            )
        )
        # A also answered the two calibration probes.
        assert gateway.backend("slow").num_finished == 6 + 2
        assert gateway.backend("fast").num_finished == 6
    # The mock counts one token per word: calibration finds exactly one token per word.
    assert result.calibration.tokens_per_word == pytest.approx(1.0)
    slow, fast = result.run_for("A", None), result.run_for("B", None)
    assert slow.model == fast.model == "echo"
    # Real time through a real gateway: the figures are compared, never held to a window (the
    # exact definitions are tested on a virtual clock in test_timing.py).
    assert slow.summary.ttft_ms.p50 > fast.summary.ttft_ms.p50
    assert slow.summary.tpot_ms.p50 > fast.summary.tpot_ms.p50
    for run in (slow, fast):
        summary = run.summary
        assert summary.num_completed == 6 and summary.usage_reported_fraction == 1.0
        assert summary.mean_output_tokens == 8
        assert summary.itl_ms.count == 6 * 7
        assert summary.cache_hit_rate == 0.0  # infermux reports cached_tokens (0 for the mock)
        for record in run.records:
            assert record.prompt_tokens == record.input_len  # 40 words = 40 mock tokens

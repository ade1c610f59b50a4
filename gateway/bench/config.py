"""The settings of one benchmark run, as the CLI or a library caller gives them."""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from gateway.bench.client import Target
from gateway.bench.errors import BenchConfigError
from gateway.bench.metrics import Prices, Slo
from gateway.bench.workload import WorkloadSpec

__all__ = ["BenchConfig", "CompareMode", "Endpoint"]

Endpoint = Literal["chat", "completions"]
# alternate: blocks of requests go to A and B in turn (ABBA...), never both at once, so two
#   servers on one machine do not compete while drift still hits both; the default.
# concurrent: both endpoints get the whole load at the same time (separate machines).
CompareMode = Literal["alternate", "concurrent"]


class BenchConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Everything one run needs; validated by :meth:`validate`."""

    targets: list[Target]  # one endpoint, or two for a comparison (A then B)
    workload: WorkloadSpec
    endpoint: Endpoint = "chat"
    concurrency: int | None = None  # most requests in flight per endpoint; None: no limit
    # Offered request rates (req/s), one run each; None means all requests at once (inf).
    request_rates: list[float | None] = msgspec.field(default_factory=lambda: [None])
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1 = Poisson
    seed: int = 0
    tokens_per_word: float | None = None  # None: calibrate on endpoint A
    ignore_eos: bool = False
    temperature: float | None = 0.0  # None: leave to the server
    timeout_s: float = 600.0
    warmup: int = 0  # requests per endpoint before measuring, not recorded
    slo: Slo = Slo()
    prices: Prices | None = None
    compare_mode: CompareMode = "alternate"
    compare_block: int | None = None  # requests per block in alternate mode; None: automatic
    extra_body: dict[str, Any] = {}  # merged into every request body
    progress: bool = True

    def validate(self) -> None:
        """Raise BenchConfigError naming the first bad setting."""
        if not 1 <= len(self.targets) <= 2:
            raise BenchConfigError("give one endpoint, or two to compare", param="targets")
        if len({t.label for t in self.targets}) != len(self.targets):
            raise BenchConfigError("labels must differ", param="targets")
        if self.concurrency is not None and self.concurrency < 1:
            raise BenchConfigError("must be at least 1", param="concurrency")
        if not self.request_rates:
            raise BenchConfigError("give at least one rate", param="request_rate")
        for rate in self.request_rates:
            if rate is not None and not (rate > 0 and math.isfinite(rate)):
                raise BenchConfigError(
                    f"must be a positive number or inf, got {rate}", param="request_rate"
                )
        if not self.burstiness > 0:
            raise BenchConfigError("must be positive", param="burstiness")
        if self.tokens_per_word is not None and not self.tokens_per_word > 0:
            raise BenchConfigError("must be positive", param="tokens_per_word")
        if self.warmup < 0:
            raise BenchConfigError("must not be negative", param="warmup")
        if self.compare_block is not None and self.compare_block < 1:
            raise BenchConfigError("must be at least 1", param="compare_block")
        if not self.timeout_s > 0:
            raise BenchConfigError("must be positive", param="timeout")

    def block_size(self, num_requests: int) -> int:
        """Requests per block in alternate compare mode."""
        if self.compare_block is not None:
            return self.compare_block
        if self.concurrency == 1:
            return 1  # strict A/B alternation costs nothing at concurrency 1
        # Long enough for a concurrent run to reach its steady state before switching.
        return min(num_requests, 4 * self.concurrency if self.concurrency else 32)

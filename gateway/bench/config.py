"""The settings of one benchmark run, as the CLI or a library caller gives them.

Kept free of heavy imports (no httpx, numpy, tqdm): ``infermux --help`` imports it.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from gateway.bench.errors import BenchConfigError
from gateway.bench.workload import DEFAULT_TOKENS_PER_WORD, WorkloadSpec, build_workload

if TYPE_CHECKING:
    from gateway.bench.record import RequestRecord

__all__ = [
    "BenchConfig",
    "CompareMode",
    "Endpoint",
    "Prices",
    "Slo",
    "Target",
    "parse_prices",
    "parse_slo",
]

Endpoint = Literal["chat", "completions"]
# alternate: blocks of requests go to A and B in turn (ABBA...), never both at once, so two
#   servers on one machine do not compete while drift still hits both; the default.
# concurrent: both endpoints get the whole load at the same time (separate machines).
CompareMode = Literal["alternate", "concurrent"]


class Target(msgspec.Struct, kw_only=True, frozen=True):
    """One endpoint under test."""

    label: str  # "A", or "B" for the --compare endpoint
    url: str  # base URL (http://host:port or .../v1) or a full .../completions URL
    model: str | None = None  # None: the first id listed by GET /v1/models
    api_key: str | None = None
    headers: dict[str, str] = {}


class Slo(msgspec.Struct, kw_only=True, frozen=True):
    """Latency targets a request must meet to count towards goodput (milliseconds)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None  # the request's largest inter-token gap
    e2e_ms: float | None = None

    @property
    def is_empty(self) -> bool:
        return all(v is None for v in (self.ttft_ms, self.tpot_ms, self.itl_ms, self.e2e_ms))

    def describe(self) -> str:
        parts = [
            f"{name}<={value:g}ms"
            for name, value in (
                ("ttft", self.ttft_ms),
                ("tpot", self.tpot_ms),
                ("itl", self.itl_ms),
                ("e2e", self.e2e_ms),
            )
            if value is not None
        ]
        return ",".join(parts)

    def is_met_by(self, record: RequestRecord) -> bool:
        checks = (
            (self.ttft_ms, record.ttft_ms),
            (self.tpot_ms, record.tpot_ms),
            (self.itl_ms, max(record.itl_ms) if record.itl_ms else None),
            (self.e2e_ms, record.e2e_ms),
        )
        # A request with one output token has no TPOT or ITL: nothing to miss there.
        return all(limit is None or value is None or value <= limit for limit, value in checks)


class Prices(msgspec.Struct, kw_only=True, frozen=True):
    """Prices per 1M tokens."""

    input: float
    output: float
    cached: float | None = None  # None: the input price


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*$")
_SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2e": "e2e_ms"}
_SLO_ALIASES = {"e2el": "e2e"}
_UNIT_MS = {"ms": 1.0, "s": 1e3, "us": 1e-3, None: 1.0}


def _pairs(text: str, param: str) -> list[tuple[str, str]]:
    pairs = []
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise BenchConfigError(f"expected KEY=VALUE, got {item.strip()!r}", param=param)
        pairs.append((key.strip().lower(), value.strip()))
    return pairs


def parse_slo(text: str | None) -> Slo:
    """``ttft=500ms,tpot=50ms`` -> Slo; raises BenchConfigError naming ``--slo``."""
    if not text:
        return Slo()
    values: dict[str, float] = {}
    for key, value in _pairs(text, "--slo"):
        key = _SLO_ALIASES.get(key, key)
        if key not in _SLO_KEYS:
            raise BenchConfigError(
                f"unknown SLO {key!r}; use {', '.join(_SLO_KEYS)}", param="--slo"
            )
        match = _DURATION.match(value)
        if match is None:
            raise BenchConfigError(
                f"{key}: expected a duration such as 500ms or 0.5s, got {value!r}", param="--slo"
            )
        values[_SLO_KEYS[key]] = float(match.group(1)) * _UNIT_MS[match.group(2)]
    return Slo(**values)


def parse_prices(text: str | None) -> Prices | None:
    """``input=0.15,output=0.6,cached=0.075`` (per 1M tokens) -> Prices."""
    if not text:
        return None
    values: dict[str, float] = {}
    for key, value in _pairs(text, "--price"):
        if key not in ("input", "output", "cached"):
            raise BenchConfigError(
                f"unknown price {key!r}; use input, output, cached", param="--price"
            )
        try:
            values[key] = float(value)
        except ValueError as exc:
            raise BenchConfigError(f"{key}: not a number: {value!r}", param="--price") from exc
        if values[key] < 0:
            raise BenchConfigError(f"{key}: must not be negative", param="--price")
    if "input" not in values or "output" not in values:
        raise BenchConfigError("give at least input=... and output=...", param="--price")
    return Prices(**values)


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
        # Workload errors (a bad file, impossible lengths) before any endpoint is contacted.
        build_workload(
            self.workload,
            seed=self.seed,
            tokens_per_word=self.tokens_per_word or DEFAULT_TOKENS_PER_WORD,
        )

    def block_size(self, num_requests: int) -> int:
        """Requests per block in alternate compare mode."""
        if self.compare_block is not None:
            return self.compare_block
        if self.concurrency == 1:
            return 1  # strict A/B alternation costs nothing at concurrency 1
        # Long enough for a concurrent run to reach its steady state before switching.
        return min(num_requests, 4 * self.concurrency if self.concurrency else 32)

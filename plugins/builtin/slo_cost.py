"""The ``slo_cost`` routing strategy: the cheapest backend predicted to meet the request's SLO.

Inputs, per backend of the alias:

- **price**: the ``[[cost.prices]]`` rule for (alias, backend), per million input and output
  tokens (no rule: free);
- **live latency**: exponentially weighted means of the TTFT and TPOT of its recent requests
  (the router reports each stream that ended well, :meth:`SloCostStrategy.observe`);
- **queue depth**: the streams open on it now (the router's ``outstanding``).

A request's SLO is ``x-infermux-ttft-slo-ms`` / ``x-infermux-tpot-slo-ms`` (request headers,
as labels), else the alias's ``ttft_slo_ms`` / ``tpot_slo_ms``. The predicted TTFT of a backend
is its mean TTFT times ``1 + queue depth`` (each request ahead delays the next by about one
TTFT), its predicted TPOT the mean TPOT; a backend with no history yet is predicted to meet
any SLO, so it gets tried and measured. Order: the backends predicted to meet the SLO,
cheapest first; then the rest, fastest first (when none is predicted to, the fastest goes
first). Without an SLO: cheapest first. The decision and its inputs go on the request's
routing span (label ``infermux.routing``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from backends.base import GenerationRequest
from plugins.builtin.strategies import RoutingContext

__all__ = ["DECISION_LABEL", "TPOT_SLO_HEADER", "TTFT_SLO_HEADER", "SloCostStrategy"]

TTFT_SLO_HEADER = "x-infermux-ttft-slo-ms"
TPOT_SLO_HEADER = "x-infermux-tpot-slo-ms"
#: The label the decision goes into (the tracing plugin puts it on the route span).
DECISION_LABEL = "infermux.routing"
#: Weight of the newest sample in the latency means.
_ALPHA = 0.3


@dataclass(slots=True)
class _Latency:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def add(self, ttft_s: float | None, tpot_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft_s = ttft_s if self.ttft_s is None else (1 - _ALPHA) * self.ttft_s + _ALPHA * ttft_s
        if tpot_s is not None:
            self.tpot_s = tpot_s if self.tpot_s is None else (1 - _ALPHA) * self.tpot_s + _ALPHA * tpot_s


def _slo_ms(request: GenerationRequest, header: str, default: float | None) -> float | None:
    value = request.labels.get(header)
    if value is None:
        return default
    try:
        parsed = float(value)
    except ValueError:
        return default
    return parsed if parsed > 0 else default


class SloCostStrategy:
    """See the module docstring. One instance per alias."""

    def __init__(self) -> None:
        self._context = RoutingContext(alias="", backends=())
        self._latency: dict[str, _Latency] = {}

    def configure(self, context: RoutingContext) -> None:
        self._context = context
        self._latency = {name: _Latency() for name in context.backends}

    def observe(self, backend: str, *, ttft_s: float | None, tpot_s: float | None) -> None:
        """A stream of ``backend`` ended well after ``ttft_s`` to its first chunk and
        ``tpot_s`` per further token (None: not measured)."""
        self._latency.setdefault(backend, _Latency()).add(ttft_s, tpot_s)

    def order(
        self, candidates: list[str], request: GenerationRequest, outstanding: Mapping[str, int]
    ) -> list[str]:
        return self.decide(candidates, request, outstanding)[0]

    def decide(
        self, candidates: list[str], request: GenerationRequest, outstanding: Mapping[str, int]
    ) -> tuple[list[str], dict[str, object]]:
        """The order, and the decision with its inputs (for the routing span)."""
        ctx = self._context
        ttft_slo = _slo_ms(request, TTFT_SLO_HEADER, ctx.ttft_slo_ms)
        tpot_slo = _slo_ms(request, TPOT_SLO_HEADER, ctx.tpot_slo_ms)
        rows = []
        for name in candidates:
            latency = self._latency.get(name, _Latency())
            queue = outstanding.get(name, 0)
            ttft = None if latency.ttft_s is None else latency.ttft_s * (1 + queue) * 1e3
            tpot = None if latency.tpot_s is None else latency.tpot_s * 1e3
            price_in, price_out = ctx.prices.get(name, (0.0, 0.0))
            meets = (ttft_slo is None or ttft is None or ttft <= ttft_slo) and (
                tpot_slo is None or tpot is None or tpot <= tpot_slo
            )
            rows.append(_Row(name, queue, ttft, tpot, price_in + price_out, meets))
        meeting = sorted((r for r in rows if r.meets_slo), key=lambda r: (r.price_per_mtok, r.speed_key))
        missing = sorted((r for r in rows if not r.meets_slo), key=lambda r: r.speed_key)
        order = [r.backend for r in meeting + missing]
        decision: dict[str, object] = {
            "strategy": "slo_cost",
            "ttft_slo_ms": ttft_slo,
            "tpot_slo_ms": tpot_slo,
            "chosen": order[0] if order else None,
            "reason": "cheapest predicted to meet the SLO" if meeting else "none predicted to meet the SLO: fastest",
            "backends": [r.as_dict() for r in rows],
        }
        return order, decision


@dataclass(frozen=True, slots=True)
class _Row:
    backend: str
    queue: int
    predicted_ttft_ms: float | None
    predicted_tpot_ms: float | None
    price_per_mtok: float
    meets_slo: bool

    @property
    def speed_key(self) -> float:
        # Unmeasured backends first among equals: they get tried and measured.
        return self.predicted_ttft_ms if self.predicted_ttft_ms is not None else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "backend": self.backend, "queue": self.queue,
            "predicted_ttft_ms": None if self.predicted_ttft_ms is None else round(self.predicted_ttft_ms, 2),
            "predicted_tpot_ms": None if self.predicted_tpot_ms is None else round(self.predicted_tpot_ms, 2),
            "price_per_mtok": self.price_per_mtok, "meets_slo": self.meets_slo,
        }

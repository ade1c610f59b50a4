"""``GET /metrics``: Prometheus text exposition of this app's registry.

The registry is per app (``GatewayState.metrics_registry``); plugins fill it through
``infermux_register_metrics`` (the built-in metrics and cost plugins; docs/observability.md
lists every metric). Not under ``/v1/``: scrapers do not carry API keys.
"""

from __future__ import annotations

from litestar import Controller, Response, get
from litestar.di import NamedDependency
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.state import GatewayState

__all__ = ["MetricsController"]


class MetricsController(Controller):
    """Prometheus scrape endpoint."""

    tags = ["observability"]

    @get(
        "/metrics",
        summary="Prometheus metrics",
        description="Requests, latencies (TTFT, TPOT, inter-token, end-to-end), tokens, "
        "running/waiting requests, engine KV-cache usage, goodput and cost, in the "
        "Prometheus text format (version 0.0.4).",
        media_type=CONTENT_TYPE_LATEST,
        sync_to_thread=False,
    )
    def metrics(self, gateway: NamedDependency[GatewayState]) -> Response[bytes]:
        return Response(generate_latest(gateway.metrics_registry), media_type=CONTENT_TYPE_LATEST)

"""``GET /metrics``: Prometheus text exposition of this app's registry.

The registry is per app (``GatewayState.metrics_registry``); plugins fill it through
``infermux_register_metrics`` (the built-in metrics and cost plugins; docs/observability.md
lists every metric). Not under ``/v1/``: scrapers do not carry API keys. Public unless
``[server] metrics_token_sha256`` is set: then a scrape sends ``Authorization: Bearer
<token>`` (Prometheus' ``authorization`` / ``bearer_token`` settings) or gets 401. Series that
follow one client (by API key id or tenant) are off unless ``[telemetry.metrics]
tenant_labels`` turns them on.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers.base import BaseRouteHandler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.errors import AuthenticationError
from gateway.http.auth import presented_key, token_matches
from gateway.state import GatewayState

__all__ = ["MetricsController", "metrics_token_guard"]

_CHALLENGE = {"www-authenticate": 'Bearer realm="infermux-metrics"'}


async def metrics_token_guard(
    connection: ASGIConnection[Any, Any, Any, Any], _handler: BaseRouteHandler
) -> None:
    """401 unless the request carries the ``[server] metrics_token_sha256`` token (when set)."""
    gateway: GatewayState = connection.app.state["gateway"]
    digest = gateway.config.server.metrics_token_sha256
    if digest is not None and not token_matches(presented_key(connection.headers), digest):
        raise AuthenticationError(
            "GET /metrics needs the metrics token: send 'Authorization: Bearer <token>'",
            headers=_CHALLENGE,
        )


class MetricsController(Controller):
    """Prometheus scrape endpoint."""

    tags = ["observability"]
    guards = [metrics_token_guard]

    @get(
        "/metrics",
        summary="Prometheus metrics",
        description="Requests, latencies (TTFT, TPOT, inter-token, end-to-end), tokens, "
        "running/waiting requests, engine KV-cache usage, goodput and cost, in the "
        "Prometheus text format (version 0.0.4). Needs `Authorization: Bearer <token>` when "
        "`[server] metrics_token_sha256` is set.",
        media_type=CONTENT_TYPE_LATEST,
        sync_to_thread=False,
    )
    def metrics(self, gateway: NamedDependency[GatewayState]) -> Response[bytes]:
        return Response(generate_latest(gateway.metrics_registry), media_type=CONTENT_TYPE_LATEST)

"""``GET /health`` (liveness) and ``GET /ready`` (readiness: backends loaded, not draining)."""

from __future__ import annotations

from litestar import Controller, Response, get
from litestar.di import NamedDependency

from gateway.schemas import HealthResponse, ReadinessResponse
from gateway.state import GatewayState

__all__ = ["HealthController"]


class HealthController(Controller):
    """Probes for supervisors and load balancers."""

    tags = ["health"]

    @get("/health", summary="Liveness")
    async def health(self) -> HealthResponse:
        return HealthResponse()

    @get("/ready", summary="Readiness (503 while loading or draining)")
    async def ready(self, gateway: NamedDependency[GatewayState]) -> Response[ReadinessResponse]:
        if gateway.draining:
            status = "draining"
        elif gateway.router is not None:
            status = "ready"
        elif gateway.load_error is not None:
            status = "failed"
        else:
            status = "loading"
        circuits: dict[str, str] = {}
        if gateway.router is not None:
            circuits = dict(gateway.router.circuit_states())
        return Response(
            ReadinessResponse(
                status=status, backends=dict(gateway.backend_status), circuits=circuits
            ),
            status_code=200 if status == "ready" else 503,
        )

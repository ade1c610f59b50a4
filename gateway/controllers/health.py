"""``GET /health`` (liveness) and ``GET /ready`` (readiness: every model has a started
backend, not draining)."""

from __future__ import annotations

from litestar import Controller, Response, get
from litestar.di import NamedDependency

from gateway.openai.schemas import HealthResponse, ReadinessResponse
from gateway.state import GatewayState

__all__ = ["HealthController"]


class HealthController(Controller):
    """Probes for supervisors and load balancers."""

    tags = ["health"]

    @get("/health", summary="Liveness")
    async def health(self) -> HealthResponse:
        return HealthResponse()

    @get("/ready", summary="Readiness (503 while loading, draining, or a model has no started backend)")
    async def ready(self, gateway: NamedDependency[GatewayState]) -> Response[ReadinessResponse]:
        models: dict[str, str] = {}
        if gateway.draining:
            status = "draining"
        elif gateway.load_error is not None or gateway.startup_error is not None:
            status = "failed"
        elif gateway.router is not None:
            models = gateway.models_without_backend()
            status = "unavailable" if models else "ready"
        else:
            status = "loading"
        circuits: dict[str, str] = {}
        if gateway.router is not None:
            circuits = dict(gateway.router.circuit_states())
        return Response(
            ReadinessResponse(
                status=status,
                backends={name: gateway.backend_state(name) for name in gateway.backend_status},
                circuits=circuits,
                models=models,
                error=gateway.startup_error or gateway.load_error,
            ),
            status_code=200 if status == "ready" else 503,
        )

"""``GET /health`` (liveness) and ``GET /ready`` (readiness: every model has a started
backend, not draining).

Both are public (probes carry no key), so ``/ready`` gives states only: the gateway's, each
backend's (``ready``, ``loading``, ``failed``, ``restarting``...), each circuit's, and the aliases
that cannot be served. Why a backend failed or a worker died (exception text, model file paths)
is in the log, where ``GatewayState`` writes it when it happens.
"""

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
            models = dict.fromkeys(gateway.models_without_backend(), "no started backend")
            status = "unavailable" if models else "ready"
        else:
            status = "loading"
        circuits: dict[str, str] = {}
        if gateway.router is not None:
            circuits = dict(gateway.router.circuit_states())
        return Response(
            ReadinessResponse(
                status=status,
                backends={name: _state_word(gateway.backend_state(name)) for name in gateway.backend_status},
                circuits=circuits,
                models=models,
            ),
            status_code=200 if status == "ready" else 503,
        )


def _state_word(state: str) -> str:
    # "failed: FileNotFoundError: /models/x.gguf" -> "failed": the reason is in the log.
    return state.partition(":")[0]

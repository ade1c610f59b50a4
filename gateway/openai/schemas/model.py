"""Wire types of ``GET /v1/models``, ``GET /v1/models/{id}`` and the health endpoints."""

from __future__ import annotations

import msgspec

__all__ = ["HealthResponse", "ModelCard", "ModelList", "ReadinessResponse"]


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    """One servable model alias (OpenAI's ``model`` object plus the backends behind it)."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "infermux"
    #: Backend names in priority order; any of them can be pinned with ``x-infermux-backend``.
    backends: list[str] = []


class ModelList(msgspec.Struct, frozen=True, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class HealthResponse(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /health``: the process is up."""

    status: str = "ok"


class ReadinessResponse(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /ready``: "ready" (200), or "loading" / "draining" / "failed" / "unavailable"
    (a model has no started backend) (503)."""

    status: str
    #: Backend name -> "ready" | "loading" | "failed" | a worker's "starting" / "restarting" /
    #: "stopped". States only (the endpoint is public): the reasons are in the log.
    backends: dict[str, str]
    #: Backend name -> circuit state ("closed" | "open" | "half_open"), once routing runs.
    circuits: dict[str, str] = {}
    #: Alias -> "no started backend", for each alias that cannot be served now.
    models: dict[str, str] = {}

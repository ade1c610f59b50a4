"""``GET /v1/models`` and ``GET /v1/models/{id}``: the aliases of the config."""

from __future__ import annotations

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromPath

from backends.errors import ModelNotFoundError
from gateway.http.auth import api_key_guard
from gateway.openai.schemas import ModelCard, ModelList
from gateway.state import GatewayState

__all__ = ["ModelController"]


class ModelController(Controller):
    """The model aliases clients can send as ``model``."""

    path = "/v1/models"
    tags = ["models"]
    guards = [api_key_guard]

    @get("", summary="List models")
    async def list_models(self, gateway: NamedDependency[GatewayState]) -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=alias, created=gateway.started_at, backends=backends)
                for alias, backends in gateway.model_backends().items()
            ]
        )

    # ``:path`` because model ids often contain slashes (``org/model``).
    @get("/{model_id:path}", summary="Retrieve a model")
    async def get_model(
        self, model_id: FromPath[str], gateway: NamedDependency[GatewayState]
    ) -> ModelCard:
        alias = model_id.lstrip("/")
        backends = gateway.model_backends().get(alias)
        if backends is None:
            # Never echo the raw id into paths or logs: aliases are a closed set.
            raise ModelNotFoundError(f"the model {alias!r} does not exist", param="model")
        return ModelCard(id=alias, created=gateway.started_at, backends=backends)

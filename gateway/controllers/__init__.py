"""HTTP controllers of the OpenAI-compatible API and the health endpoints."""

from gateway.anthropic.count_tokens import CountTokensController
from gateway.anthropic.messages import MESSAGES
from gateway.controllers.chat import CHAT_COMPLETIONS
from gateway.controllers.completion import COMPLETIONS
from gateway.controllers.embedding import EMBEDDINGS
from gateway.controllers.health import HealthController
from gateway.controllers.metrics import MetricsController
from gateway.controllers.model import ModelController
from gateway.controllers.response import ResponseController, responses_endpoint
from gateway.controllers.tokenize import TokenizeController
from gateway.controllers.usage import UsageController

__all__ = [
    "CHAT_COMPLETIONS",
    "CountTokensController",
    "COMPLETIONS",
    "CONTROLLERS",
    "EMBEDDINGS",
    "GENERATION_ENDPOINTS",
    "HealthController",
    "MetricsController",
    "ModelController",
    "ResponseController",
    "TokenizeController",
    "UsageController",
    "responses_endpoint",
]

#: The generation endpoints (``@asgi`` handlers built per app: gateway/http/endpoint.py).
GENERATION_ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, MESSAGES)

#: Every other controller the app mounts. Those under ``/v1/`` carry the API-key guard.
CONTROLLERS = (
    ModelController,
    HealthController,
    MetricsController,
    UsageController,
    TokenizeController,
    ResponseController,
    CountTokensController,
)

"""HTTP controllers of the OpenAI-compatible API and the health endpoints."""

from gateway.controllers.chat import ChatController
from gateway.controllers.completion import CompletionController
from gateway.controllers.health import HealthController
from gateway.controllers.metrics import MetricsController
from gateway.controllers.model import ModelController
from gateway.controllers.usage import UsageController

__all__ = [
    "ChatController",
    "CompletionController",
    "HealthController",
    "MetricsController",
    "ModelController",
    "UsageController",
]

#: Every controller the app mounts.
CONTROLLERS = (
    ChatController,
    CompletionController,
    ModelController,
    HealthController,
    MetricsController,
    UsageController,
)

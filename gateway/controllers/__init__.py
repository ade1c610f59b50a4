"""HTTP controllers of the OpenAI-compatible API and the health endpoints."""

from gateway.controllers.chat import ChatController
from gateway.controllers.completion import CompletionController
from gateway.controllers.health import HealthController
from gateway.controllers.model import ModelController

__all__ = ["ChatController", "CompletionController", "HealthController", "ModelController"]

#: Every controller the app mounts.
CONTROLLERS = (ChatController, CompletionController, ModelController, HealthController)

"""Typed errors of the core engine (it imports nothing from ``backends``).

::

    EngineError
    ├── InvalidParamError          a request parameter is out of range (``param`` names it)
    │   └── RequestTooLongError    prompt + max_tokens can never fit (context or KV pool)
    └── EngineDeadError            the background engine loop died; no further requests

Adapters (``backends/core_engine.py``) map these onto the gateway's error tree.
"""

from __future__ import annotations

__all__ = ["EngineDeadError", "EngineError", "InvalidParamError", "RequestTooLongError"]


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidParamError(EngineError, ValueError):
    """A request parameter is invalid; ``param`` names it (``"temperature"``, ``"prompt"``)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class RequestTooLongError(InvalidParamError):
    """The request can never be served: prompt plus ``max_tokens`` exceeds the model's context
    length or the whole KV-cache pool. Raised up front by ``add_request``, never mid-flight."""


class EngineDeadError(EngineError):
    """The engine loop stopped after an unexpected error; the message carries the cause."""

"""OpenTelemetry GenAI semantic-convention names shared by the tracing and metrics plugins."""

from __future__ import annotations

__all__ = ["operation_name", "provider_name"]

# gen_ai.provider.name per backend kind: well-known values where they exist.
_PROVIDERS = {
    "openai": "openai",
    "llamacpp": "llama.cpp",
    "core_engine": "infermux",
    "mlx": "mlx",
    "mock": "mock",
}

# gen_ai.operation.name per request kind (the semantic conventions' well-known values).
_OPERATIONS = {"chat": "chat", "completion": "text_completion", "embedding": "embeddings"}


def operation_name(kind: str) -> str:
    """``gen_ai.operation.name`` of a ``GenerationRequest.kind``."""
    return _OPERATIONS.get(kind, "text_completion")


def provider_name(backend_kind: str | None) -> str:
    """``gen_ai.provider.name`` of a backend kind (the kind itself when not well known)."""
    if backend_kind is None:
        return "infermux"
    return _PROVIDERS.get(backend_kind, backend_kind)

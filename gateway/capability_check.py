"""Refuse parameters a backend cannot honour, instead of silently ignoring them.

Each backend declares :class:`~backends.base.Capabilities`. The router calls
:func:`unsupported_parameter` for every candidate backend before ``generate``: a backend that
cannot honour the request is skipped (never counted against its circuit), and when no
candidate can, the client gets the first refusal as a 400 ``unsupported_parameter`` naming
the parameter.
"""

from __future__ import annotations

from backends.base import Capabilities, GenerationRequest
from backends.errors import UnsupportedParameterError

__all__ = ["unsupported_parameter"]


def unsupported_parameter(
    capabilities: Capabilities, request: GenerationRequest, backend_name: str
) -> UnsupportedParameterError | None:
    """The error for the first parameter ``capabilities`` rule out, else None."""
    params = request.params
    is_chat = request.kind == "chat"
    checks: list[tuple[bool, str, str]] = [
        (
            (params.logprobs or params.top_logprobs > 0) and not capabilities.logprobs,
            "logprobs",
            "logprobs",
        ),
        (
            capabilities.logprobs and params.top_logprobs > capabilities.max_top_logprobs,
            "top_logprobs" if is_chat else "logprobs",
            f"more than {capabilities.max_top_logprobs} top logprobs",
        ),
        (params.echo and not capabilities.echo, "echo", "echo"),
        (params.top_k is not None and not capabilities.top_k, "top_k", "top_k"),
        (params.min_p > 0.0 and not capabilities.min_p, "min_p", "min_p"),
        (params.seed is not None and not capabilities.seed, "seed", "seed"),
        (
            params.presence_penalty != 0.0 and not capabilities.penalties,
            "presence_penalty",
            "presence_penalty",
        ),
        (
            params.frequency_penalty != 0.0 and not capabilities.penalties,
            "frequency_penalty",
            "frequency_penalty",
        ),
        (
            params.repetition_penalty != 1.0 and not capabilities.repetition_penalty,
            "repetition_penalty",
            "repetition_penalty",
        ),
        (
            request.response_format is not None and not capabilities.structured_outputs,
            "response_format",
            "structured outputs (response_format)",
        ),
    ]
    for refused, param, what in checks:
        if refused:
            return UnsupportedParameterError(
                f"{what} is not supported by the backend {backend_name!r} that serves the "
                f"model {request.model!r}",
                param=param,
            )
    return None

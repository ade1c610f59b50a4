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
    if request.kind == "embedding":
        if capabilities.embeddings:
            return None
        # The model is what the client chose wrongly: it names a generation-only model.
        return UnsupportedParameterError(
            f"the backend {backend_name!r} that serves the model {request.model!r} does not "
            "compute embeddings",
            param="model",
        )
    params = request.params
    # Checked in this order; (parameter, what is not supported) for the first refused one.
    refused: tuple[str, str] | None = None
    if (params.logprobs or params.top_logprobs > 0) and not capabilities.logprobs:
        refused = ("logprobs", "logprobs")
    elif capabilities.logprobs and params.top_logprobs > capabilities.max_top_logprobs:
        refused = (
            "top_logprobs" if request.kind == "chat" else "logprobs",
            f"more than {capabilities.max_top_logprobs} top logprobs",
        )
    elif params.echo and not capabilities.echo:
        refused = ("echo", "echo")
    elif params.top_k is not None and not capabilities.top_k:
        refused = ("top_k", "top_k")
    elif params.min_p > 0.0 and not capabilities.min_p:
        refused = ("min_p", "min_p")
    elif params.seed is not None and not capabilities.seed:
        refused = ("seed", "seed")
    elif params.presence_penalty != 0.0 and not capabilities.penalties:
        refused = ("presence_penalty", "presence_penalty")
    elif params.frequency_penalty != 0.0 and not capabilities.penalties:
        refused = ("frequency_penalty", "frequency_penalty")
    elif params.repetition_penalty != 1.0 and not capabilities.repetition_penalty:
        refused = ("repetition_penalty", "repetition_penalty")
    elif request.structured_outputs is not None and not capabilities.structured_outputs:
        field = request.structured_outputs["param"]
        refused = (field, f"structured outputs ({field})")
    elif request.tools and request.tool_choice != "none" and not capabilities.tools:
        refused = ("tools", "tool calling")
    elif request.resume is not None and not capabilities.resume:
        # A request that arrives with ``resume`` asked for it (vLLM's extension); the
        # router's own failover resumes skip such backends before this check.
        refused = ("continue_final_message", "continuing the final message (continue_final_message)")
    if refused is None:
        return None
    param, what = refused
    return UnsupportedParameterError(
        f"{what} is not supported by the backend {backend_name!r} that serves the "
        f"model {request.model!r}",
        param=param,
    )

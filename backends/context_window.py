"""The context-window check of the backends that run a model in this process (llama.cpp, MLX).

A prompt that fills the window, or a ``max_tokens`` that does not fit beside it, is a 400
``context_length_exceeded`` naming the parameter to shorten; without ``max_tokens`` the
request may use the rest of the window.
"""

from __future__ import annotations

from backends.base import GenerationRequest
from backends.errors import ContextLengthExceededError

__all__ = ["check_context"]


def check_context(request: GenerationRequest, num_prompt: int, n_ctx: int) -> int:
    """The effective ``max_tokens`` of ``request`` with ``num_prompt`` prompt tokens in a
    window of ``n_ctx``; ``ContextLengthExceededError`` when it cannot fit."""
    param = "messages" if request.kind == "chat" else "prompt"
    if num_prompt >= n_ctx:
        raise ContextLengthExceededError(
            f"this model's maximum context length is {n_ctx} tokens; the {param} "
            f"has {num_prompt} tokens, leaving no room for output",
            param=param,
        )
    max_tokens = request.params.max_tokens
    if max_tokens is None:
        return n_ctx - num_prompt
    if num_prompt + max_tokens > n_ctx:
        raise ContextLengthExceededError(
            f"this model's maximum context length is {n_ctx} tokens; you requested "
            f"{num_prompt + max_tokens} ({num_prompt} in the {param}, {max_tokens} for "
            f"the completion). Reduce the length of the {param} or of max_tokens.",
            param="max_tokens",
        )
    return max_tokens

"""The answers of ``kind = "tokenize"`` / ``"detokenize"`` requests (``POST /tokenize``,
``/detokenize``), shared by the backends that hold the model's tokenizer (core engine,
llama.cpp, MLX): each supplies its own encoding and decoding, the shapes and checks are here."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from backends.base import GenerationChunk, GenerationRequest, Usage
from backends.errors import InvalidRequestError

__all__ = ["as_prompt", "detokenized", "tokenized"]


def as_prompt(request: GenerationRequest) -> GenerationRequest:
    """A tokenize request as the generation request whose prompt it asks for (a chat when it
    has messages: the template rendered as a chat request would have it)."""
    return msgspec.structs.replace(request, kind="chat" if request.messages is not None else "completion")


def tokenized(token_ids: Sequence[int]) -> GenerationChunk:
    """The one chunk answering a tokenize request."""
    return GenerationChunk(
        token_ids=tuple(token_ids), finish_reason="stop", usage=Usage(prompt_tokens=len(token_ids), completion_tokens=0)
    )


def detokenized(request: GenerationRequest, n_vocab: int, decode: Callable[[list[int]], str]) -> GenerationChunk:
    """The one chunk answering a detokenize request: the text of its ids (``decode``); an id
    outside the vocabulary is a 400 naming ``tokens``."""
    ids = list(request.prompt) if isinstance(request.prompt, tuple) else []
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary (0..{n_vocab - 1})", param="tokens")
    return GenerationChunk(text=decode(ids), finish_reason="stop", usage=Usage(prompt_tokens=len(ids), completion_tokens=0))

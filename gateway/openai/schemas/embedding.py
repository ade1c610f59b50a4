"""Wire types of ``POST /v1/embeddings`` (OpenAI's embeddings)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = ["Embedding", "EmbeddingList", "EmbeddingRequest", "EmbeddingUsage"]

#: A string, a list of strings, a list of token ids, or a list of token-id lists.
EmbeddingInput = str | list[str | int | list[int]]


class EmbeddingRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The body of ``POST /v1/embeddings``."""

    model: str
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] | None = None
    #: Served only by backends whose model can give vectors of that size (a remote
    #: upstream decides; a native backend accepts its model's own size only).
    dimensions: Annotated[int, msgspec.Meta(ge=1, le=65536)] | None = None
    user: str | None = None


class Embedding(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One vector: floats, or base64 of its little-endian float32 bytes."""

    object: str = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The response body."""

    object: str = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage

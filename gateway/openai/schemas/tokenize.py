"""Wire types of ``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from gateway.openai.schemas.chat import ChatMessageParam

__all__ = ["DetokenizeRequest", "DetokenizeResponse", "TokenizeRequest", "TokenizeResponse"]

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """``{model, prompt}`` or ``{model, messages, add_generation_prompt}``: the tokens a
    completion of ``prompt`` (BOS where the model adds one) or a chat request of ``messages``
    (rendered with the model's template) would start from."""

    model: str
    prompt: str | None = None
    messages: Annotated[list[ChatMessageParam], msgspec.Meta(min_length=1)] | None = None
    #: Messages only: end with the template's assistant prefix, as a chat request does.
    add_generation_prompt: bool = True


class TokenizeResponse(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    count: int
    #: The context length of the backend that tokenized (None when it cannot tell).
    max_model_len: int | None
    tokens: list[int]


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    model: str
    tokens: list[TokenId]


class DetokenizeResponse(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    prompt: str

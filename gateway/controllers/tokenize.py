"""``POST /tokenize`` and ``POST /detokenize``: vLLM's token utilities, for native backends.

The request goes to the first backend of the alias (or the one pinned with
``x-infermux-backend``) that has the model's tokenizer (``Capabilities.tokenize``:
core_engine, llama.cpp), as a one-chunk ``generate`` of kind ``tokenize`` / ``detokenize``,
so it reaches an engine in its worker process the way generation does. Tokenizing a body of
up to ``[server] max_body_bytes`` costs the backend CPU like a prefill's prompt, so the
request is admitted as generation is (gateway/serving/admission.py: the key's
``max_concurrent`` and ``rpm``, a global slot or a place in the fair queue; refusals 429 /
503, answers carry the ``x-ratelimit-*`` headers), and the backends tokenize on a worker
thread, off the event loop that streams everyone else's tokens. It is otherwise no
generation: no plugin hooks, no usage record, no tokens charged (nothing is generated that
anyone pays for). The tokens are those a completion of ``prompt``, or a chat request of
``messages``, would start from.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from backends.base import Backend, ChatMessage, GenerationChunk, GenerationRequest
from backends.errors import InvalidRequestError, UnsupportedParameterError
from gateway.http.auth import api_key_guard, api_key_of
from gateway.http.request_id import request_id_of
from gateway.http.respond import BACKEND_HEADER
from gateway.openai.request_conversion import RequestContext, chat_generation_requests
from gateway.openai.schemas import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from gateway.state import GatewayState

__all__ = ["TokenizeController", "answer_admitted", "answer_once", "tokenizer_backend"]


class TokenizeController(Controller):
    """Token ids of a prompt or messages, and text of token ids."""

    path = ""
    tags = ["tokens"]
    guards = [api_key_guard]

    @post(
        "/tokenize",
        status_code=200,
        summary="Tokenize a prompt or chat messages",
        description="vLLM-compatible: `{model, prompt}` or `{model, messages, "
        "add_generation_prompt}` -> `{count, max_model_len, tokens}`. Native backends only.",
    )
    async def tokenize(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[TokenizeRequest],
        gateway: NamedDependency[GatewayState],
    ) -> Response[TokenizeResponse]:
        if (data.prompt is None) == (data.messages is None):
            raise InvalidRequestError("send either prompt or messages", param="prompt")
        messages: tuple[ChatMessage, ...] | None = None
        if data.messages is not None:
            # The chat path's own conversion (roles, content parts, [limits] max_messages).
            chat = ChatCompletionRequest(model=data.model, messages=data.messages)
            converted = chat_generation_requests(chat, _context(request, gateway))
            messages = converted[0].messages
        backend = tokenizer_backend(request, gateway, data.model)
        ask = GenerationRequest(
            request_id=request_id_of(request),
            model=data.model,
            kind="tokenize",
            messages=messages,
            prompt=data.prompt,
            add_generation_prompt=data.add_generation_prompt,
        )
        chunk, headers = await answer_admitted(request, gateway, backend, ask)
        tokens = list(chunk.token_ids)
        body = TokenizeResponse(
            count=len(tokens), max_model_len=backend.model_info().context_length, tokens=tokens
        )
        return Response(body, headers=headers)

    @post(
        "/detokenize",
        status_code=200,
        summary="Detokenize token ids",
        description="vLLM-compatible: `{model, tokens}` -> `{prompt}`. Native backends only.",
    )
    async def detokenize(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[DetokenizeRequest],
        gateway: NamedDependency[GatewayState],
    ) -> Response[DetokenizeResponse]:
        backend = tokenizer_backend(request, gateway, data.model)
        ask = GenerationRequest(
            request_id=request_id_of(request),
            model=data.model,
            kind="detokenize",
            prompt=tuple(data.tokens),
        )
        chunk, headers = await answer_admitted(request, gateway, backend, ask)
        return Response(DetokenizeResponse(prompt=chunk.text), headers=headers)


def _context(request: Request[Any, Any, Any], gateway: GatewayState) -> RequestContext:
    return RequestContext(request_id=request_id_of(request), limits=gateway.config.limits)


def tokenizer_backend(request: Request[Any, Any, Any], gateway: GatewayState, model: str) -> Backend:
    """The pinned backend, else the alias's first one with the model's tokenizer."""
    if not model.strip():
        raise InvalidRequestError("model must name a model (see GET /v1/models)", param="model")
    router = gateway.require_router()
    names = router.backend_names(model)  # 404 naming model when unknown
    pinned = request.headers.get(BACKEND_HEADER)
    if pinned:
        if pinned not in names:
            raise InvalidRequestError(
                f"the backend {pinned!r} (x-infermux-backend) does not serve the model "
                f"{model!r}; it is served by: {', '.join(names)}",
                param=None,
                code="unknown_backend",
            )
        names = [pinned]
    for name in names:
        backend = gateway.backends[name]
        if backend.capabilities.tokenize:
            return backend
    raise UnsupportedParameterError(
        f"no backend of the model {model!r} has its tokenizer here (tokenize is served by "
        "core_engine and llamacpp backends)",
        param="model",
    )


async def answer_admitted(
    request: Request[Any, Any, Any], gateway: GatewayState, backend: Backend, ask: GenerationRequest
) -> tuple[GenerationChunk, dict[str, str]]:
    """``backend``'s one chunk for ``ask``, admitted under the request's API key (a slot held
    while the backend works), and the key's ``x-ratelimit-*`` headers."""
    api_key = api_key_of(request)
    if api_key is not None:
        ask = msgspec.structs.replace(ask, tenant=api_key.tenant, api_key_id=api_key.id)
    grant = await gateway.admission.admit(api_key)
    try:
        return await answer_once(backend, ask), grant.headers
    finally:
        await grant.release()


async def answer_once(backend: Backend, ask: GenerationRequest) -> Any:
    stream = backend.generate(ask)
    try:
        async for chunk in stream:
            return chunk
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    raise RuntimeError(f"backend {backend.name!r} gave no answer")

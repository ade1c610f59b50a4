"""``POST /v1/messages/count_tokens``: the input tokens a Messages request would have.

The body is converted exactly as ``POST /v1/messages`` converts it (system, blocks, tools),
then the alias's first backend with the model's tokenizer renders and tokenizes it as a
generation would (``/tokenize``'s path: gateway/controllers/tokenize.py). Like ``/tokenize``
it is admitted as a generation is (per-key limits, a global slot, the fair queue) and
tokenized off the event loop, but leaves no usage record.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from gateway.anthropic.messages import messages_generation_request
from gateway.anthropic.schemas import CountTokensRequest, CountTokensResponse, MessagesRequest
from gateway.controllers.tokenize import answer_admitted, tokenizer_backend
from gateway.http.auth import api_key_guard
from gateway.http.request_id import request_id_of
from gateway.openai.request_conversion import RequestContext
from gateway.state import GatewayState

__all__ = ["CountTokensController"]


class CountTokensController(Controller):
    path = "/v1/messages"
    tags = ["anthropic"]
    guards = [api_key_guard]

    @post(
        "/count_tokens",
        status_code=200,
        summary="Count the input tokens of a message (Anthropic Messages API)",
        description="Anthropic-compatible: `{model, messages, system, tools}` -> `{input_tokens}`. "
        "Served by backends that have the model's tokenizer (core_engine, llamacpp).",
    )
    async def count_tokens(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[CountTokensRequest],
        gateway: NamedDependency[GatewayState],
    ) -> Response[CountTokensResponse]:
        body = MessagesRequest(
            model=data.model, max_tokens=1, messages=data.messages, system=data.system,
            tools=data.tools, tool_choice=data.tool_choice,
        )
        context = RequestContext(request_id=request_id_of(request), limits=gateway.config.limits)
        chat = messages_generation_request(body, context)
        backend = tokenizer_backend(request, gateway, data.model)
        ask = msgspec.structs.replace(chat, kind="tokenize", add_generation_prompt=True)
        chunk, headers = await answer_admitted(request, gateway, backend, ask)
        return Response(CountTokensResponse(input_tokens=len(chunk.token_ids)), headers=headers)

"""``POST /v1/chat/completions``."""

from __future__ import annotations

import time
from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from gateway.body_check import check_raw_body
from gateway.chat_output import ChatOutput
from gateway.generation_response import respond
from gateway.request_conversion import chat_generation_requests, header_labels
from gateway.request_id import request_id_of
from gateway.schemas import ChatCompletion, ChatCompletionRequest
from gateway.state import GatewayState

__all__ = ["ChatController"]


class ChatController(Controller):
    """Chat completions, streamed (SSE) or in one body."""

    path = "/v1/chat/completions"
    tags = ["generation"]

    @post(
        "",
        status_code=200,
        summary="Create a chat completion",
        description="OpenAI-compatible. Pin a backend with the `x-infermux-backend` header; "
        "the response's `x-infermux-backend` names the backend(s) that served.",
    )
    async def create_chat_completion(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[ChatCompletionRequest],
        gateway: NamedDependency[GatewayState],
    ) -> Response[ChatCompletion]:
        request_id = request_id_of(request)
        check_raw_body(await request.body())
        requests = chat_generation_requests(
            data,
            request_id=request_id,
            limits=gateway.config.limits,
            traceparent=request.headers.get("traceparent"),
            labels=header_labels(request.headers, gateway.config.plugins.request_headers),
        )
        stream = bool(data.stream)
        output = ChatOutput(
            response_id=f"chatcmpl-{request_id}",
            created=int(time.time()),
            model=data.model,
            num_choices=len(requests),
            logprobs=bool(data.logprobs),
            top_logprobs=data.top_logprobs or 0,
            include_usage=bool(
                stream and data.stream_options and data.stream_options.include_usage
            ),
        )
        return await respond(
            request,
            gateway,
            requests,
            output,
            n=data.n or 1,
            stream=stream,
            request_id=request_id,
        )

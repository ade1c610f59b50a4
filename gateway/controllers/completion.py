"""``POST /v1/completions`` (OpenAI's legacy text completions)."""

from __future__ import annotations

import time
from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from gateway.body_check import check_raw_body
from gateway.completion_output import CompletionOutput
from gateway.generation_response import respond
from gateway.request_conversion import completion_generation_requests, header_labels
from gateway.request_id import request_id_of
from gateway.schemas import Completion, CompletionRequest
from gateway.state import GatewayState

__all__ = ["CompletionController"]


class CompletionController(Controller):
    """Text completions, streamed (SSE) or in one body; ``echo`` and legacy logprobs."""

    path = "/v1/completions"
    tags = ["generation"]

    @post(
        "",
        status_code=200,
        summary="Create a text completion",
        description="OpenAI-compatible (legacy). `prompt` may be a string, a list of strings, "
        "token ids or lists of token ids; `echo` with `logprobs` scores the prompt.",
    )
    async def create_completion(
        self,
        request: Request[Any, Any, Any],
        data: JSONBody[CompletionRequest],
        gateway: NamedDependency[GatewayState],
    ) -> Response[Completion]:
        request_id = request_id_of(request)
        check_raw_body(await request.body())
        requests = completion_generation_requests(
            data,
            request_id=request_id,
            limits=gateway.config.limits,
            traceparent=request.headers.get("traceparent"),
            labels=header_labels(request.headers, gateway.config.plugins.request_headers),
        )
        stream = bool(data.stream)
        output = CompletionOutput(
            response_id=f"cmpl-{request_id}",
            created=int(time.time()),
            model=data.model,
            num_choices=len(requests),
            logprobs=data.logprobs,
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

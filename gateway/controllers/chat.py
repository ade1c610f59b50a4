"""``POST /v1/chat/completions`` (served by gateway/http/endpoint.py)."""

from __future__ import annotations

import time

from gateway.http.endpoint import GenerationEndpoint
from gateway.http.respond import Generation
from gateway.openai.chat_output import ChatOutput
from gateway.openai.request_conversion import (
    RequestContext,
    chat_generation_requests,
    usage_chunk_wanted,
)
from gateway.openai.schemas import ChatCompletion, ChatCompletionRequest

__all__ = ["CHAT_COMPLETIONS"]


def _prepare(data: ChatCompletionRequest, context: RequestContext) -> Generation:
    requests = chat_generation_requests(data, context)
    stream = bool(data.stream)
    output = ChatOutput(
        response_id=f"chatcmpl-{context.request_id}",
        created=int(time.time()),
        model=data.model,
        num_choices=len(requests),
        logprobs=bool(data.logprobs),
        top_logprobs=data.top_logprobs or 0,
        include_usage=usage_chunk_wanted(data),
    )
    return Generation(requests, output, data.n or 1, stream)


#: Chat completions, streamed (SSE) or in one body.
CHAT_COMPLETIONS = GenerationEndpoint(
    path="/v1/chat/completions",
    operation_id="V1ChatCompletionsCreateChatCompletion",
    summary="Create a chat completion",
    description="OpenAI-compatible. Pin a backend with the `x-infermux-backend` header; "
    "the response's `x-infermux-backend` names the backend(s) that served.",
    body_type=ChatCompletionRequest,
    response_type=ChatCompletion,
    prepare=_prepare,
)

"""``POST /v1/completions``, OpenAI's legacy text completions (served by
gateway/http/endpoint.py)."""

from __future__ import annotations

import time

from gateway.http.endpoint import GenerationEndpoint
from gateway.http.respond import Generation
from gateway.openai.completion_output import CompletionOutput
from gateway.openai.request_conversion import (
    RequestContext,
    completion_generation_requests,
    usage_chunk_wanted,
)
from gateway.openai.schemas import Completion, CompletionRequest

__all__ = ["COMPLETIONS"]


def _prepare(data: CompletionRequest, context: RequestContext) -> Generation:
    requests = completion_generation_requests(data, context)
    stream = bool(data.stream)
    output = CompletionOutput(
        response_id=f"cmpl-{context.request_id}",
        created=int(time.time()),
        model=data.model,
        num_choices=len(requests),
        logprobs=data.logprobs,
        include_usage=usage_chunk_wanted(data),
    )
    return Generation(requests, output, data.n or 1, stream)


#: Text completions, streamed (SSE) or in one body; ``echo`` and legacy logprobs.
COMPLETIONS = GenerationEndpoint(
    path="/v1/completions",
    operation_id="V1CompletionsCreateCompletion",
    summary="Create a text completion",
    description="OpenAI-compatible (legacy). `prompt` may be a string, a list of strings, "
    "token ids or lists of token ids; `echo` with `logprobs` scores the prompt.",
    body_type=CompletionRequest,
    response_type=Completion,
    prepare=_prepare,
)

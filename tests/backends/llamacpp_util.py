"""Requests and a collector shared by the llama.cpp backend tests."""

from __future__ import annotations

from backends.base import (
    Backend,
    ChatMessage,
    GenerationChunk,
    GenerationRequest,
    SamplingParams,
)


def _chat(text: str, **params: object) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        model="smollm2",
        kind="chat",
        messages=(ChatMessage(role="user", content=text),),
        params=SamplingParams(**params),  # type: ignore[arg-type]
    )


def _completion(prompt: str, **params: object) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        model="smollm2",
        kind="completion",
        prompt=prompt,
        params=SamplingParams(**params),  # type: ignore[arg-type]
    )


async def _collect(backend: Backend, request: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in backend.generate(request)]

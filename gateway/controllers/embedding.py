"""``POST /v1/embeddings`` (served by gateway/http/endpoint.py, as chat is).

An embeddings request is one :class:`~backends.base.GenerationRequest` of kind
``embedding`` carrying every input, so it takes the path of a one-choice chat request:
API key, admission and per-key limits, plugins (``transform_request``, the request and
attempt hooks, ``wrap_generate``), the router (capability check: a backend without
embeddings is refused with a 400 naming ``model``; retries, circuits, timeouts), the
worker-process boundary, the usage ledger (``kind = "embedding"``, input tokens only)
and a trace with the GenAI operation name ``embeddings``. The backend answers with one
chunk holding each input's vector as little-endian float32 bytes, which is what
``encoding_format = "base64"`` sends, so float and base64 answers carry the same numbers.
"""

from __future__ import annotations

import base64
from array import array

from backends.base import GenerationChunk, GenerationRequest
from backends.errors import InvalidRequestError
from gateway.http.endpoint import GenerationEndpoint
from gateway.http.respond import Generation
from gateway.openai.request_conversion import RequestContext
from gateway.openai.schemas import (
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    UsageInfo,
)
from gateway.openai.usage import usage_info
from gateway.serving.choices import ChoiceRun

__all__ = ["EMBEDDINGS", "EmbeddingOutput", "embedding_inputs"]

#: OpenAI's own cap on the inputs of one request.
MAX_INPUTS = 2048


def embedding_inputs(value: str | list[str | int | list[int]]) -> tuple[str | tuple[int, ...], ...]:
    """The inputs of ``input``: texts or token-id sequences (400 naming ``input``)."""
    if isinstance(value, str):
        inputs: list[str | tuple[int, ...]] = [value]
    elif not value:
        raise InvalidRequestError("input must not be empty", param="input")
    elif all(isinstance(v, str) for v in value):
        inputs = list(value)  # type: ignore[arg-type]
    elif all(isinstance(v, int) for v in value):
        inputs = [_token_ids(value, "input")]  # type: ignore[arg-type]
    elif all(isinstance(v, list) for v in value):
        inputs = [_token_ids(v, f"input[{i}]") for i, v in enumerate(value)]  # type: ignore[arg-type]
    else:
        raise InvalidRequestError(
            "input must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists",
            param="input",
        )
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequestError(f"input may hold at most {MAX_INPUTS} items", param="input")
    for i, item in enumerate(inputs):
        if isinstance(item, str) and not item:
            name = "input" if isinstance(value, str) else f"input[{i}]"
            raise InvalidRequestError("an input string must not be empty", param=name)
    return tuple(inputs)


def _token_ids(ids: list[int], param: str) -> tuple[int, ...]:
    if not ids:
        raise InvalidRequestError("a token-id input must not be empty", param=param)
    if any(token_id < 0 for token_id in ids):
        raise InvalidRequestError("token ids must be >= 0", param=param)
    return tuple(ids)


class EmbeddingOutput:
    """Collects the backend's one chunk of vectors; builds the OpenAI list body."""

    def __init__(self, *, model: str, num_inputs: int, encoding_format: str) -> None:
        self.model = model
        self.num_inputs = num_inputs
        self.encoding_format = encoding_format
        self._vectors: tuple[bytes, ...] = ()

    def add(self, position: int, chunk: GenerationChunk) -> None:
        if chunk.embeddings is not None:
            self._vectors = chunk.embeddings

    def body(self, run: ChoiceRun) -> EmbeddingList:
        if len(self._vectors) != self.num_inputs:  # a backend bug, not the client's
            raise RuntimeError(
                f"the backend returned {len(self._vectors)} embeddings for {self.num_inputs} inputs"
            )
        usage = usage_info(run.total_usage())
        return EmbeddingList(
            data=[
                Embedding(index=i, embedding=self._encode(vector))
                for i, vector in enumerate(self._vectors)
            ],
            model=self.model,
            usage=EmbeddingUsage(prompt_tokens=usage.prompt_tokens, total_tokens=usage.prompt_tokens),
        )

    def _encode(self, vector: bytes) -> list[float] | str:
        if self.encoding_format == "base64":
            return base64.b64encode(vector).decode("ascii")
        floats = array("f")
        floats.frombytes(vector)  # little-endian float32 on the machines torch and llama.cpp run on
        return floats.tolist()

    # Never streamed: the endpoint has no ``stream``.
    def start_frames(self) -> bytes:
        return b""

    def chunk_frames(self, position: int, chunk: GenerationChunk) -> bytes:
        return b""

    def end_frames(self, usage: UsageInfo) -> bytes:
        return b""


def _prepare(data: EmbeddingRequest, context: RequestContext) -> Generation:
    if not data.model.strip():
        raise InvalidRequestError("model must name a model (see GET /v1/models)", param="model")
    inputs = embedding_inputs(data.input)
    request = GenerationRequest(
        request_id=context.request_id,
        model=data.model,
        kind="embedding",
        inputs=inputs,
        dimensions=data.dimensions,
        user=data.user,
        traceparent=context.traceparent,
        labels=context.labels,
    )
    output = EmbeddingOutput(
        model=data.model, num_inputs=len(inputs), encoding_format=data.encoding_format or "float"
    )
    return Generation([request], output, 1, False)


#: Embeddings of one or many inputs, in one body.
EMBEDDINGS = GenerationEndpoint(
    path="/v1/embeddings",
    operation_id="V1EmbeddingsCreateEmbedding",
    summary="Create embeddings",
    description="OpenAI-compatible. `input` may be a string, a list of strings, token ids or "
    "lists of token ids; `encoding_format` float or base64 (little-endian float32). Served "
    "by backends with embeddings (core_engine, llamacpp, openai); others answer 400 naming "
    "`model`.",
    body_type=EmbeddingRequest,
    response_type=EmbeddingList,
    prepare=_prepare,
)

"""OpenAI's wire format as the ``openai`` backend speaks it: request bodies, stream chunks,
error bodies.

Lenient on purpose: unknown fields are ignored and most fields are optional, since vLLM,
SGLang, TensorRT-LLM, llama-server and OpenAI itself each add or omit a few. Decoded JSON
never forms reference cycles, so the types opt out of the cycle collector (``gc=False``:
cheaper to create and free; several per streamed token).
"""

from __future__ import annotations

import base64
import email.utils
import struct
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import httpx
import msgspec

from backends.base import (
    GenerationRequest,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from backends.chat_plan import message_dicts
from backends.errors import UnsupportedParameterError

__all__ = [
    "UpstreamEmbeddings",
    "ErrorBody",
    "StreamChunk",
    "UpstreamError",
    "UpstreamResponse",
    "chat_logprobs",
    "tool_call_deltas",
    "completion_logprobs",
    "read_error_body",
    "request_body",
    "retry_after_seconds",
]

_MAX_ERROR_BODY = 64 * 1024


class UpstreamResponse(Protocol):
    """What the backend reads of a response: ``httpx.Response`` and the native client's
    :class:`~backends._http1_transport.Http1Response` both offer it."""

    @property
    def status_code(self) -> int: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    def aiter_bytes(self) -> AsyncIterator[bytes]: ...
    async def aclose(self) -> None: ...


class TopLogprobEntry(msgspec.Struct, kw_only=True, gc=False):
    token: str = ""
    logprob: float = 0.0
    bytes: list[int] | None = None


class ContentLogprobEntry(msgspec.Struct, kw_only=True, gc=False):
    token: str = ""
    logprob: float | None = None
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprobEntry] | None = None


class ChoiceLogprobs(msgspec.Struct, kw_only=True, gc=False):
    # chat
    content: list[ContentLogprobEntry] | None = None
    # completions (legacy shape)
    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] | None = None


class FunctionDelta(msgspec.Struct, kw_only=True, gc=False):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaBody(msgspec.Struct, kw_only=True, gc=False):
    index: int = 0
    id: str | None = None
    function: FunctionDelta | None = None


class Delta(msgspec.Struct, kw_only=True, gc=False):
    role: str | None = None
    content: str | None = None
    #: A reasoning model's thinking: vLLM/SGLang/llama-server say reasoning_content, newer
    #: vLLM and OpenRouter reasoning.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDeltaBody] | None = None


def tool_call_deltas(items: list[ToolCallDeltaBody] | None) -> tuple[ToolCallDelta, ...]:
    """An upstream's ``delta.tool_calls``, as backend-neutral deltas."""
    return tuple(
        ToolCallDelta(
            index=item.index,
            id=item.id,
            name=item.function.name if item.function is not None else None,
            arguments=(item.function.arguments or "") if item.function is not None else "",
        )
        for item in items or ()
    )


class Choice(msgspec.Struct, kw_only=True, gc=False):
    index: int = 0
    delta: Delta | None = None  # chat
    text: str | None = None  # completions
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    #: vLLM's (and infermux's): the stop string that ended the output, or the stop token id.
    stop_reason: int | str | None = None


class PromptTokensDetails(msgspec.Struct, kw_only=True, gc=False):
    cached_tokens: int | None = None


class CompletionTokensDetails(msgspec.Struct, kw_only=True, gc=False):
    reasoning_tokens: int | None = None


class UsageBody(msgspec.Struct, kw_only=True, gc=False):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    def to_usage(self) -> Usage:
        details = self.prompt_tokens_details
        output = self.completion_tokens_details
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=details.cached_tokens if details is not None else None,
            reasoning_tokens=output.reasoning_tokens if output is not None else None,
        )


class UpstreamError(msgspec.Struct, kw_only=True, gc=False):
    message: str = ""
    type: str | None = None
    param: str | None = None
    code: Any = None


class StreamChunk(msgspec.Struct, kw_only=True, gc=False):
    choices: list[Choice] = []
    usage: UsageBody | None = None
    error: UpstreamError | None = None  # vLLM and others report mid-stream errors this way


class ErrorBody(msgspec.Struct, kw_only=True, gc=False):
    error: UpstreamError | str | None = None
    message: str | None = None
    detail: Any = None


_error_decoder = msgspec.json.Decoder(ErrorBody)


def chat_logprobs(logprobs: ChoiceLogprobs | None) -> tuple[TokenLogprob, ...] | None:
    if logprobs is None or logprobs.content is None:
        return None
    return tuple(
        TokenLogprob(
            token=entry.token,
            logprob=entry.logprob,
            bytes=entry.bytes,
            top_logprobs=tuple(
                TopLogprob(token=top.token, logprob=top.logprob, bytes=top.bytes)
                for top in entry.top_logprobs or ()
            ),
        )
        for entry in logprobs.content
    )


def completion_logprobs(logprobs: ChoiceLogprobs | None) -> tuple[TokenLogprob, ...] | None:
    if logprobs is None or logprobs.tokens is None:
        return None
    values = logprobs.token_logprobs or []
    tops = logprobs.top_logprobs or []
    offsets = logprobs.text_offset or []
    entries = []
    for i, token in enumerate(logprobs.tokens):
        top: dict[str, float] = (tops[i] or {}) if i < len(tops) else {}
        entries.append(
            TokenLogprob(
                token=token,
                logprob=values[i] if i < len(values) else None,
                top_logprobs=tuple(
                    TopLogprob(token=t, logprob=lp)
                    for t, lp in sorted(top.items(), key=lambda item: -item[1])
                ),
                text_offset=offsets[i] if i < len(offsets) else None,
            )
        )
    return tuple(entries)


class UpstreamEmbedding(msgspec.Struct, frozen=True, kw_only=True):
    """One vector of an upstream's embeddings answer: base64 (asked for) or floats (servers
    that ignore ``encoding_format``)."""

    index: int
    embedding: str | list[float]

    def to_bytes(self) -> bytes:
        """Little-endian float32 bytes, what the gateway answers with."""
        if isinstance(self.embedding, str):
            return base64.b64decode(self.embedding)
        return struct.pack(f"<{len(self.embedding)}f", *self.embedding)


class UpstreamEmbeddingUsage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int = 0


class UpstreamEmbeddings(msgspec.Struct, frozen=True, kw_only=True):
    """The body of an upstream's ``POST /embeddings`` answer (the fields infermux reads)."""

    data: list[UpstreamEmbedding]
    usage: UpstreamEmbeddingUsage | None = None


def request_body(request: GenerationRequest, *, model: str) -> tuple[str, bytes]:
    """Upstream path and JSON body for ``request`` (always streaming, with usage)."""
    params = request.params
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    want_logprobs = params.logprobs or params.top_logprobs > 0
    if request.kind == "chat":
        path = "/chat/completions"
        body["messages"] = message_dicts(request.messages)
        for item in body["messages"]:
            if item.get("tool_calls") and not item["content"]:
                item["content"] = None  # OpenAI's shape of a turn that only called tools
        if request.resume is not None:
            # vLLM's extension: the partial answer as the last, open assistant message;
            # the upstream streams only what comes after it.
            body["messages"].append({"role": "assistant", "content": request.resume.text})
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        if request.tools:
            body["tools"] = list(request.tools)
            body["tool_choice"] = (
                {"type": "function", "function": {"name": request.tool_function}}
                if request.tool_choice == "function"
                else request.tool_choice
            )
            if not request.parallel_tool_calls:
                body["parallel_tool_calls"] = False
        if request.reasoning_effort is not None:
            body["reasoning_effort"] = request.reasoning_effort
        if request.max_reasoning_tokens is not None:  # an extension: only when the client sent it
            body["max_reasoning_tokens"] = request.max_reasoning_tokens
        if want_logprobs:
            body["logprobs"] = True
            if params.top_logprobs:
                body["top_logprobs"] = params.top_logprobs
    else:
        path = "/completions"
        prompt = request.prompt
        if request.resume is not None and isinstance(prompt, str):
            prompt += request.resume.text  # a text prompt goes on where the answer broke
        body["prompt"] = list(prompt) if isinstance(prompt, tuple) else (prompt or "")
        if params.echo:
            # Echo is answered here from the prompt text; prompt logprobs would need the
            # upstream's echo, whose streamed shape differs between servers.
            if want_logprobs:
                raise UnsupportedParameterError(
                    "echo with logprobs is not supported by backends of kind 'openai'",
                    param="echo",
                )
            if not isinstance(prompt, str):
                raise UnsupportedParameterError(
                    "echo needs a text prompt on backends of kind 'openai'", param="echo"
                )
        if want_logprobs:
            body["logprobs"] = params.top_logprobs
    if params.max_tokens is not None:
        body["max_tokens"] = params.max_tokens
    body["temperature"] = params.temperature
    body["top_p"] = params.top_p
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.presence_penalty:
        body["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        body["frequency_penalty"] = params.frequency_penalty
    if request.user is not None:
        body["user"] = request.user
    if request.response_format is not None:
        body["response_format"] = request.response_format
    structured = request.structured_outputs
    if structured is not None and structured["param"] != "response_format":
        # vLLM's extension fields, passed through as the client sent them.
        value = {k: v for k, v in structured.items() if k != "param"}
        body[structured["param"]] = value if structured["param"] == "structured_outputs" else next(iter(value.values()))
    # vLLM/SGLang extensions: sent only when used, since OpenAI itself rejects them.
    if params.top_k:
        body["top_k"] = params.top_k
    if params.min_p:
        body["min_p"] = params.min_p
    if params.repetition_penalty != 1.0:
        body["repetition_penalty"] = params.repetition_penalty
    if params.ignore_eos:
        body["ignore_eos"] = True
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    return path, msgspec.json.encode(body)


async def read_error_body(response: UpstreamResponse) -> tuple[str, str | None, str | None]:
    """Message, param and code of an upstream error body (bounded read)."""
    raw = b""
    try:
        async for piece in response.aiter_bytes():
            raw += piece
            if len(raw) > _MAX_ERROR_BODY:
                break
    except httpx.HTTPError:
        pass
    status = response.status_code
    fallback = f"the upstream answered HTTP {status}"
    try:
        body = _error_decoder.decode(raw[:_MAX_ERROR_BODY])
    except msgspec.DecodeError:
        text = raw[:500].decode("utf-8", errors="replace").strip()
        return (text or fallback), None, None
    error = body.error
    if isinstance(error, str):
        return error, None, None
    if error is not None:
        code = error.code if isinstance(error.code, str) else None
        return error.message or fallback, error.param, code
    if body.message:
        return body.message, None, None
    if isinstance(body.detail, str):
        return body.detail, None, None
    return fallback, None, None


def retry_after_seconds(headers: Mapping[str, str]) -> float | None:
    """Seconds from ``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP date)."""
    value = headers.get("retry-after-ms")
    if value is not None:
        try:
            return max(0.0, float(value) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())

"""The ``openai`` backend: any OpenAI-compatible server (vLLM, SGLang, TensorRT-LLM,
llama-server, another infermux) reached over HTTP with ``httpx``.

The client is ``httpx.AsyncClient``; for ``http://`` upstreams its transport is
:class:`backends._http1_transport.Http1Transport` (lean keep-alive HTTP/1.1; the option
``http_transport = "httpx"`` selects httpx's default one). Upstream requests always stream
(``stream: true`` with ``stream_options.include_usage``), whatever the client asked, so the
first token is seen as soon as it exists and usage arrives in the last event; the gateway
assembles non-streaming answers. Closing the iterator closes the upstream response, which
makes the upstream abort the generation.

Errors are translated here, at the boundary::

    connection refused / reset before a response  -> BackendUnavailableError   (retryable)
    connect timeout, no first event in time        -> UpstreamTimeoutError      (retryable)
    429 (+ Retry-After)                            -> UpstreamRateLimitError    (retryable)
    5xx, error event before any output             -> UpstreamStatusError       (retryable)
    401/403 (the gateway's upstream key is bad)    -> BackendError
    other 4xx                                      -> InvalidRequestError / NotFoundError,
                                                      with the upstream's message and param
    silence between events past the idle timeout   -> StreamIdleTimeoutError
    stream broken or cut short after output began  -> BackendError
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Literal

import httpx
import msgspec

from backends._http1_transport import Http1Transport
from backends._openai_wire import (
    StreamChunk,
    chat_logprobs,
    completion_logprobs,
    read_error_body,
    request_body,
    retry_after_seconds,
)
from backends._option import BackendOptionError, decode_options
from backends._sse import SSEParser
from backends.base import (
    BackendConfig,
    Capabilities,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
    ModelInfo,
    Usage,
)
from backends.errors import (
    BackendError,
    BackendUnavailableError,
    InfermuxError,
    InvalidRequestError,
    NotFoundError,
    RequestTooLargeError,
    StreamIdleTimeoutError,
    UpstreamRateLimitError,
    UpstreamStatusError,
    UpstreamTimeoutError,
)

__all__ = ["OpenAICompatBackend", "OpenAICompatOptions", "create_backend"]

# After ``[DONE]`` only the end of the chunked body should follow, at once; an upstream that
# holds the body open costs this much before the last chunk, then loses keep-alive.
_DRAIN_TIMEOUT_S = 0.05
_FINISH_REASONS = frozenset({"stop", "length", "abort", "error", "tool_calls", "content_filter"})
_chunk_decoder = msgspec.json.Decoder(StreamChunk)


class OpenAICompatOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a ``kind = "openai"`` backend."""

    #: The upstream's API root, e.g. ``http://10.0.0.5:8000/v1``.
    base_url: str
    #: The upstream's model name (default: the alias the client asked for).
    model: str | None = None
    #: NAME of the environment variable holding the upstream API key (never the key itself).
    api_key_env: str | None = None
    #: Extra headers sent upstream with every request.
    headers: dict[str, str] = {}
    #: Reported by ``model_info()`` (the upstream's own limit still applies).
    context_length: int | None = None
    max_connections: int = 256
    verify_tls: bool = True
    #: ``native``: infermux's lean HTTP/1.1 transport for ``http://`` upstreams (about a
    #: sixth of httpcore's CPU per streamed request); ``httpx``: httpx's default transport.
    #: ``https://`` always uses httpx's default transport.
    http_transport: Literal["native", "httpx"] = "native"


class OpenAICompatBackend:
    """A remote OpenAI-compatible server; see the module docstring for error mapping."""

    kind = "openai"

    def __init__(self, config: BackendConfig) -> None:
        self.name = config.name
        self.config = config
        self.options = decode_options(config, OpenAICompatOptions)
        prefix = f"backends.{config.name}.options"
        url = httpx.URL(self.options.base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise BackendOptionError(
                f"{prefix}.base_url: expected an http(s) URL such as http://host:8000/v1, "
                f"got {self.options.base_url!r}"
            )
        if any(h.lower() == "authorization" for h in self.options.headers):
            raise BackendOptionError(
                f"{prefix}.headers: put the key in an environment variable and name it in "
                f"{prefix}.api_key_env instead of an Authorization header"
            )
        # Structured outputs pass through: the upstream (vLLM, SGLang...) enforces and
        # validates them, and its 400 comes back to the client with its message.
        self.capabilities = Capabilities(
            logprobs=True, echo=True, structured_outputs=True, max_top_logprobs=20
        )
        self._base_url = self.options.base_url.rstrip("/")
        self._client: httpx.AsyncClient | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the connection pool (nothing is sent until the first request)."""
        if self._client is not None:
            return
        headers = dict(self.options.headers)
        env_name = self.options.api_key_env
        if env_name is not None:
            key = os.environ.get(env_name)
            if not key:
                raise BackendUnavailableError(
                    f"backend {self.name!r}: the environment variable {env_name} named by "
                    f"backends.{self.name}.options.api_key_env is not set"
                )
            headers["authorization"] = f"Bearer {key}"
        config = self.config
        limits = httpx.Limits(
            max_connections=self.options.max_connections,
            max_keepalive_connections=self.options.max_connections,
        )
        # Reads are bounded by our own first-byte / idle / total deadlines, not httpx's.
        timeout = httpx.Timeout(
            connect=config.connect_timeout,
            read=None,
            write=config.connect_timeout,
            pool=config.first_byte_timeout,
        )
        transport = None
        if self.options.http_transport == "native" and self._base_url.startswith("http://"):
            transport = Http1Transport(max_connections=self.options.max_connections)
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=timeout,
            limits=limits,
            verify=self.options.verify_tls,
            transport=transport,
        )

    def model_info(self) -> ModelInfo:
        """The upstream model name and the configured context length."""
        return ModelInfo(
            id=self.options.model or self.name,
            context_length=self.options.context_length,
            owned_by="upstream",
        )

    async def health(self) -> HealthStatus:
        """``GET {base_url}/models`` answers 200."""
        client = await self._ensure_client()
        try:
            response = await client.get(f"{self._base_url}/models", timeout=5.0)
        except httpx.HTTPError as exc:
            return HealthStatus(ok=False, detail=f"{type(exc).__name__}: {exc}")
        return HealthStatus(ok=response.status_code == 200, detail=f"HTTP {response.status_code}")

    async def aclose(self) -> None:
        """Close the connection pool. Idempotent."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def _ensure_client(self) -> httpx.AsyncClient:
        if self._client is None:
            await self.start()
        assert self._client is not None
        return self._client

    # -- serving --------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream one choice from the upstream; closing the iterator closes the upstream stream."""
        return self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        client = await self._ensure_client()
        path, body = request_body(request, model=self.options.model or request.model)
        headers = {"x-request-id": request.request_id}
        if request.traceparent:
            headers["traceparent"] = request.traceparent
        http_request = client.build_request(
            "POST", self._base_url + path, content=body, headers=headers
        )
        config = self.config
        started = time.monotonic()
        total_deadline = _earliest(
            started + config.total_timeout if config.total_timeout is not None else None,
            request.deadline,
        )
        first_deadline = _earliest(
            started + config.first_byte_timeout if config.first_byte_timeout is not None else None,
            total_deadline,
        )
        response = await self._send(client, http_request, first_deadline)
        try:
            if response.status_code != 200:
                raise await self._status_error(response)
            async for chunk in self._events(
                request, response, first_deadline=first_deadline, total_deadline=total_deadline
            ):
                yield chunk
        finally:
            await response.aclose()

    async def _send(
        self, client: httpx.AsyncClient, http_request: httpx.Request, deadline: float | None
    ) -> httpx.Response:
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                return await client.send(http_request, stream=True)
        except TimeoutError as exc:
            raise UpstreamTimeoutError(
                f"backend {self.name!r}: no response from {http_request.url.host} within the "
                "first-byte timeout"
            ) from exc
        except httpx.TimeoutException as exc:
            raise UpstreamTimeoutError(
                f"backend {self.name!r}: timed out connecting to {http_request.url.host}: {exc}"
            ) from exc
        except httpx.HTTPError as exc:
            raise BackendUnavailableError(
                f"backend {self.name!r}: cannot reach {http_request.url.host}:"
                f"{http_request.url.port}: {type(exc).__name__}: {exc}"
            ) from exc

    async def _events(
        self,
        request: GenerationRequest,
        response: httpx.Response,
        *,
        first_deadline: float | None,
        total_deadline: float | None,
    ) -> AsyncIterator[GenerationChunk]:
        is_chat = request.kind == "chat"
        idle_timeout = self.config.idle_timeout
        parser = SSEParser()
        stream = response.aiter_bytes()
        # Completions ``echo`` goes out with the first real output, never before it: a chunk
        # sent before the upstream answered would hide a failure from the router's retries.
        pending_prompt: str | None = (
            request.prompt if request.params.echo and isinstance(request.prompt, str) else None
        )
        has_output = False
        finish_reason: FinishReason | None = None
        usage: Usage | None = None
        done = False
        while not done:
            if has_output:
                deadline = _earliest(
                    time.monotonic() + idle_timeout if idle_timeout is not None else None,
                    total_deadline,
                )
            else:
                deadline = first_deadline
            try:
                async with asyncio.timeout_at(_loop_time(deadline)):
                    data = await anext(stream, None)
            except TimeoutError as exc:
                raise self._timeout_error(
                    has_output, total_deadline is not None and deadline == total_deadline
                ) from exc
            except httpx.HTTPError as exc:
                raise self._broken_error(has_output, f"{type(exc).__name__}: {exc}") from exc
            payloads = parser.feed(data) if data is not None else parser.close()
            for payload in payloads:
                if payload == b"[DONE]":
                    done = True
                    break
                try:
                    event = _chunk_decoder.decode(payload)
                except msgspec.DecodeError as exc:
                    raise self._broken_error(has_output, f"undecodable event: {exc}") from exc
                if event.error is not None:
                    raise self._broken_error(has_output, f"error event: {event.error.message}")
                if event.usage is not None:
                    usage = event.usage.to_usage()
                if not event.choices:
                    continue
                choice = event.choices[0]
                if choice.finish_reason is not None:
                    reason = choice.finish_reason
                    finish_reason = reason if reason in _FINISH_REASONS else "stop"  # type: ignore[assignment]
                if is_chat:
                    text = choice.delta.content if choice.delta is not None else None
                    logprobs = chat_logprobs(choice.logprobs)
                else:
                    text = choice.text
                    logprobs = completion_logprobs(choice.logprobs)
                if text or logprobs:
                    has_output = True
                    yield GenerationChunk(
                        text=text or "", logprobs=logprobs, prompt_text=pending_prompt
                    )
                    pending_prompt = None
            if data is None:
                break
        if done:
            await _drain(stream)
        if finish_reason is None:
            raise self._broken_error(has_output, "the upstream closed the stream before finishing")
        if pending_prompt is not None:
            yield GenerationChunk(prompt_text=pending_prompt)
        yield GenerationChunk(finish_reason=finish_reason, usage=usage)

    def _timeout_error(self, has_output: bool, total_was_binding: bool) -> InfermuxError:
        # Decided by which deadline was binding, not by re-reading the clock: the loop may
        # fire a timer up to its clock resolution early.
        if total_was_binding:
            return UpstreamTimeoutError(f"backend {self.name!r}: the total timeout passed")
        if not has_output:
            return UpstreamTimeoutError(
                f"backend {self.name!r}: no output within the first-byte timeout"
            )
        return StreamIdleTimeoutError(
            f"backend {self.name!r}: the stream was silent longer than the idle timeout "
            f"({self.config.idle_timeout} s)"
        )

    def _broken_error(self, has_output: bool, detail: str) -> InfermuxError:
        message = f"backend {self.name!r}: the upstream stream broke: {detail}"
        # Before any output the router may still try elsewhere; after, it must not.
        return BackendError(message) if has_output else UpstreamStatusError(message)

    async def _status_error(self, response: httpx.Response) -> InfermuxError:
        status = response.status_code
        message, param, code = await read_error_body(response)
        retry_after = retry_after_seconds(response.headers)
        where = f"backend {self.name!r}"
        if status == 429:
            return UpstreamRateLimitError(
                f"{where}: the upstream is rate limiting: {message}", retry_after=retry_after
            )
        if status >= 500:
            return UpstreamStatusError(
                f"{where}: the upstream answered {status}: {message}", retry_after=retry_after
            )
        if status in (401, 403):
            return BackendError(
                f"{where}: the upstream refused the gateway's credentials ({status}): {message}; "
                f"check backends.{self.name}.options.api_key_env"
            )
        if status == 404:
            return NotFoundError(message, param=param, code=code)
        if status == 408:
            return UpstreamTimeoutError(f"{where}: the upstream timed out (408): {message}")
        if status == 413:
            return RequestTooLargeError(message, param=param)
        if status >= 400:
            return InvalidRequestError(message, param=param, code=code)
        return UpstreamStatusError(f"{where}: unexpected upstream status {status}")


async def _drain(stream: AsyncIterator[bytes]) -> None:
    """Read what follows ``[DONE]`` (the closing chunk) so the connection can be reused."""
    try:
        async with asyncio.timeout(_DRAIN_TIMEOUT_S):
            async for _ in stream:
                pass
    except (TimeoutError, httpx.HTTPError):
        pass  # the connection is closed instead of pooled; nothing is lost


def _earliest(*deadlines: float | None) -> float | None:
    present = [d for d in deadlines if d is not None]
    return min(present) if present else None


def _loop_time(deadline: float | None) -> float | None:
    """A ``time.monotonic()`` deadline in the running loop's clock (for ``asyncio.timeout_at``)."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


def create_backend(config: BackendConfig) -> OpenAICompatBackend:
    """Factory registered for kind ``"openai"``."""
    return OpenAICompatBackend(config)

"""The ``openai`` backend: any OpenAI-compatible server (vLLM, SGLang, TensorRT-LLM,
llama-server, another infermux) reached over HTTP.

``http://`` upstreams are reached through :class:`backends._http1_transport.Http1Pool` (lean
keep-alive HTTP/1.1), ``https://`` ones (and any, with the option ``http_transport =
"httpx"``) through ``httpx.AsyncClient``; both answer with the same response surface, so
everything after sending is shared. Upstream requests always stream (``stream: true``
with ``stream_options.include_usage``), whatever the client asked, so the
first token is seen as soon as it exists and usage arrives in the last event; the gateway
assembles non-streaming answers (for those, the text events of one network read go on as one
chunk with its ``token_count``: the gateway's work per chunk is then paid per read, not per
token). Closing the iterator closes the upstream response, which
makes the upstream abort the generation.

Each upstream exchange is closed exactly once, by its one exit (``response.aclose()`` in a
``finally``), whichever of the deadlines here, the router's stream timer, a client's
disconnect or an abort cancels the request's task first, and however close together they
land: over httpx the network I/O and the close run in the exchange's own task, which those
cancellations never reach (:mod:`backends._upstream_exchange`); the native client's
clean-ups are synchronous, out of their reach by construction.

Errors are translated here, at the boundary::

    connection refused / reset before a response  -> BackendUnavailableError   (retryable)
    connect timeout, no first event in time        -> UpstreamTimeoutError      (retryable)
    429 (+ Retry-After)                            -> UpstreamRateLimitError    (retryable)
    5xx, error event before any output             -> UpstreamStatusError       (retryable)
    401/403 (the gateway's upstream key is bad)    -> BackendError
    other 4xx                                      -> InvalidRequestError / NotFoundError,
                                                      with the upstream's message and param
    silence between events past the idle timeout   -> StreamIdleTimeoutError    (resumable)
    stream broken or cut short after output began  -> UpstreamStreamBrokenError (resumable)
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import AsyncIterator
from typing import Literal

import httpx
import msgspec

from backends._http1_transport import Http1Pool
from backends._openai_wire import (
    StreamChunk,
    UpstreamEmbeddings,
    UpstreamResponse,
    chat_logprobs,
    completion_logprobs,
    read_error_body,
    request_body,
    retry_after_seconds,
    tool_call_deltas,
)
from backends._option import BackendOptionError, decode_options
from backends._sse import SSEParser
from backends._upstream_exchange import HttpxExchange
from backends.base import (
    BackendConfig,
    Capabilities,
    FinishReason,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
    ModelInfo,
    ToolCallDelta,
    Usage,
)
from backends.deadline import Deadline, earliest
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
    UpstreamStreamBrokenError,
    UpstreamTimeoutError,
)

__all__ = ["OpenAICompatBackend", "OpenAICompatOptions", "create_backend"]

# After ``[DONE]`` only the end of the chunked body should follow, at once; an upstream that
# holds the body open costs this much before the last chunk, then loses keep-alive.
_DRAIN_TIMEOUT_S = 0.05
_FINISH_REASONS = frozenset({"stop", "length", "abort", "error", "tool_calls", "content_filter"})
_chunk_decoder = msgspec.json.Decoder(StreamChunk)
_HEALTH_TIMEOUT_S = 5.0
#: Sent with every request of the native client (httpx sends its own defaults).
_NATIVE_HEADERS = {"content-type": "application/json", "user-agent": "infermux"}


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
    #: Check the upstream's certificate on ``https://`` (against ``ca_bundle`` when given,
    #: else the system's trusted CAs).
    verify_tls: bool = True
    #: Path of a PEM file of the CA certificates to trust for an ``https://`` upstream (a
    #: private CA); replaces the default trust store.
    ca_bundle: str | None = None
    #: ``native``: infermux's lean HTTP/1.1 client for ``http://`` upstreams (a fraction of
    #: httpx's CPU per streamed request); ``httpx``: httpx's client and default transport.
    #: ``https://`` always uses httpx.
    http_transport: Literal["native", "httpx"] = "native"
    #: The upstream accepts vLLM's chat extension ``continue_final_message`` (vLLM, SGLang,
    #: another infermux): the backend then honours ``GenerationRequest.resume``, so an answer
    #: another backend began (mid-stream failover) or a client's partial assistant message
    #: continues there. Off: a chat is never resumed here.
    continue_final_message: bool = False


def _tls_context(ca_bundle: str, param: str) -> ssl.SSLContext:
    """A verifying client context that trusts the CAs of the PEM file ``ca_bundle``."""
    try:
        return ssl.create_default_context(cafile=ca_bundle)
    except (OSError, ssl.SSLError) as exc:
        raise BackendOptionError(
            f"{param}: cannot load CA certificates from {ca_bundle!r}: {exc}"
        ) from exc


class _Events:
    """What the events of one upstream stream said so far."""

    __slots__ = (
        "is_chat",
        "pending_prompt",
        "has_output",
        "finish_reason",
        "stop_sequence",
        "usage",
        "done",
        "error",
    )

    def __init__(self, request: GenerationRequest) -> None:
        self.is_chat = request.kind == "chat"
        # Completions ``echo`` goes out with the first real output, never before it: a chunk
        # sent before the upstream answered would hide a failure from the router's retries.
        self.pending_prompt: str | None = (
            request.prompt if request.params.echo and isinstance(request.prompt, str) else None
        )
        self.has_output = False
        self.finish_reason: FinishReason | None = None
        #: The upstream's ``stop_reason`` when it names a stop string (a token id does not).
        self.stop_sequence: str | None = None
        self.usage: Usage | None = None
        #: ``[DONE]`` arrived.
        self.done = False
        #: A broken event: raised once the chunks before it went out.
        self.error: InfermuxError | None = None


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
        if self.options.ca_bundle is not None:
            if url.scheme != "https":
                raise BackendOptionError(
                    f"{prefix}.ca_bundle: only an https:// base_url uses a CA bundle"
                )
            if not self.options.verify_tls:
                raise BackendOptionError(
                    f"{prefix}.ca_bundle: verify_tls = false would ignore it; drop one of them"
                )
            self._tls: ssl.SSLContext | None = _tls_context(self.options.ca_bundle, f"{prefix}.ca_bundle")
        else:
            self._tls = None
        # Structured outputs pass through: the upstream (vLLM, SGLang...) enforces and
        # validates them, and its 400 comes back to the client with its message.
        # Embeddings pass through to the upstream's /embeddings (``dimensions`` included:
        # the upstream decides whether its model can shorten its vectors).
        self.capabilities = Capabilities(
            logprobs=True,
            echo=True,
            structured_outputs=True,
            tools=True,
            embeddings=True,
            resume=self.options.continue_final_message,
            max_top_logprobs=20,
        )
        self._base_url = self.options.base_url.rstrip("/")
        #: For the native client: where the upstream listens and its API root's path.
        self._host = url.host
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._base_path = url.raw_path.decode("ascii").rstrip("/")
        self._native = self.options.http_transport == "native" and url.scheme == "http"
        self._pool: Http1Pool | None = None
        self._client: httpx.AsyncClient | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the connection pool (nothing is sent until the first request)."""
        if self._pool is not None or self._client is not None:
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
        if self._native:
            self._pool = Http1Pool(
                self._host,
                self._port,
                headers={**_NATIVE_HEADERS, **headers},
                max_connections=self.options.max_connections,
            )
            return
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
        verify: ssl.SSLContext | bool = self._tls or self.options.verify_tls
        self._client = httpx.AsyncClient(
            headers=headers, timeout=timeout, limits=limits, verify=verify
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
        try:
            async with asyncio.timeout(_HEALTH_TIMEOUT_S):
                response = await self._open("GET", "/models", b"", {})
                try:
                    async for _ in response.aiter_bytes():
                        pass
                finally:
                    await response.aclose()
        except TimeoutError:
            return HealthStatus(ok=False, detail=f"no answer within {_HEALTH_TIMEOUT_S:g} s")
        except httpx.HTTPError as exc:
            return HealthStatus(ok=False, detail=f"{type(exc).__name__}: {exc}")
        return HealthStatus(ok=response.status_code == 200, detail=f"HTTP {response.status_code}")

    async def aclose(self) -> None:
        """Close the connection pool. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.aclose()
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    # -- serving --------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream one choice from the upstream; closing the iterator closes the upstream stream."""
        if request.kind == "embedding":
            return self._embed(request)
        return self._generate(request)

    async def _embed(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """``POST {base_url}/embeddings`` with every input, asking for base64 (the bytes the
        gateway answers with); one chunk with the vectors in input order."""
        body: dict[str, object] = {
            "model": self.options.model or request.model,
            "input": [list(i) if isinstance(i, tuple) else i for i in request.inputs or ()],
            "encoding_format": "base64",
        }
        if request.dimensions is not None:
            body["dimensions"] = request.dimensions
        if request.user is not None:
            body["user"] = request.user
        headers = {"x-request-id": request.request_id}
        if request.traceparent:
            headers["traceparent"] = request.traceparent
        config = self.config
        started = time.monotonic()
        total_deadline = earliest(
            started + config.total_timeout if config.total_timeout is not None else None,
            request.deadline,
        )
        first_deadline = earliest(
            started + config.first_byte_timeout if config.first_byte_timeout is not None else None,
            total_deadline,
        )
        response = await self._send("/embeddings", msgspec.json.encode(body), headers, first_deadline)
        try:
            if response.status_code != 200:
                raise await self._status_error(response)
            parts: list[bytes] = []
            try:
                with Deadline(total_deadline):
                    async for data in response.aiter_bytes():
                        parts.append(data)
            except TimeoutError as exc:
                raise UpstreamTimeoutError(f"backend {self.name!r}: the total timeout passed") from exc
            except httpx.HTTPError as exc:
                raise self._broken_error(False, f"{type(exc).__name__}: {exc}") from exc
        finally:
            await response.aclose()
        try:
            answer = msgspec.json.decode(b"".join(parts), type=UpstreamEmbeddings)
        except msgspec.DecodeError as exc:
            raise UpstreamStatusError(f"backend {self.name!r}: the upstream's embeddings body is malformed: {exc}") from exc
        num_inputs = len(request.inputs or ())
        if len(answer.data) != num_inputs:
            raise UpstreamStatusError(
                f"backend {self.name!r}: the upstream returned {len(answer.data)} embeddings for {num_inputs} inputs"
            )
        vectors = tuple(item.to_bytes() for item in sorted(answer.data, key=lambda item: item.index))
        prompt_tokens = answer.usage.prompt_tokens if answer.usage is not None else 0
        yield GenerationChunk(
            embeddings=vectors, finish_reason="stop", usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=0)
        )

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        path, body = request_body(request, model=self.options.model or request.model)
        headers = {"x-request-id": request.request_id}
        if request.traceparent:
            headers["traceparent"] = request.traceparent
        config = self.config
        started = time.monotonic()
        total_deadline = earliest(
            started + config.total_timeout if config.total_timeout is not None else None,
            request.deadline,
        )
        first_deadline = earliest(
            started + config.first_byte_timeout if config.first_byte_timeout is not None else None,
            total_deadline,
        )
        response = await self._send(path, body, headers, first_deadline)
        try:
            if response.status_code != 200:
                raise await self._status_error(response)
            # One generator from the network reads to the chunks (each layer of async
            # generators costs an exception per chunk); events become chunks in _take.
            events = _Events(request)
            # Nobody sees the chunks of an answer sent in one body: the events of one read
            # go on as one chunk, which is most of the gateway's work per token saved.
            merge = not request.stream
            idle_timeout = config.idle_timeout
            parser = SSEParser()
            stream = response.aiter_bytes()
            while not events.done:
                if events.has_output:
                    deadline = earliest(
                        time.monotonic() + idle_timeout if idle_timeout is not None else None,
                        total_deadline,
                    )
                else:
                    deadline = first_deadline
                try:
                    with Deadline(deadline):
                        data = await anext(stream, None)
                except TimeoutError as exc:
                    raise self._timeout_error(
                        events.has_output,
                        total_deadline is not None and deadline == total_deadline,
                    ) from exc
                except httpx.HTTPError as exc:
                    raise self._broken_error(
                        events.has_output, f"{type(exc).__name__}: {exc}"
                    ) from exc
                for chunk in self._take(
                    events, parser.feed(data) if data is not None else parser.close(), merge
                ):
                    yield chunk
                if events.error is not None:
                    raise events.error
                if data is None:
                    break
            if events.done:
                await _drain(stream)
            if events.finish_reason is None:
                raise self._broken_error(
                    events.has_output, "the upstream closed the stream before finishing"
                )
            if events.pending_prompt is not None:
                yield GenerationChunk(prompt_text=events.pending_prompt)
            yield GenerationChunk(
                finish_reason=events.finish_reason, stop_sequence=events.stop_sequence, usage=events.usage
            )
        finally:
            await response.aclose()

    def _take(self, events: _Events, payloads: list[bytes], merge: bool) -> list[GenerationChunk]:
        """The output chunks of ``payloads``. A broken event sets ``events.error`` (raised
        after the chunks before it went out) and stops; ``[DONE]`` sets ``events.done``.
        With ``merge``, each run of plain text events becomes one chunk."""
        chunks: list[GenerationChunk] = []
        #: Texts of the run of plain text events not yet made a chunk (``merge``).
        texts: list[str] = []
        is_chat = events.is_chat
        for payload in payloads:
            if payload == b"[DONE]":
                events.done = True
                break
            try:
                event = _chunk_decoder.decode(payload)
            except msgspec.DecodeError as exc:
                events.error = self._broken_error(events.has_output, f"undecodable event: {exc}")
                events.error.__cause__ = exc
                break
            if event.error is not None:
                events.error = self._broken_error(
                    events.has_output, f"error event: {event.error.message}"
                )
                break
            if event.usage is not None:
                events.usage = event.usage.to_usage()
            if not event.choices:
                continue
            choice = event.choices[0]
            if choice.finish_reason is not None:
                reason = choice.finish_reason
                events.finish_reason = reason if reason in _FINISH_REASONS else "stop"  # type: ignore[assignment]
                if isinstance(choice.stop_reason, str):
                    events.stop_sequence = choice.stop_reason
            reasoning = ""
            calls: tuple[ToolCallDelta, ...] = ()
            if is_chat:
                delta = choice.delta
                text = delta.content if delta is not None else None
                if delta is not None:
                    reasoning = delta.reasoning_content or delta.reasoning or ""
                    calls = tool_call_deltas(delta.tool_calls)
            else:
                text = choice.text
            logprobs = None
            if choice.logprobs is not None:
                logprobs = (chat_logprobs if is_chat else completion_logprobs)(choice.logprobs)
            if not (text or logprobs or reasoning or calls):
                continue
            events.has_output = True
            if reasoning or calls:  # not merged: each piece has its place in the answer
                if texts:
                    chunks.append(_text_chunk(texts))
                    texts = []
                chunks.append(GenerationChunk(text=text or "", reasoning=reasoning, tool_calls=calls, logprobs=logprobs))
                continue
            if merge and logprobs is None and events.pending_prompt is None:
                texts.append(text)  # type: ignore[arg-type]
                continue
            if texts:
                chunks.append(_text_chunk(texts))
                texts = []
            chunks.append(
                GenerationChunk(
                    text=text or "", logprobs=logprobs, prompt_text=events.pending_prompt
                )
            )
            events.pending_prompt = None
        if texts:
            chunks.append(_text_chunk(texts))
        return chunks

    async def _open(
        self, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> UpstreamResponse:
        """Send a request to ``{base_url}{path}``; the response body is still to be read.
        Always ``aclose()`` the response; cancelled or failed, nothing is left open."""
        if self._pool is None and self._client is None:
            await self.start()
        if self._pool is not None:
            return await self._pool.request(
                method,
                self._base_path + path,
                headers,
                body,
                connect_timeout=self.config.connect_timeout,
                pool_timeout=self.config.first_byte_timeout,
            )
        assert self._client is not None
        http_request = self._client.build_request(
            method, self._base_url + path, content=body, headers=headers
        )
        return await HttpxExchange.open(self._client, http_request)

    async def _send(
        self, path: str, body: bytes, headers: dict[str, str], deadline: float | None
    ) -> UpstreamResponse:
        try:
            with Deadline(deadline):
                return await self._open("POST", path, body, headers)
        except TimeoutError as exc:
            raise UpstreamTimeoutError(
                f"backend {self.name!r}: no response from {self._host} within the "
                "first-byte timeout"
            ) from exc
        except httpx.TimeoutException as exc:
            raise UpstreamTimeoutError(
                f"backend {self.name!r}: timed out connecting to {self._host}: {exc}"
            ) from exc
        except httpx.HTTPError as exc:
            raise BackendUnavailableError(
                f"backend {self.name!r}: cannot reach {self._host}:{self._port}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

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
        # Before any output the router may still try elsewhere; after, only a resume may
        # (``resume_on_failure``: the next backend continues the answer).
        return UpstreamStreamBrokenError(message) if has_output else UpstreamStatusError(message)

    async def _status_error(self, response: UpstreamResponse) -> InfermuxError:
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


def _text_chunk(texts: list[str]) -> GenerationChunk:
    """One chunk for the texts of several events (merged: see ``_take``)."""
    if len(texts) == 1:
        return GenerationChunk(text=texts[0])
    return GenerationChunk(text="".join(texts), token_count=len(texts))


async def _drain(stream: AsyncIterator[bytes]) -> None:
    """Read what follows ``[DONE]`` (the closing chunk) so the connection can be reused."""
    try:
        with Deadline(time.monotonic() + _DRAIN_TIMEOUT_S):
            async for _ in stream:
                pass
    except (TimeoutError, httpx.HTTPError):
        pass  # the connection is closed instead of pooled; nothing is lost


def create_backend(config: BackendConfig) -> OpenAICompatBackend:
    """Factory registered for kind ``"openai"``."""
    return OpenAICompatBackend(config)


"""The streaming client: sends one workload prompt to an endpoint and times its stream.

Every request streams (``stream: true`` with ``stream_options.include_usage``) and is timed with
the client's clock (``time.perf_counter`` unless the caller gives another, as the tests do with a
virtual clock their fake server advances) from the moment it is handed to the HTTP client:

- TTFT: until the first chunk whose content is non-empty (role-only and empty deltas do not
  count; reasoning content does).
- ITL: the gap between consecutive content chunks; a server that packs several tokens into one
  chunk yields one gap for them, as seen by a client.
- E2E: until the stream ends (``[DONE]`` or the connection closes).
- TPOT: ``(E2E - TTFT) / (output_tokens - 1)``, the mean time per output token after the first.

Streams to ``http://`` endpoints go through the gateway's own lean HTTP/1.1 client
(:class:`backends._http1_transport.Http1Pool`, httptools' C parser), the rest through httpx.
Why: a client shares the machine with the server it measures, and the time it spends per
chunk delays the next chunk it reads. Through httpx, our TTFT read 24 % higher than
``vllm bench serve``'s (aiohttp) on one server at 16 streams (docs/bench.md has both).

Token counts come from the final usage chunk; when a server sends none (llama-cpp-python's
server does not), ``output_tokens`` falls back to the number of content chunks and
``prompt_tokens``/``cached_tokens`` stay ``None``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import httpx
import msgspec

from backends._http1_transport import Http1Pool
from gateway.bench.config import Target
from gateway.bench.record import RequestRecord
from gateway.bench.workload import BenchPrompt

__all__ = ["BenchClient", "endpoint_url"]


def endpoint_url(url: str, endpoint: str) -> str:
    """The URL to POST to: ``url`` itself if it names an endpoint, else ``url`` + ``/v1/...``."""
    base = url.rstrip("/")
    if base.endswith("/completions"):
        return base
    if not base.endswith("/v1"):
        base += "/v1"
    return base + ("/chat/completions" if endpoint == "chat" else "/completions")


def models_url(url: str) -> str:
    base = url.rstrip("/")
    for suffix in ("/chat/completions", "/completions"):
        base = base.removesuffix(suffix)
    if not base.endswith("/v1"):
        base += "/v1"
    return base + "/models"


def _chunk_text(chunk: dict[str, Any]) -> str:
    parts = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict):
            parts.append(delta.get("content") or "")
            parts.append(delta.get("reasoning_content") or "")
        else:
            parts.append(choice.get("text") or "")
    return "".join(parts)


class _Streamed(Protocol):
    """What :meth:`BenchClient.send` reads of a response: httpx's, or an Http1Pool's."""

    status_code: int

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...


async def _read_all(response: _Streamed) -> bytes:
    return b"".join([data async for data in response.aiter_bytes()])


async def _lines(response: _Streamed) -> AsyncIterator[bytes]:
    """The body's lines (without their end), the last one even without a newline."""
    pending = b""
    async for data in response.aiter_bytes():
        lines = (pending + data).split(b"\n")
        pending = lines.pop()
        for line in lines:
            yield line
    if pending:
        yield pending


def _error_message(status_code: int, body: bytes) -> str:
    try:
        decoded = msgspec.json.decode(body)
        message = decoded["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        message = body[:200].decode("utf-8", "replace")
    return f"HTTP {status_code}: {message}"


class BenchClient:
    """An httpx client bound to one target; ``send`` streams one prompt and times it."""

    def __init__(
        self,
        target: Target,
        *,
        endpoint: str,
        timeout_s: float,
        ignore_eos: bool = False,
        temperature: float | None = 0.0,
        extra_body: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.target = target
        self.clock = clock  # seconds; read at the start, at each content chunk and at the end
        self.endpoint = endpoint
        self.url = endpoint_url(target.url, endpoint)
        self.model = target.model
        self._ignore_eos = ignore_eos
        self._temperature = temperature
        self._extra_body = extra_body or {}
        headers = {"content-type": "application/json", **target.headers}
        if target.api_key:
            headers["authorization"] = f"Bearer {target.api_key}"
        # No pool limit: the load generator, not the connection pool, decides concurrency.
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        self._timeout_s = timeout_s
        url = httpx.URL(self.url)
        self._pool: Http1Pool | None = None
        if url.scheme == "http" and url.host:
            self._pool = Http1Pool(url.host, url.port or 80, headers=headers, max_connections=1 << 20)
            self._path = url.raw_path.decode("ascii")

    async def aclose(self) -> None:
        await self._client.aclose()
        if self._pool is not None:
            await self._pool.aclose()

    @contextlib.asynccontextmanager
    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[_Streamed]:
        """POST ``body`` and yield the response with its body still to read."""
        if self._pool is None:
            async with self._client.stream("POST", self.url, json=body) as response:
                yield response
            return
        lean = await self._pool.request(
            "POST", self._path, {}, msgspec.json.encode(body), connect_timeout=min(self._timeout_s, 30.0)
        )
        try:
            yield lean
        finally:
            await lean.aclose()

    async def resolve_model(self) -> str:
        """The model to request: the target's, else the first one the server lists."""
        if self.model is None:
            response = await self._client.get(models_url(self.target.url))
            response.raise_for_status()
            self.model = str(response.json()["data"][0]["id"])
        return self.model

    def _body(self, prompt: BenchPrompt, *, stream: bool, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "stream": stream}
        if self.endpoint == "chat":
            body["messages"] = prompt.messages
        else:
            body["prompt"] = prompt.prompt
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self._temperature is not None:
            body["temperature"] = self._temperature
        if self._ignore_eos:
            # vLLM's extension (infermux honours it too); min_tokens does the same on servers
            # that only know that one (llama-cpp-python's server, vLLM).
            body["ignore_eos"] = True
            body["min_tokens"] = max_tokens
        body.update(self._extra_body)
        return body

    async def prompt_tokens(self, prompt: BenchPrompt) -> int | None:
        """``usage.prompt_tokens`` of a one-token, non-streaming request (for calibration)."""
        response = await self._client.post(
            self.url, json=self._body(prompt, stream=False, max_tokens=1)
        )
        if response.status_code != 200:
            raise httpx.HTTPStatusError(
                _error_message(response.status_code, response.content),
                request=response.request,
                response=response,
            )
        usage = response.json().get("usage") or {}
        tokens = usage.get("prompt_tokens")
        return int(tokens) if isinstance(tokens, int) else None

    async def send(self, prompt: BenchPrompt, record: RequestRecord) -> RequestRecord:
        """Stream ``prompt`` and fill ``record`` with what was measured."""
        body = self._body(prompt, stream=True, max_tokens=prompt.output_len)
        record.input_len = prompt.input_len
        record.output_len = prompt.output_len
        start = self.clock()
        first: float | None = None
        last = start
        itl: list[float] = []
        usage: dict[str, Any] | None = None
        num_chars = 0
        is_done = False
        try:
            async with asyncio.timeout(self._timeout_s), self._stream(body) as response:
                record.status_code = response.status_code
                if response.status_code != 200:
                    record.error = _error_message(response.status_code, await _read_all(response))
                    return record
                async for line in _lines(response):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        is_done = True
                        break
                    chunk = msgspec.json.decode(data)
                    if not isinstance(chunk, dict):
                        continue
                    if chunk.get("error"):
                        error = chunk["error"]
                        message = error.get("message") if isinstance(error, dict) else error
                        record.error = f"stream error: {message}"
                        break
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    text = _chunk_text(chunk)
                    if not text:
                        continue
                    now = self.clock()
                    if first is None:
                        first = now
                    else:
                        itl.append((now - last) * 1e3)
                    last = now
                    record.num_chunks += 1
                    num_chars += len(text)
                # The end of the answer, before closing the connection.
                end = self.clock()
        except (httpx.HTTPError, OSError, TimeoutError) as exc:
            record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except msgspec.DecodeError as exc:
            record.error = f"malformed SSE data: {exc}"
        record.output_chars = num_chars
        if record.error is not None:
            return record
        if not is_done:
            # OpenAI-compatible servers end every complete stream with [DONE]; without it the
            # answer was cut off (server crash, proxy timeout).
            record.error = "the stream ended without [DONE]"
            return record
        if first is None:
            record.error = "the stream carried no content"
            return record
        record.ttft_ms = (first - start) * 1e3
        record.e2e_ms = (end - start) * 1e3
        record.itl_ms = itl
        self._apply_usage(record, usage)
        if record.output_tokens is not None and record.output_tokens > 1:
            record.tpot_ms = (record.e2e_ms - record.ttft_ms) / (record.output_tokens - 1)
        return record

    @staticmethod
    def _apply_usage(record: RequestRecord, usage: dict[str, Any] | None) -> None:
        if usage is None:
            record.output_tokens = record.num_chunks
            return
        record.usage_reported = True
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens", record.num_chunks)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            record.cached_tokens = int(details["cached_tokens"])

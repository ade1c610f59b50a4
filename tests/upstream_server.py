"""A configurable OpenAI-shaped upstream on loopback, for routing and fault-injection tests.

A real HTTP/1.1 server (plain asyncio streams, keep-alive, chunked SSE) in a background
thread with its own event loop, so sync and async tests of any scope can use it. Each
request follows a :class:`Behaviour`: answer normally, stall before the headers or the first
event, answer an error status (with ``Retry-After``), die or stall in the middle of the
stream, reset the connection (TCP RST) before the headers or mid-stream, or drop it without
answering. A refused connection needs no server: :func:`closed_port_url`. With ``tls`` (a
server :class:`TLSFiles`, e.g. from the ``test_ca`` fixture) it serves ``https://``, and
:func:`backend_tls_options` gives the options an ``openai`` backend needs to trust it.

Reuse it from any test (``tests/`` is on ``sys.path`` through ``tests/conftest.py``)::

    from upstream_server import Behaviour, UpstreamServer, closed_port_url

    with UpstreamServer(Behaviour(mode="status", status=429, retry_after="7")) as upstream:
        upstream.base_url                       # "http://127.0.0.1:PORT/v1"
        upstream.script(Behaviour(mode="die_mid_stream", after_chunks=2))  # next request only
        upstream.requests[-1].json              # what reached it
        upstream.wait_until(lambda: upstream.num_disconnects == 1)   # sync tests
        await upstream.until(lambda: upstream.num_disconnects == 1)  # async tests

or through the ``upstream_servers`` fixture (a factory that stops every server it started):
import it into a conftest (``from upstream_server import upstream_servers  # noqa: F401``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import pytest

__all__ = [
    "Behaviour",
    "ReceivedRequest",
    "UpstreamServer",
    "TLSFiles",
    "backend_tls_options",
    "closed_port_url",
    "test_ca",
    "upstream_servers",
]


@dataclass(frozen=True)
class TLSFiles:
    """A server certificate for 127.0.0.1 and the CA that signed it (PEM files)."""

    ca_bundle: str  # the CA certificate: what a client must trust
    cert_chain: str  # the server's certificate chain
    private_key: str

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_chain, self.private_key)
        return context


#: base_url -> the CA bundle of the TLS server listening there (see backend_tls_options).
_CA_BUNDLES: dict[str, str] = {}


def backend_tls_options(base_url: str) -> dict[str, str]:
    """``{"ca_bundle": ...}`` for the base URL of a TLS :class:`UpstreamServer`, else ``{}``."""
    bundle = _CA_BUNDLES.get(base_url)
    return {"ca_bundle": bundle} if bundle is not None else {}


Mode = Literal[
    "ok",  # stream (or answer) the reply
    "stall_before_headers",  # accept the request, send nothing
    "stall_before_first_chunk",  # send 200 + SSE headers, then nothing
    "status",  # answer `status` with an OpenAI error body
    "die_mid_stream",  # send `after_chunks` content events, then drop the connection
    "stall_mid_stream",  # send `after_chunks` content events, then nothing
    "close_without_response",  # read the request, close the connection
    "reset_before_headers",  # read the request, reset the connection (TCP RST)
    "reset_mid_stream",  # send `after_chunks` content events, then reset the connection
]


@dataclass
class Behaviour:
    """What the upstream does with a request."""

    mode: Mode = "ok"
    #: The text to answer, one word per token (default: echo the last user message / prompt).
    reply: str | None = None
    #: Pause before the first content event and between events.
    first_chunk_delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    #: ``status`` mode: the HTTP status, error body and optional ``Retry-After`` header value.
    status: int = 500
    error_message: str = "injected upstream failure"
    error_type: str = "server_error"
    error_param: str | None = None
    error_code: str | None = None
    retry_after: str | None = None
    #: ``die_mid_stream`` / ``stall_mid_stream``: content events sent before the fault.
    after_chunks: int = 2
    #: How long a stall lasts at most (it ends early when the client disconnects).
    stall_s: float = 600.0
    #: Reported as ``usage.prompt_tokens_details.cached_tokens`` (None: field omitted).
    cached_tokens: int | None = None
    model: str = "upstream-model"
    #: Close the connection after answering (as a server whose keep-alive expired does).
    close_after_response: bool = False
    #: Chat only: stream these raw ``delta`` objects instead of ``reply`` (a recorded answer
    #: with tool calls or reasoning), ending with ``finish_reason``.
    deltas: list[dict[str, Any]] | None = None
    finish_reason: str | None = None


@dataclass
class ReceivedRequest:
    """One request as the upstream saw it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    #: "ok" | "disconnected" (the client went away mid-answer) | "error" | "dropped".
    outcome: str = "open"

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def closed_port_url() -> str:
    """An API base URL on a loopback port where nothing listens (connections are refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


class UpstreamServer:
    """The server; see the module docstring. Start with ``with`` or :meth:`start`."""

    def __init__(
        self,
        behaviour: Behaviour | None = None,
        *,
        name: str = "upstream",
        tls: TLSFiles | None = None,
    ) -> None:
        self.name = name
        self.tls = tls
        #: Used for every request once the script (:meth:`script`) is exhausted.
        self.behaviour = behaviour or Behaviour()
        self._script: collections.deque[Behaviour] = collections.deque()
        self.requests: list[ReceivedRequest] = []
        self.num_disconnects = 0
        #: TCP connections accepted (keep-alive reuse shows as fewer connections than requests).
        self.num_connections = 0
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._lock = threading.Lock()

    # -- control (any thread) -------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """The OpenAI API root: ``http://127.0.0.1:PORT/v1`` (``https://`` with TLS)."""
        assert self.port is not None, "start the server first"
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/v1"

    def script(self, *behaviours: Behaviour) -> None:
        """Behaviours for the next requests, one each, before falling back to ``behaviour``."""
        with self._lock:
            self._script.extend(behaviours)

    @property
    def num_requests(self) -> int:
        """Generation requests received (``GET /v1/models`` not counted)."""
        return sum(1 for r in self.requests if r.method == "POST")

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Poll until ``predicate()`` holds; AssertionError after ``timeout_s`` (a hang guard)."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: condition not reached in {timeout_s} s")
            time.sleep(0.01)

    async def until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """:meth:`wait_until` for async tests: polls without blocking the event loop."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: condition not reached in {timeout_s} s")
            await asyncio.sleep(0.01)

    def start(self) -> UpstreamServer:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                context = self.tls.server_context() if self.tls is not None else None
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=context)
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:  # surfaced to the starting thread
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"upstream-{self.name}", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        if self.tls is not None:
            _CA_BUNDLES[self.base_url] = self.tls.ca_bundle
        return self

    def stop(self) -> None:
        """Close the listening socket and every connection; join the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        self._loop = self._thread = None
        if self.port is not None:
            _CA_BUNDLES.pop(self.base_url, None)

    def __enter__(self) -> UpstreamServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- serving (the server thread) --------------------------------------------------------

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    def _next_behaviour(self) -> Behaviour:
        with self._lock:
            return self._script.popleft() if self._script else self.behaviour

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        self.num_connections += 1
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                self.requests.append(request)
                keep_open = await self._respond(request, reader, writer)
                if not keep_open or request.headers.get("connection") == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._connections.discard(task)
            writer.close()

    async def _respond(
        self, request: ReceivedRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; False when the connection must be closed afterwards."""
        if request.method == "GET" and request.path.rstrip("/") == "/v1/models":
            body = {"object": "list", "data": [{"id": self.behaviour.model, "object": "model"}]}
            await _write_json(writer, 200, body)
            request.outcome = "ok"
            return True
        if request.method != "POST" or request.path not in (
            "/v1/chat/completions",
            "/v1/completions",
        ):
            await _write_json(writer, 404, _error_body(f"no route {request.path}", "not_found"))
            request.outcome = "error"
            return True
        behaviour = self._next_behaviour()
        keep_open = await self._answer(request, reader, writer, behaviour)
        return keep_open and not behaviour.close_after_response

    async def _answer(
        self,
        request: ReceivedRequest,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        behaviour: Behaviour,
    ) -> bool:
        payload = request.json or {}
        if behaviour.mode == "close_without_response":
            request.outcome = "dropped"
            return False
        if behaviour.mode == "reset_before_headers":
            request.outcome = "dropped"
            _reset(writer)
            return False
        if behaviour.mode == "stall_before_headers":
            await self._stall(request, reader, behaviour)
            return False
        if behaviour.mode == "status":
            headers = {"retry-after": behaviour.retry_after} if behaviour.retry_after else {}
            body = _error_body(
                behaviour.error_message,
                behaviour.error_type,
                param=behaviour.error_param,
                code=behaviour.error_code,
            )
            await _write_json(writer, behaviour.status, body, headers)
            request.outcome = "error"
            return True
        answer = _Answer(request.path == "/v1/chat/completions", payload, behaviour)
        if not payload.get("stream"):
            await asyncio.sleep(behaviour.first_chunk_delay_s)
            await _write_json(writer, 200, answer.full_body())
            request.outcome = "ok"
            return True
        return await self._stream(request, reader, writer, answer, behaviour)

    async def _stream(
        self,
        request: ReceivedRequest,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        answer: _Answer,
        behaviour: Behaviour,
    ) -> bool:
        head = (
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            "cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        try:
            writer.write(head.encode())
            await writer.drain()
            if behaviour.mode == "stall_before_first_chunk":
                await self._stall(request, reader, behaviour)
                return False
            for event in answer.head_events():
                await _write_event(writer, event)
            await asyncio.sleep(behaviour.first_chunk_delay_s)
            for index, event in enumerate(answer.content_events()):
                if index == behaviour.after_chunks and behaviour.mode == "die_mid_stream":
                    request.outcome = "dropped"
                    writer.transport.abort()  # no terminating chunk: the body is cut short
                    return False
                if index == behaviour.after_chunks and behaviour.mode == "reset_mid_stream":
                    request.outcome = "dropped"
                    _reset(writer)
                    return False
                if index == behaviour.after_chunks and behaviour.mode == "stall_mid_stream":
                    await self._stall(request, reader, behaviour)
                    return False
                if index and behaviour.chunk_delay_s:
                    await asyncio.sleep(behaviour.chunk_delay_s)
                await _write_event(writer, event)
            for event in answer.tail_events():
                await _write_event(writer, event)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (ConnectionError, RuntimeError):
            request.outcome = "disconnected"
            self.num_disconnects += 1
            return False
        request.outcome = "ok"
        return True

    async def _stall(
        self, request: ReceivedRequest, reader: asyncio.StreamReader, behaviour: Behaviour
    ) -> None:
        """Send nothing until the client disconnects (counted) or ``stall_s`` passes."""
        try:
            data = await asyncio.wait_for(reader.read(1), behaviour.stall_s)
        except TimeoutError:
            data = b"?"
        except (ConnectionError, ssl.SSLError):
            # A reset, or (over TLS) a close without close_notify: the client went away too.
            data = b""
        if data == b"":
            request.outcome = "disconnected"
            self.num_disconnects += 1
        else:
            request.outcome = "stalled"


class _Answer:
    """The OpenAI-shaped events (or body) for one request."""

    def __init__(self, is_chat: bool, payload: dict[str, Any], behaviour: Behaviour) -> None:
        self.is_chat = is_chat
        self.payload = payload
        self.behaviour = behaviour
        if is_chat:
            messages = payload.get("messages") or []
            prompt_text = " ".join(str(m.get("content", "")) for m in messages)
            last_user = next(
                (str(m.get("content", "")) for m in reversed(messages) if m.get("role") == "user"),
                "",
            )
            source = behaviour.reply if behaviour.reply is not None else last_user
        else:
            prompt = payload.get("prompt", "")
            prompt_text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
            source = behaviour.reply if behaviour.reply is not None else prompt_text
        words = source.split()
        max_tokens = payload.get("max_tokens") or payload.get("max_completion_tokens")
        self.finish_reason = "stop"
        if max_tokens is not None and len(words) > max_tokens:
            words = words[:max_tokens]
            self.finish_reason = "length"
        self.tokens = [w if i == 0 else " " + w for i, w in enumerate(words)]
        if behaviour.finish_reason is not None:
            self.finish_reason = behaviour.finish_reason
        self.num_prompt = len(prompt_text.split())
        self.id = f"{'chatcmpl' if is_chat else 'cmpl'}-upstream"

    def _envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.is_chat else "text_completion",
            "created": 0,
            "model": self.behaviour.model,
            "choices": choices,
            **extra,
        }

    def _logprobs(self, token: str, offset: int) -> dict[str, Any] | None:
        want = self.payload.get("logprobs")
        if not want:
            return None
        if self.is_chat:
            return {
                "content": [
                    {
                        "token": token,
                        "logprob": -0.25,
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {"token": token, "logprob": -0.25, "bytes": list(token.encode())}
                        ][: self.payload.get("top_logprobs") or 0],
                    }
                ]
            }
        return {
            "tokens": [token],
            "token_logprobs": [-0.25],
            "top_logprobs": [{token: -0.25}],
            "text_offset": [offset],
        }

    def _usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.num_prompt,
            "completion_tokens": len(self.tokens),
            "total_tokens": self.num_prompt + len(self.tokens),
        }
        if self.behaviour.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.behaviour.cached_tokens}
        return usage

    def head_events(self) -> list[dict[str, Any]]:
        if not self.is_chat:
            return []
        delta = {"role": "assistant", "content": ""}
        return [self._envelope([{"index": 0, "delta": delta, "finish_reason": None}])]

    def content_events(self) -> Iterator[dict[str, Any]]:
        if self.is_chat and self.behaviour.deltas is not None:
            for delta in self.behaviour.deltas:
                yield self._envelope([{"index": 0, "finish_reason": None, "delta": delta}])
            return
        offset = 0
        for token in self.tokens:
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            if self.is_chat:
                choice["delta"] = {"content": token}
            else:
                choice["text"] = token
            choice["logprobs"] = self._logprobs(token, offset)
            offset += len(token)
            yield self._envelope([choice])

    def tail_events(self) -> list[dict[str, Any] | str]:
        last: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason, "logprobs": None}
        if self.is_chat:
            last["delta"] = {}
        else:
            last["text"] = ""
        events: list[dict[str, Any] | str] = [self._envelope([last])]
        if (self.payload.get("stream_options") or {}).get("include_usage"):
            events.append(self._envelope([], usage=self._usage()))
        events.append("[DONE]")
        return events

    def full_body(self) -> dict[str, Any]:
        text = "".join(self.tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason, "logprobs": None}
        if self.is_chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = self._envelope([choice], usage=self._usage())
        body["object"] = "chat.completion" if self.is_chat else "text_completion"
        return body


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close the connection with a TCP RST (no TLS close_notify, no FIN)."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


async def _read_request(reader: asyncio.StreamReader) -> ReceivedRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None  # the client closed the keep-alive connection
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            key, value = line.split(":", 1)
            headers[key.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return ReceivedRequest(method=method, path=path.split("?", 1)[0], headers=headers, body=body)


async def _write_json(
    writer: asyncio.StreamWriter,
    status: int,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> None:
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n{extra}\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()


async def _write_event(writer: asyncio.StreamWriter, event: dict[str, Any] | str) -> None:
    text = event if isinstance(event, str) else json.dumps(event)
    data = f"data: {text}\n\n".encode()
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await writer.drain()


_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    """A throwaway CA (``trustme``) and a certificate it signed for 127.0.0.1, as PEM files."""
    trustme = pytest.importorskip("trustme", reason="the dev extra installs trustme")
    folder = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    files = TLSFiles(
        ca_bundle=str(folder / "ca.pem"),
        cert_chain=str(folder / "server.pem"),
        private_key=str(folder / "server.key"),
    )
    ca.cert_pem.write_to_path(files.ca_bundle)
    cert.cert_chain_pems[0].write_to_path(files.cert_chain)
    for pem in cert.cert_chain_pems[1:]:
        pem.write_to_path(files.cert_chain, append=True)
    cert.private_key_pem.write_to_path(files.private_key)
    return files


@pytest.fixture
def upstream_servers() -> Iterator[Callable[..., UpstreamServer]]:
    """Factory fixture: ``upstream_servers(Behaviour(...), name="a")`` -> a started server."""
    started: list[UpstreamServer] = []

    def start(
        behaviour: Behaviour | None = None, *, name: str = "upstream", tls: TLSFiles | None = None
    ) -> UpstreamServer:
        server = UpstreamServer(behaviour, name=name, tls=tls).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()

"""OpenAI-shaped servers on loopback with known, injected timings, for the benchmark's tests.

Each server is a small ASGI app under a real uvicorn in a thread. A streamed request gets an
empty role chunk at once (which must not count as the first token), its first content token
``ttft_s`` later, then one token every ``gap_s``, scheduled on absolute times so sleeps do not
accumulate drift. Every ``slow_every``-th streamed request waits ``slow_ttft_s`` instead.

With a :class:`VirtualClock` the server does not sleep: it moves the clock to each token's
time, sends the token and waits until the client has read the clock, so a benchmark run with
that clock measures exactly the injected delays, however loaded the machine is (one stream at
a time: the clock is shared).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn

from gateway.bench import BenchConfig, Target, WorkloadSpec


class VirtualClock:
    """Seconds that pass only when the fake server says so; the benchmark's ``clock``.

    The server moves the clock to a token's time, sends the token, and waits until the client
    has read the clock again (which it does once per content chunk), so a reading always
    belongs to the token just received."""

    def __init__(self) -> None:
        self._now = 0.0
        self._num_reads = 0
        self._reads_at_move = 0
        self._changed = threading.Condition()

    def __call__(self) -> float:
        with self._changed:
            self._num_reads += 1
            self._changed.notify_all()
            return self._now

    def now(self) -> float:
        """The time, without counting as the client's reading."""
        with self._changed:
            return self._now

    def move_to(self, when: float) -> None:
        with self._changed:
            self._now = max(self._now, when)
            self._reads_at_move = self._num_reads

    def wait_for_reading(self, timeout_s: float = 30.0) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self._num_reads > self._reads_at_move, timeout_s):
                raise TimeoutError("the client never read the clock after a token")


def word_tokens(text: str) -> int:
    """A stand-in tokenizer: one token per word and one per full stop."""
    return len(text.split()) + text.count(".")


@dataclass
class Behaviour:
    """What a fake server does; the tests assert the tool measures exactly this."""

    ttft_s: float = 0.2
    gap_s: float = 0.02
    slow_every: int | None = None  # every k-th streamed request (1-based) is slow
    slow_ttft_s: float = 0.6
    fail_every: int | None = None  # every k-th streamed request answers HTTP 500
    report_usage: bool = True
    # Mid-stream faults after this many tokens: an SSE error frame, or the end of the body
    # without [DONE] (a crashed server), on every request.
    error_frame_after: int | None = None
    truncate_after: int | None = None
    tokenize: Callable[[str], int] = word_tokens
    overhead_per_message: int = 3  # stand-in chat template tokens
    model: str = "fake-model"
    clock: VirtualClock | None = None  # None: real time and real sleeps
    # Filled in by the server:
    num_streamed: int = 0
    # (start, end) of each stream, perf_counter or the virtual clock
    intervals: list[tuple[float, float]] = field(default_factory=list)
    num_in_flight: int = 0
    max_in_flight: int = 0  # the most streams the server served at once
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)


class FakeOpenAI:
    """The ASGI app."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self._seen_prefixes: set[str] = set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        self.behaviour.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        if path == "/v1/models":
            await self._json(send, 200, {"object": "list", "data": [{"id": self.behaviour.model}]})
        elif path in ("/v1/chat/completions", "/v1/completions"):
            await self._completion(send, json.loads(body), chat=path.endswith("chat/completions"))
        else:
            await self._json(send, 404, {"error": {"message": "not found"}})

    @staticmethod
    async def _json(send: Any, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    def _usage(self, request: dict[str, Any], completion_tokens: int) -> dict[str, Any]:
        b = self.behaviour
        if "messages" in request:
            messages = request["messages"]
            prompt_tokens = 2 + sum(
                b.overhead_per_message + b.tokenize(m["content"]) for m in messages
            )
            system = next((m["content"] for m in messages if m["role"] == "system"), None)
        else:
            prompt_tokens = 1 + b.tokenize(request["prompt"])
            system = None
        cached = 0
        if system is not None:
            if system in self._seen_prefixes:
                cached = b.tokenize(system)
            self._seen_prefixes.add(system)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def _completion(self, send: Any, request: dict[str, Any], *, chat: bool) -> None:
        b = self.behaviour
        if not request.get("stream"):
            await self._json(send, 200, {"choices": [], "usage": self._usage(request, 1)})
            return
        clock = b.clock
        start = clock.now() if clock is not None else time.perf_counter()
        b.num_streamed += 1
        number = b.num_streamed
        b.bodies.append(request)
        if b.fail_every and number % b.fail_every == 0:
            await self._json(send, 500, {"error": {"message": "injected failure"}})
            return
        ttft = b.slow_ttft_s if b.slow_every and number % b.slow_every == 0 else b.ttft_s
        b.num_in_flight += 1
        b.max_in_flight = max(b.max_in_flight, b.num_in_flight)
        try:
            await self._stream(send, request, chat=chat, start=start, ttft=ttft)
        finally:
            b.num_in_flight -= 1

    async def _stream(
        self, send: Any, request: dict[str, Any], *, chat: bool, start: float, ttft: float
    ) -> None:
        b = self.behaviour
        clock = b.clock
        num_tokens = int(request["max_tokens"])
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def event(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await send(
                {
                    "type": "http.response.body",
                    "body": f"data: {data}\n\n".encode(),
                    "more_body": True,
                }
            )

        if chat:
            await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for index in range(num_tokens):
            if index == b.error_frame_after:
                await event({"error": {"message": "injected mid-stream failure"}})
                await send({"type": "http.response.body", "body": b""})
                return
            if index == b.truncate_after:
                await send({"type": "http.response.body", "body": b""})
                return
            when = start + ttft + index * b.gap_s
            if clock is not None:
                clock.move_to(when)
            elif (delay := when - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            if chat:
                await event({"choices": [{"index": 0, "delta": {"content": " tok"}}]})
            else:
                await event({"choices": [{"index": 0, "text": " tok"}]})
            if clock is not None:
                await asyncio.to_thread(clock.wait_for_reading)
        finish = {"index": 0, "finish_reason": "length"}
        await event({"choices": [{**finish, "delta": {}} if chat else {**finish, "text": ""}]})
        if b.report_usage and (request.get("stream_options") or {}).get("include_usage"):
            await event({"choices": [], "usage": self._usage(request, num_tokens)})
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b""})
        b.intervals.append((start, clock.now() if clock is not None else time.perf_counter()))


class ServerThread:
    """uvicorn serving an app on a free loopback port, in a daemon thread."""

    def __init__(self, app: Any) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def bench_config(url: str, **overrides: object) -> BenchConfig:
    """A small benchmark of the server at ``url``: 10 fixed requests, concurrency 2."""
    settings: dict[str, object] = {
        "targets": [Target(label="A", url=url)],
        "workload": WorkloadSpec(name="fixed", num_requests=10, input_len=64, output_len=10),
        "concurrency": 2,
        "progress": False,
    }
    settings.update(overrides)
    return BenchConfig(**settings)  # type: ignore[arg-type]


def assert_latency(measured_ms: float | None, injected_ms: float) -> None:
    """``measured_ms`` is the injected delay: under a :class:`VirtualClock` the measurement is
    exact, so only float rounding is allowed."""
    assert measured_ms is not None
    assert measured_ms == pytest.approx(injected_ms, abs=1e-6), (
        f"measured {measured_ms} ms for an injected {injected_ms} ms"
    )

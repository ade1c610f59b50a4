"""OpenAI-shaped servers on loopback with known, injected timings, for the benchmark's tests.

Each server is a small ASGI app under a real uvicorn in a thread. A streamed request gets an
empty role chunk at once (which must not count as the first token), its first content token
``ttft_s`` later, then one token every ``gap_s``, scheduled on absolute times so sleeps do not
accumulate drift. Every ``slow_every``-th streamed request waits ``slow_ttft_s`` instead.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from gateway.bench import BenchConfig, Target, WorkloadSpec


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
    # Filled in by the server:
    num_streamed: int = 0
    intervals: list[tuple[float, float]] = field(default_factory=list)  # (start, end) perf_counter
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
        start = time.perf_counter()
        b.num_streamed += 1
        number = b.num_streamed
        b.bodies.append(request)
        if b.fail_every and number % b.fail_every == 0:
            await self._json(send, 500, {"error": {"message": "injected failure"}})
            return
        ttft = b.slow_ttft_s if b.slow_every and number % b.slow_every == 0 else b.ttft_s
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
            delay = start + ttft + index * b.gap_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if chat:
                await event({"choices": [{"index": 0, "delta": {"content": " tok"}}]})
            else:
                await event({"choices": [{"index": 0, "text": " tok"}]})
        finish = {"index": 0, "finish_reason": "length"}
        await event({"choices": [{**finish, "delta": {}} if chat else {**finish, "text": ""}]})
        if b.report_usage and (request.get("stream_options") or {}).get("include_usage"):
            await event({"choices": [], "usage": self._usage(request, num_tokens)})
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b""})
        b.intervals.append((start, time.perf_counter()))


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


def assert_latency(
    measured_ms: float | None,
    injected_ms: float,
    *,
    below_ms: float = 10.0,
    above_ms: float = 100.0,
) -> None:
    """``measured_ms`` matches a server's injected delay: a loaded machine only adds time, so
    the window is tight below (timer and scheduling jitter) and generous above."""
    assert measured_ms is not None
    assert injected_ms - below_ms <= measured_ms <= injected_ms + above_ms, (
        f"measured {measured_ms:.1f} ms for an injected {injected_ms:.1f} ms"
    )

"""Every endpoint that makes a backend compute is admitted (per-key limits, the global slots
and queue), no key can hold every slot and queue place, and the queue is fair between keys.

Through a live gateway on loopback with mock backends, whose ``received`` log is the order
in which requests reached the backend; and the fair queue's own order, unit by unit."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from gateway.config.types import ApiKeyConfig, AuthConfig, LimitsConfig
from gateway.http.auth import hash_key
from gateway.serving.admission import ConcurrencyLimiter
from gateway.testing import gateway_config, mock_backend

LONG = " ".join(["tok"] * 400)  # 400 tokens: 20 s at 0.05 s a token, unless closed


def key(name: str, **limits: Any) -> ApiKeyConfig:
    return ApiKeyConfig(id=name, tenant=name, key_sha256=hash_key(f"k-{name}"), **limits)


def bearer(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer k-{name}"}


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def chat(content: str, *, stream: bool = False) -> dict[str, Any]:
    return {"model": "echo", "stream": stream, "messages": [{"role": "user", "content": content}]}


class HeldStream:
    """A streaming chat request that holds its slot once running, until :meth:`let_go`."""

    def __init__(self, gw: str, headers: dict[str, str], running: list[HeldStream]) -> None:
        self.gw, self.headers, self.running = gw, headers, running
        self._go = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.stream(
            "POST", f"{self.gw}/v1/chat/completions", json=chat(LONG, stream=True),
            headers=self.headers, timeout=90,
        ) as response:
            assert response.status_code == 200, response.read()
            lines = response.iter_lines()  # kept: a collected iterator closes the stream
            next(lines)  # admitted and streaming
            self.running.append(self)
            self._go.wait(90)

    def let_go(self) -> None:
        self._go.set()


@contextmanager
def held_streams(gw: str, headers: dict[str, str], count: int) -> Iterator[list[HeldStream]]:
    """``count`` streams of one key; the list of those admitted grows as they are."""
    running: list[HeldStream] = []
    streams = [HeldStream(gw, headers, running) for _ in range(count)]
    try:
        yield running
    finally:
        for stream in streams:
            stream.let_go()
        for stream in streams:
            stream.thread.join(timeout=90)


def in_thread(call: Callable[[], httpx.Response]) -> tuple[threading.Thread, list[httpx.Response]]:
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(call()), daemon=True)
    thread.start()
    return thread, answers


# -- the fair queue ------------------------------------------------------------------------


def test_a_freed_slot_goes_to_the_key_holding_fewest_then_to_the_one_served_longest_ago() -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        limiter = ConcurrencyLimiter(max_active=1, max_queued=10, timeout_s=10)
        order: list[str] = []

        async def take(owner: str) -> None:
            await limiter.acquire(owner)
            order.append(owner)

        await limiter.acquire("a")  # "a" holds the only slot, then floods the queue
        tasks = []
        for owner in ["a", "a", "a", "b", "c"]:
            tasks.append(asyncio.create_task(take(owner)))
            await asyncio.sleep(0)
        assert limiter.num_queued == 5
        holder = "a"
        for _ in range(5):
            limiter.release(holder)
            await asyncio.sleep(0)
            holder = order[-1]
        await asyncio.gather(*tasks)

        # Two slots: "a" holds two, "b" none; the slot "a" frees goes to "b" though "a" queued first.
        limiter = ConcurrencyLimiter(max_active=2, max_queued=10, timeout_s=10)
        second: list[str] = []

        async def take_second(owner: str) -> None:
            await limiter.acquire(owner)
            second.append(owner)

        await limiter.acquire("a")
        await limiter.acquire("a")
        waiting = [asyncio.create_task(take_second(owner)) for owner in ["a", "b"]]
        await asyncio.sleep(0)
        limiter.release("a")
        await asyncio.sleep(0)
        limiter.release("a")
        await asyncio.gather(*waiting)
        return order, second

    order, second = asyncio.run(scenario())
    # FIFO would have been a, a, a, b, c: "a" queued first and most.
    assert order == ["b", "c", "a", "a", "a"]
    assert second == ["b", "a"]


def test_a_waiter_that_gives_up_leaves_the_fair_queue() -> None:
    async def scenario() -> list[str]:
        limiter = ConcurrencyLimiter(max_active=1, max_queued=10, timeout_s=10)
        order: list[str] = []

        async def take(owner: str) -> None:
            await limiter.acquire(owner)
            order.append(owner)

        await limiter.acquire("a")
        quitter = asyncio.create_task(take("b"))
        stayer = asyncio.create_task(take("c"))
        await asyncio.sleep(0)
        quitter.cancel()
        await asyncio.sleep(0)
        assert limiter.num_queued == 1
        limiter.release("a")
        await stayer
        limiter.release("c")
        assert (limiter.num_active, limiter.num_queued) == (0, 0)
        return order

    assert asyncio.run(scenario()) == ["c"]


def test_a_key_that_floods_the_queue_does_not_starve_another_key(
    live_gateway: Callable[..., Any],
) -> None:
    """Key "flood" runs 60 streams at once on 4 slots (56 queued); key "steady" sends one
    request at a time. Each time one slot frees, steady's request takes it ahead of the 56."""
    limits = LimitsConfig(
        max_concurrent_requests=4, max_queued_requests=100, queue_timeout_s=60,
        default_max_concurrent_per_key=64,
    )
    auth = AuthConfig(keys=[key("flood"), key("steady")])
    config = gateway_config(mock_backend("mock", token_delay_s=0.05), limits=limits, auth=auth)
    with live_gateway(config) as gw:
        admission = gw.state.admission
        backend = gw.backend("mock")
        with held_streams(gw, bearer("flood"), 60) as running:
            wait_until(lambda: len(running) == 4 and admission.concurrency.num_queued == 56)
            for turn in range(3):
                num_admitted, num_queued = 4 + turn, 56 - turn
                wait_until(lambda: len(running) == num_admitted)  # noqa: B023 (called at once)
                assert admission.concurrency.num_queued == num_queued
                thread, answers = in_thread(lambda: httpx.post(
                    f"{gw}/v1/chat/completions", json=chat("steady work"),
                    headers=bearer("steady"), timeout=30,
                ))
                wait_until(lambda: admission.concurrency.num_queued == num_queued + 1)  # noqa: B023
                running[turn].let_go()  # one slot frees: steady's, not the oldest flood's
                thread.join(timeout=40)
                assert answers and answers[0].status_code == 200, answers
                assert answers[0].json()["choices"][0]["message"]["content"] == "steady work"
            keys = [request.api_key_id for request in backend.received]
        # Steady was served after exactly the flood requests that held the slots when it came.
        assert [i for i, k in enumerate(keys) if k == "steady"] == [4, 6, 8]
        wait_until(lambda: admission.num_in_flight == 0, timeout_s=60)
        # And the flood was not starved either: every one of its 60 requests was served.
        assert [request.api_key_id for request in backend.received].count("flood") == 60


# -- the default per-key concurrency -------------------------------------------------------


def test_a_key_without_its_own_cap_cannot_hold_queue_places_beyond_the_slots(
    live_gateway: Callable[..., Any],
) -> None:
    limits = LimitsConfig(max_concurrent_requests=2, max_queued_requests=20, queue_timeout_s=60)
    auth = AuthConfig(keys=[key("flood"), key("roomy", max_concurrent=3)])
    config = gateway_config(mock_backend("mock", token_delay_s=0.05), limits=limits, auth=auth)
    with live_gateway(config) as gw:
        admission = gw.state.admission
        backend = gw.backend("mock")
        with held_streams(gw, bearer("flood"), 2) as running:
            wait_until(lambda: len(running) == 2)
            started = backend.num_started
            refused = httpx.post(
                f"{gw}/v1/chat/completions", json=chat("more"), headers=bearer("flood"), timeout=30
            )
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["code"] == "rate_limit_exceeded"
            assert "'flood'" in error["message"] and "at most 2 at once" in error["message"]
            assert refused.headers["retry-after"]
            assert backend.num_started == started

            # A key's own max_concurrent (3) overrides the default (2): three wait in the queue.
            waiting = [
                in_thread(lambda: httpx.post(
                    f"{gw}/v1/chat/completions", json=chat("roomy"), headers=bearer("roomy"),
                    timeout=60,
                ))
                for _ in range(3)
            ]
            wait_until(lambda: admission.concurrency.num_queued == 3)
            fourth = httpx.post(
                f"{gw}/v1/chat/completions", json=chat("x"), headers=bearer("roomy"), timeout=30
            )
            assert fourth.status_code == 429
            assert "at most 3 at once" in fourth.json()["error"]["message"]
        for thread, answers in waiting:
            thread.join(timeout=60)
            assert answers[0].status_code == 200
        wait_until(lambda: admission.num_in_flight == 0)


def test_open_mode_has_no_per_key_cap_below_the_global_queue(
    live_gateway: Callable[..., Any],
) -> None:
    """Without keys there is one local user: even a default cap of 1 leaves it the queue."""
    limits = LimitsConfig(
        max_concurrent_requests=1, max_queued_requests=5, queue_timeout_s=60,
        default_max_concurrent_per_key=1,
    )
    config = gateway_config(mock_backend("mock", token_delay_s=0.05), limits=limits)
    with live_gateway(config) as gw:
        admission = gw.state.admission
        with held_streams(gw, {}, 1) as running:
            wait_until(lambda: len(running) == 1)
            waiting = [
                in_thread(lambda: httpx.post(f"{gw}/v1/chat/completions", json=chat("q"), timeout=60))
                for _ in range(3)
            ]
            wait_until(lambda: admission.concurrency.num_queued == 3)
        for thread, answers in waiting:
            thread.join(timeout=60)
            assert answers[0].status_code == 200
        wait_until(lambda: admission.num_in_flight == 0)


# -- the tokenizer's endpoints are admitted ------------------------------------------------

TOKEN_POSTS = {
    "/tokenize": {"model": "echo", "prompt": "count these words"},
    "/detokenize": {"model": "echo", "tokens": [1, 2, 3]},
    "/v1/messages/count_tokens": {
        "model": "echo", "messages": [{"role": "user", "content": "count these words"}],
    },
}


def test_tokenize_detokenize_and_count_tokens_take_the_keys_requests(
    live_gateway: Callable[..., Any],
) -> None:
    auth = AuthConfig(keys=[key("counter", rpm=4), key("other")])
    config = gateway_config(mock_backend("mock", tokenize=True), auth=auth)
    with live_gateway(config) as gw:
        remaining, answers = [], []
        for path, body in [*TOKEN_POSTS.items(), ("/tokenize", TOKEN_POSTS["/tokenize"])]:
            answer = httpx.post(f"{gw}{path}", json=body, headers=bearer("counter"), timeout=30)
            assert answer.status_code == 200, answer.text
            remaining.append(answer.headers["x-ratelimit-remaining-requests"])
            answers.append(answer.json())
        assert remaining == ["3", "2", "1", "0"]
        assert answers[0]["count"] == 3 and answers[2] == {"input_tokens": 3}
        for path, body in TOKEN_POSTS.items():
            refused = httpx.post(f"{gw}{path}", json=body, headers=bearer("counter"), timeout=30)
            assert refused.status_code == 429, (path, refused.text)
            assert "retry-after" in refused.headers
        # Another key has its own limits.
        assert httpx.post(
            f"{gw}/tokenize", json=TOKEN_POSTS["/tokenize"], headers=bearer("other"), timeout=30
        ).status_code == 200


@pytest.mark.parametrize("path", [*TOKEN_POSTS, "/v1/embeddings"])
def test_the_tokenizers_endpoints_and_embeddings_wait_for_a_global_slot(
    live_gateway: Callable[..., Any], path: str
) -> None:
    """One slot, no queue: while a stream holds the slot, each is 503 before any backend work."""
    limits = LimitsConfig(max_concurrent_requests=1, max_queued_requests=0)
    config = gateway_config(mock_backend("mock", token_delay_s=0.05, tokenize=True), limits=limits)
    body = TOKEN_POSTS.get(path, {"model": "echo", "input": "hello"})
    with live_gateway(config) as gw:
        backend = gw.backend("mock")
        with held_streams(gw, {}, 1) as running:
            wait_until(lambda: len(running) == 1)
            started = backend.num_started
            refused = httpx.post(f"{gw}{path}", json=body, timeout=30)
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert backend.num_started == started
        wait_until(lambda: gw.state.admission.num_in_flight == 0)
        if path in TOKEN_POSTS:
            assert httpx.post(f"{gw}{path}", json=body, timeout=30).status_code == 200


# -- tokenizing off the event loop -------------------------------------------------------------


def test_a_tokenize_in_progress_does_not_hold_the_event_loop(live_gateway: Any) -> None:
    """The real core engine in the gateway's process: its tokenizer is held inside ``encode``
    (an event), and the gateway still answers meanwhile. Tokenizing on the event loop would
    leave ``/health`` unanswered until the tokenizer is let go, and this test would fail."""
    from backends.base import BackendConfig

    config = gateway_config(
        BackendConfig(name="core", kind="core_engine", worker_process=False,
                      options={"num_threads": 1, "kv_cache_memory_mb": 16}),
        models={"core": ["core"]},
    )
    with live_gateway(config) as gw:
        tokenizer = gw.backend("core")._llm.engine.tokenizer
        entered, go = threading.Event(), threading.Event()
        encode = tokenizer.encode

        def held_encode(text: str, **options: Any) -> list[int]:
            if "HOLD" in text:
                entered.set()
                assert go.wait(60)
            return encode(text, **options)

        tokenizer.encode = held_encode
        answers: list[httpx.Response] = []
        asking = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{gw}/tokenize", json={"model": "core", "prompt": "HOLD " + "word " * 1000}, timeout=90)
        ))
        asking.start()
        try:
            assert entered.wait(60)
            assert httpx.get(f"{gw}/health", timeout=10).status_code == 200  # while the tokenizer is held
        finally:
            go.set()
            asking.join(90)
        assert answers[0].status_code == 200 and len(answers[0].json()["tokens"]) > 1000

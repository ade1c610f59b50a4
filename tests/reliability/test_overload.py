"""Overload: per-key rate limits (429) and the global concurrency limit and queue (503)."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import pytest
from reliability_util import assert_still_serving, chat_body, envelope, wait_until

from gateway.config.types import ApiKeyConfig, AuthConfig, LimitsConfig
from gateway.http.auth import hash_key
from gateway.testing import gateway_config, mock_backend

KEYS = AuthConfig(
    keys=[
        ApiKeyConfig(id="alice", tenant="acme", key_sha256=hash_key("k-alice"), rpm=3),
        ApiKeyConfig(id="bob", tenant="beta", key_sha256=hash_key("k-bob"), tpm=20),
        ApiKeyConfig(id="carol", tenant="acme", key_sha256=hash_key("k-carol")),
    ]
)
ALICE = {"authorization": "Bearer k-alice"}
BOB = {"authorization": "Bearer k-bob"}
CAROL = {"authorization": "Bearer k-carol"}
TEN_WORDS = " ".join(f"w{i}" for i in range(10))


def post_chat(gw: str, headers: dict[str, str], **fields: Any) -> httpx.Response:
    return httpx.post(
        f"{gw}/v1/chat/completions", json=chat_body(**fields), headers=headers, timeout=60
    )


def test_requests_per_minute_per_key(live_gateway: Any) -> None:
    with live_gateway(gateway_config(mock_backend("mock"), auth=KEYS)) as gw:
        backend = gw.backend("mock")
        remaining = []
        for _ in range(3):
            response = post_chat(gw, ALICE)
            assert response.status_code == 200
            assert response.headers["x-ratelimit-limit-requests"] == "3"
            assert response.headers["x-ratelimit-reset-requests"]
            remaining.append(int(response.headers["x-ratelimit-remaining-requests"]))
        assert remaining == [2, 1, 0]
        started = backend.num_started

        refused = post_chat(gw, ALICE)
        error = envelope(refused, 429)
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "alice" in error["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 20
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert backend.num_started == started  # refused before any backend work

        with pytest.raises(openai.RateLimitError) as caught:
            gw.openai_client(api_key="k-alice").chat.completions.create(
                model="echo", messages=chat_body()["messages"]
            )
        assert caught.value.response.headers["retry-after"]
        # Other keys have their own limits (or none).
        assert_still_serving(gw, headers=CAROL)
        assert "x-ratelimit-limit-requests" not in post_chat(gw, CAROL).headers


def test_tokens_per_minute_per_key_count_the_backends_usage(live_gateway: Any) -> None:
    with live_gateway(gateway_config(mock_backend("mock"), auth=KEYS)) as gw:
        first = post_chat(gw, BOB, messages=[{"role": "user", "content": TEN_WORDS}])
        assert first.status_code == 200
        assert first.json()["usage"]["total_tokens"] == 20
        assert first.headers["x-ratelimit-limit-tokens"] == "20"

        refused = post_chat(gw, BOB)  # the 20 tokens of the first request used the minute up
        error = envelope(refused, 429)
        assert error["code"] == "rate_limit_exceeded"
        assert "tokens per minute" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
        assert_still_serving(gw, headers=CAROL)


def test_streams_carry_the_rate_limit_headers_and_disconnects_are_charged(
    live_gateway: Any,
) -> None:
    config = gateway_config(mock_backend("mock", token_delay_s=0.05), auth=KEYS)
    with live_gateway(config) as gw:
        body = {
            "model": "echo",
            "stream": True,
            "messages": [{"role": "user", "content": TEN_WORDS}],
        }
        with httpx.stream(
            "POST", f"{gw}/v1/chat/completions", json=body, headers=BOB, timeout=60
        ) as response:
            assert response.headers["x-ratelimit-limit-tokens"] == "20"
            lines = response.iter_lines()
            while "w2" not in next(lines):  # a few tokens arrived
                pass
        # The client left after some tokens: what was produced is charged to the key.
        wait_until(lambda: gw.state.admission.num_in_flight == 0)
        after = post_chat(gw, BOB)
        assert after.status_code == 200
        assert int(after.headers["x-ratelimit-remaining-tokens"]) < 20


def test_a_full_queue_is_503_and_queued_requests_run_when_a_slot_frees(
    live_gateway: Any,
) -> None:
    limits = LimitsConfig(max_concurrent_requests=1, max_queued_requests=1, queue_timeout_s=60)
    config = gateway_config(mock_backend("mock", token_delay_s=0.05), limits=limits)
    with live_gateway(config) as gw:
        admission = gw.state.admission
        long_body = {
            "model": "echo",
            "stream": True,
            "messages": [{"role": "user", "content": " ".join(["tok"] * 400)}],
        }
        queued: list[httpx.Response] = []
        with httpx.stream("POST", f"{gw}/v1/chat/completions", json=long_body, timeout=60) as held:
            lines = held.iter_lines()
            next(lines)  # the first request holds the only slot
            waiter = threading.Thread(target=lambda: queued.append(post_chat(gw, {})))
            waiter.start()
            wait_until(lambda: admission.concurrency.num_queued == 1)

            refused = post_chat(gw, {})
            error = envelope(refused, 503)
            assert (error["type"], error["code"]) == ("server_error", "server_is_overloaded")
            assert refused.headers["retry-after"] == "1"
            completion = httpx.post(
                f"{gw}/v1/completions", json={"model": "echo", "prompt": "x"}, timeout=60
            )
            assert envelope(completion, 503)["code"] == "server_is_overloaded"
            # Cheap endpoints are not generation requests: never queued.
            assert httpx.get(f"{gw}/v1/models").status_code == 200
        # The held stream was abandoned: its slot goes to the queued request.
        waiter.join(timeout=60)
        assert queued[0].status_code == 200
        wait_until(lambda: admission.num_in_flight == 0)
        assert_still_serving(gw)


def test_waiting_longer_than_the_queue_timeout_is_503(live_gateway: Any) -> None:
    limits = LimitsConfig(max_concurrent_requests=1, max_queued_requests=8, queue_timeout_s=0.3)
    config = gateway_config(mock_backend("mock", first_token_delay_s=30.0), limits=limits)
    with live_gateway(config) as gw:
        backend = gw.backend("mock")

        def hold_the_slot() -> None:
            with pytest.raises(httpx.ReadTimeout):  # gives up after 2 s, freeing the slot
                httpx.post(
                    f"{gw}/v1/chat/completions",
                    json=chat_body(),
                    timeout=httpx.Timeout(30.0, read=2.0),
                )

        blocker = threading.Thread(target=hold_the_slot)
        blocker.start()
        wait_until(lambda: backend.num_active == 1)
        refused = post_chat(gw, {})
        error = envelope(refused, 503)
        assert error["code"] == "server_is_overloaded"
        assert "within 0.3 s" in error["message"]
        assert refused.headers["retry-after"] == "1"
        assert backend.num_started == 1  # the refused request never reached the backend
        blocker.join(timeout=30)
        wait_until(lambda: gw.state.admission.num_in_flight == 0)


def test_a_client_that_gives_up_in_the_queue_leaves_it(live_gateway: Any) -> None:
    limits = LimitsConfig(max_concurrent_requests=1, max_queued_requests=8, queue_timeout_s=60)
    config = gateway_config(mock_backend("mock", token_delay_s=0.05), limits=limits)
    with live_gateway(config) as gw:
        admission = gw.state.admission
        backend = gw.backend("mock")
        body = {
            "model": "echo",
            "stream": True,
            "messages": [{"role": "user", "content": "a " * 300}],
        }
        with httpx.stream("POST", f"{gw}/v1/chat/completions", json=body, timeout=60) as held:
            lines = held.iter_lines()
            next(lines)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    f"{gw}/v1/chat/completions",
                    json=chat_body(),
                    timeout=httpx.Timeout(30.0, read=0.3),
                )
            wait_until(lambda: admission.concurrency.num_queued == 0)
        wait_until(lambda: admission.num_in_flight == 0)
        assert backend.num_started == 1  # the impatient request never reached the backend
        assert_still_serving(gw)


def test_a_keys_concurrent_requests_are_capped(live_gateway: Any) -> None:
    keys = AuthConfig(keys=[ApiKeyConfig(id="dan", key_sha256=hash_key("k-dan"), max_concurrent=1)])
    dan = {"authorization": "Bearer k-dan"}
    config = gateway_config(mock_backend("mock", token_delay_s=0.05), auth=keys)
    with live_gateway(config) as gw, httpx.Client(timeout=60) as client:
        body = chat_body(stream=True, messages=[{"role": "user", "content": TEN_WORDS}])
        with client.stream("POST", f"{gw}/v1/chat/completions", json=body, headers=dan) as held:
            lines = held.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            error = envelope(post_chat(gw, dan), 429)
            assert error["code"] == "rate_limit_exceeded"
            assert "at most 1 at once" in error["message"]
            assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
        assert_still_serving(gw, headers=dan)  # the slot came back with the stream's end

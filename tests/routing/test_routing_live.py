"""Routing through a live gateway, with several real upstream servers behind one alias.

Each upstream is an OpenAI-shaped HTTP server on loopback (tests/upstream_server.py) told to
answer, refuse, fail, stall or die; the gateway reaches them through ``openai`` backends.
Assertions are what a client sees (status, body, headers, SSE frames) and what each
upstream received.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from upstream_server import Behaviour, UpstreamServer, closed_port_url

from backends.base import BackendConfig
from gateway.testing import LiveGateway, gateway_config

StartUpstream = Callable[..., UpstreamServer]
LiveGatewayFactory = Callable[..., AbstractContextManager[LiveGateway]]


def _remote(name: str, base_url: str, **settings: Any) -> BackendConfig:
    return BackendConfig(name=name, kind="openai", options={"base_url": base_url}, **settings)


def _chat(gateway: str, text: str = "hello there", **extra: Any) -> httpx.Response:
    headers = extra.pop("headers", {})
    body = {"model": "echo", "messages": [{"role": "user", "content": text}], **extra}
    return httpx.post(f"{gateway}/v1/chat/completions", json=body, headers=headers, timeout=30)


def _sse_frames(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


@pytest.fixture
def two_upstreams(upstream_servers: StartUpstream) -> tuple[UpstreamServer, UpstreamServer]:
    return upstream_servers(name="a"), upstream_servers(name="b")


def test_fallback_when_the_first_backend_refuses(
    live_gateway: LiveGatewayFactory, upstream_servers: StartUpstream
) -> None:
    b = upstream_servers(name="b")
    config = gateway_config(_remote("a", closed_port_url()), _remote("b", b.base_url))
    with live_gateway(config) as gateway:
        response = _chat(gateway)
    assert response.status_code == 200
    assert response.headers["x-infermux-backend"] == "b"
    assert response.json()["choices"][0]["message"]["content"] == "hello there"


def test_retry_on_5xx_before_the_first_byte(
    live_gateway: LiveGatewayFactory, two_upstreams: tuple[UpstreamServer, UpstreamServer]
) -> None:
    a, b = two_upstreams
    a.behaviour = Behaviour(mode="status", status=502)
    config = gateway_config(_remote("a", a.base_url), _remote("b", b.base_url))
    with live_gateway(config) as gateway:
        response = _chat(gateway, stream=True)
        frames = _sse_frames(response)
    assert response.status_code == 200
    assert response.headers["x-infermux-backend"] == "b"
    assert frames[-1] == "[DONE]"
    assert (a.num_requests, b.num_requests) == (1, 1)


def test_no_retry_after_the_first_byte(
    live_gateway: LiveGatewayFactory, two_upstreams: tuple[UpstreamServer, UpstreamServer]
) -> None:
    a, b = two_upstreams
    a.behaviour = Behaviour(mode="die_mid_stream", after_chunks=2)
    config = gateway_config(_remote("a", a.base_url), _remote("b", b.base_url))
    with live_gateway(config) as gateway:
        with httpx.stream(
            "POST",
            f"{gateway}/v1/chat/completions",
            json={
                "model": "echo",
                "stream": True,
                "messages": [{"role": "user", "content": "one two three four"}],
            },
            timeout=30,
        ) as response:
            frames = _sse_frames(response)
    assert response.status_code == 200
    assert "[DONE]" not in frames
    error = json.loads(frames[-1])["error"]
    assert error["type"] == "server_error"
    content = "".join(
        (json.loads(f)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
        for f in frames[:-1]
    )
    assert content == "one two"
    assert b.num_requests == 0


def test_round_robin_spreads_over_upstreams(
    live_gateway: LiveGatewayFactory, upstream_servers: StartUpstream
) -> None:
    ups = [upstream_servers(name=n) for n in "abc"]
    config = gateway_config(
        *(_remote(n, u.base_url) for n, u in zip("abc", ups, strict=True)), strategy="round_robin"
    )
    with live_gateway(config) as gateway:
        served = [_chat(gateway).headers["x-infermux-backend"] for _ in range(6)]
    assert sorted(served) == ["a", "a", "b", "b", "c", "c"]
    assert [u.num_requests for u in ups] == [2, 2, 2]


def test_least_outstanding_avoids_a_busy_upstream(
    live_gateway: LiveGatewayFactory, two_upstreams: tuple[UpstreamServer, UpstreamServer]
) -> None:
    a, b = two_upstreams
    # The first request (pinned to "a") stalls mid-stream and stays open meanwhile.
    a.script(Behaviour(mode="stall_mid_stream", after_chunks=1))
    config = gateway_config(
        _remote("a", a.base_url), _remote("b", b.base_url), strategy="least_outstanding"
    )
    with live_gateway(config) as gateway, httpx.Client(timeout=30) as client:
        body = {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "x y"}]}
        pin = {"x-infermux-backend": "a"}
        with client.stream(
            "POST", f"{gateway}/v1/chat/completions", json=body, headers=pin
        ) as held:
            busy = held.headers["x-infermux-backend"]
            lines = held.iter_lines()  # kept referenced: a dropped iterator closes the stream
            next(lines)  # the stream is open on "a"
            served = [_chat(gateway).headers["x-infermux-backend"] for _ in range(3)]
    assert busy == "a"
    assert served == ["b", "b", "b"]


def test_circuit_opens_and_half_opens_after_the_cooldown(
    live_gateway: LiveGatewayFactory, two_upstreams: tuple[UpstreamServer, UpstreamServer]
) -> None:
    a, b = two_upstreams
    a.behaviour = Behaviour(mode="status", status=500)
    settings = {"circuit_failure_threshold": 2, "circuit_cooldown_s": 0.5}
    config = gateway_config(_remote("a", a.base_url, **settings), _remote("b", b.base_url))
    with live_gateway(config) as gateway:
        assert all(_chat(gateway).status_code == 200 for _ in range(2))
        assert httpx.get(f"{gateway}/ready").json()["circuits"]["a"] == "open"
        assert _chat(gateway).headers["x-infermux-backend"] == "b"
        assert a.num_requests == 2  # not tried while open

        a.behaviour = Behaviour()  # the upstream recovers
        time.sleep(0.6)  # the cool-down passes
        assert httpx.get(f"{gateway}/ready").json()["circuits"]["a"] == "half_open"
        response = _chat(gateway)
        assert response.headers["x-infermux-backend"] == "a"  # the probe
        assert httpx.get(f"{gateway}/ready").json()["circuits"]["a"] == "closed"


def test_pinned_backend_header(
    live_gateway: LiveGatewayFactory, two_upstreams: tuple[UpstreamServer, UpstreamServer]
) -> None:
    a, b = two_upstreams
    config = gateway_config(_remote("a", a.base_url), _remote("b", b.base_url))
    with live_gateway(config) as gateway:
        pinned = _chat(gateway, headers={"x-infermux-backend": "b"})
        unknown = _chat(gateway, headers={"x-infermux-backend": "nope"})
    assert pinned.status_code == 200
    assert pinned.headers["x-infermux-backend"] == "b"
    assert (a.num_requests, b.num_requests) == (0, 1)
    assert unknown.status_code == 400
    assert unknown.json()["error"]["code"] == "unknown_backend"


def test_first_byte_timeout_is_504_and_cancels_upstream(
    live_gateway: LiveGatewayFactory, upstream_servers: StartUpstream
) -> None:
    a = upstream_servers(Behaviour(mode="stall_before_headers"), name="a")
    config = gateway_config(_remote("a", a.base_url, first_byte_timeout=0.3))
    with live_gateway(config) as gateway:
        response = _chat(gateway)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "upstream_timeout"
        a.wait_until(lambda: a.num_disconnects == 1)


def test_no_backend_left_is_503_with_retry_after(live_gateway: LiveGatewayFactory) -> None:
    config = gateway_config(_remote("a", closed_port_url()), _remote("b", closed_port_url()))
    with live_gateway(config) as gateway:
        response = _chat(gateway)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "backend_unavailable"
    assert int(response.headers["retry-after"]) >= 1


def test_upstream_429_passes_through_with_retry_after(
    live_gateway: LiveGatewayFactory, upstream_servers: StartUpstream
) -> None:
    a = upstream_servers(Behaviour(mode="status", status=429, retry_after="7"), name="a")
    with live_gateway(gateway_config(_remote("a", a.base_url))) as gateway:
        response = _chat(gateway)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7"


def test_client_disconnect_closes_the_upstream_stream(
    live_gateway: LiveGatewayFactory, upstream_servers: StartUpstream
) -> None:
    a = upstream_servers(Behaviour(mode="stall_mid_stream", after_chunks=1), name="a")
    with live_gateway(gateway_config(_remote("a", a.base_url))) as gateway:
        body = {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "x y"}]}
        with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            while "x" not in next(lines):  # the first content frame arrived
                pass
        # Leaving the block closed the client connection mid-stream.
        a.wait_until(lambda: a.num_disconnects == 1)

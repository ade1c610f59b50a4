"""Context, KV memory, timeouts and disconnects with the real in-process backends.

The default model (SmolLM2-135M-Instruct) behind both the native engine (``core_engine``,
with a deliberately tiny KV pool) and llama.cpp (a small context window), loaded once for
the module.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from reliability_util import (
    assert_still_serving,
    envelope,
    recording_plugins,
    sse_frames,
    wait_until,
)

from backends.base import BackendConfig
from backends.errors import GenerationAbortedError
from gateway.testing import LiveGateway, gateway_config

pytestmark = pytest.mark.slow

#: A few MB of KV cache: a handful of 16-token blocks (the fixture reads the real count).
KV_CACHE_MB = 6
LLAMA_CTX = 256


@pytest.fixture(scope="module")
def recorded(live_gateway: Any) -> Iterator[tuple[LiveGateway, Any]]:
    pm, recorder = recording_plugins()
    llama = {"n_ctx": LLAMA_CTX}
    config = gateway_config(
        BackendConfig(
            name="core",
            kind="core_engine",
            options={"kv_cache_memory_mb": KV_CACHE_MB, "max_num_seqs": 8},
        ),
        BackendConfig(name="llama", kind="llamacpp", options=llama),
        BackendConfig(name="llama_short", kind="llamacpp", options=llama, total_timeout=0.5),
        models={"core": ["core"], "llama": ["llama"], "llama_short": ["llama_short"]},
    )
    with live_gateway(config, plugin_manager=pm) as gateway:
        yield gateway, recorder


@pytest.fixture(scope="module")
def gw(recorded: tuple[LiveGateway, Any]) -> LiveGateway:
    return recorded[0]


def kv_capacity(gw: LiveGateway) -> int:
    """The engine's KV pool in tokens, as its worker process reports it."""
    wait_until(lambda: "kv_cache_capacity_tokens" in gw.backend("core").stats(), timeout_s=30)
    return int(gw.backend("core").stats()["kv_cache_capacity_tokens"])


def kv_all_free(gw: LiveGateway) -> bool:
    """No request left in the engine and every block free (the worker's last report)."""
    stats = gw.backend("core").stats()
    return "num_running" in stats and (
        stats["num_running"] == stats["num_waiting"] == 0
        and stats["kv_cache_num_free_blocks"] == stats["kv_cache_num_blocks"]
    )


def complete(gw: str, model: str, **fields: Any) -> httpx.Response:
    body = {"model": model, "prompt": "Once upon a time", "temperature": 0, **fields}
    return httpx.post(f"{gw}/v1/completions", json=body, timeout=300)


def test_a_request_that_can_never_fit_the_kv_pool_is_400(gw: LiveGateway) -> None:
    capacity = kv_capacity(gw)
    error = envelope(complete(gw, "core", max_tokens=capacity + 16), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
    assert "KV cache" in error["message"]
    wait_until(lambda: kv_all_free(gw), timeout_s=30)
    assert_still_serving(gw, model="core")


def test_more_work_than_kv_memory_is_queued_or_preempted_never_a_crash(gw: LiveGateway) -> None:
    capacity = kv_capacity(gw)
    max_tokens = capacity // 2 - 8  # each fits alone; four at once do not
    answers: list[dict[str, Any]] = []

    def one() -> None:
        response = complete(gw, "core", max_tokens=max_tokens, ignore_eos=True)
        assert response.status_code == 200, response.text
        answers.append(response.json())

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert len(answers) == 4
    for answer in answers:
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == max_tokens
    wait_until(lambda: kv_all_free(gw), timeout_s=30)


def test_client_disconnect_aborts_the_engine_request_and_frees_its_blocks(
    recorded: tuple[LiveGateway, Any],
) -> None:
    gw, recorder = recorded
    body = {
        "model": "core",
        "prompt": "Once upon a time",
        "max_tokens": kv_capacity(gw) - 16,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{gw}/v1/completions", json=body, timeout=300) as response:
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    wait_until(lambda: kv_all_free(gw), timeout_s=30)
    wait_until(lambda: len(recorder.records_of(request_id)) == 1)
    (record,) = recorder.records_of(request_id)
    assert isinstance(record["error"], GenerationAbortedError)
    assert record["backend"] == "core"
    assert_still_serving(gw, model="core")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": LLAMA_CTX}, "max_tokens"),
    ],
)
def test_llamacpp_checks_the_context_with_the_real_token_count(
    gw: LiveGateway, fields: dict[str, Any], param: str
) -> None:
    response = httpx.post(
        f"{gw}/v1/chat/completions", json={"model": "llama", **fields}, timeout=120
    )
    error = envelope(response, 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert_still_serving(gw, model="llama")


def test_llamacpp_total_timeout_ends_the_stream_and_frees_the_worker(gw: LiveGateway) -> None:
    body = {
        "model": "llama_short",
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{gw}/v1/completions", json=body, timeout=120) as response:
        frames = sse_frames(response)
    assert json.loads(frames[-1])["error"]["code"] == "upstream_timeout"
    assert "[DONE]" not in frames
    # The worker thread let go of the request: the next one on the same backend is served
    # (within its own 0.5 s, which a loaded machine may miss once: a few tries).
    wait_until(lambda: complete(gw, "llama_short", max_tokens=1).status_code == 200, timeout_s=20)


def test_llamacpp_client_disconnect_stops_generation(gw: LiveGateway) -> None:
    backend = gw.backend("llama")
    before = backend.num_generated_tokens
    body = {
        "model": "llama",
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{gw}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    seen = {"count": -1, "since": time.monotonic()}

    def settled() -> bool:  # no new token for half a second: generation has stopped
        count = backend.num_generated_tokens
        if count != seen["count"]:
            seen.update(count=count, since=time.monotonic())
        return time.monotonic() - seen["since"] > 0.5

    wait_until(settled, timeout_s=30)
    assert backend.num_generated_tokens - before < 200
    assert_still_serving(gw, model="llama")

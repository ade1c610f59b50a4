"""A tensor-parallel core engine through the gateway: a rank killed mid-request.

The backend runs ``tensor_parallel_size = 2`` in its (default) engine process, which starts
rank 1 as its own child process; the test kills that rank with SIGKILL while a request
decodes. The request must end (bounded by the group's timeout, never a hang) with a retryable
error or fall back, ``/ready`` must say why while the engine is down, and the supervisor must
start a fresh engine (both ranks) that serves the same greedy text as before.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from reliability_util import wait_until

from backends.base import BackendConfig
from backends.worker import WorkerBackend
from gateway.testing import LiveGateway, gateway_config, mock_backend


def rank_pids(engine_pid: int) -> list[int]:
    """The engine process's tensor-parallel ranks (its children running the rank worker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == engine_pid and b"core_engine.distributed.worker" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def tp_gateway(live_gateway: Any) -> Iterator[LiveGateway]:
    config = gateway_config(
        BackendConfig(
            name="core", kind="core_engine",
            options={"num_threads": 2, "kv_cache_memory_mb": 64, "max_num_seqs": 4,
                     "tensor_parallel_size": 2, "tensor_parallel_timeout_s": 10},
        ),
        mock_backend("local"),
        models={"core": ["core"], "core_or_local": ["core", "local"]},
    )  # fmt: skip
    with live_gateway(config) as gw:
        yield gw


def greedy(gw: LiveGateway) -> str:
    reply = gw.openai_client().chat.completions.create(
        model="core", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=12, temperature=0,
    )
    return reply.choices[0].message.content or ""


@pytest.mark.slow
def test_a_killed_rank_fails_its_request_promptly_and_the_engine_comes_back(tp_gateway: LiveGateway) -> None:
    gw = tp_gateway
    backend = gw.backend("core")
    assert isinstance(backend, WorkerBackend) and backend.pid is not None
    before = greedy(gw)
    assert before
    wait_until(lambda: backend.stats().get("tensor_parallel_size") == 2.0, timeout_s=10)
    ranks = rank_pids(backend.pid)
    assert len(ranks) == 1
    restarts = backend.restarts
    result: dict[str, Any] = {}

    def long_request() -> None:
        body = {"model": "core_or_local", "max_tokens": 400, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Tell me a long story."}]}
        started = time.monotonic()
        result["response"] = httpx.post(f"{gw}/v1/chat/completions", json=body, timeout=120)
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_until(lambda: backend.num_generated_tokens > 10, timeout_s=60)
    os.kill(ranks[0], signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the request hung after a rank died"
    response = result["response"]
    if response.status_code == 200:  # not started when it died: served by the next backend
        assert response.headers["x-infermux-backend"] == "local"
    else:
        assert response.status_code == 503 and "retry-after" in response.headers
        assert response.json()["error"]["code"] == "backend_unavailable"
    wait_until(lambda: backend.state == "up" and backend.restarts >= restarts + 1, timeout_s=180)
    assert httpx.get(f"{gw}/ready").status_code == 200
    new_ranks = rank_pids(backend.pid)
    assert len(new_ranks) == 1 and new_ranks != ranks
    assert greedy(gw) == before

"""A circuit opened on one replica opens on the other through the shared Redis: the other
replica stops sending requests to the failing upstream without failing on it first."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from servers import RedisServer, serving
from upstream_server import Behaviour, UpstreamServer


def test_a_circuit_opened_on_one_replica_keeps_the_other_away(
    redis: RedisServer, tmp_path: Path
) -> None:
    with UpstreamServer(Behaviour(mode="status", status=503)) as upstream, ExitStack() as stack:
        config = tmp_path / "circuit.toml"
        config.write_text(
            '[state]\nbackend = "redis"\nurl_env = "TEST_REDIS_URL"\n'
            '[[backends]]\nname = "up"\nkind = "openai"\n'
            "circuit_failure_threshold = 1\ncircuit_cooldown_s = 60.0\n"
            f'[backends.options]\nbase_url = "{upstream.base_url}"\nmodel = "m"\n'
            '[[backends]]\nname = "fallback"\nkind = "mock"\n'
            '[[models]]\nalias = "echo"\nbackends = ["up", "fallback"]\n'
        )
        env = {"TEST_REDIS_URL": redis.url, "INFERMUX_LEDGER_PATH": str(tmp_path / "l.db")}
        a, b = (stack.enter_context(serving(config, env)) for _ in range(2))

        def chat(gw: object) -> httpx.Response:
            return httpx.post(
                f"{gw}/v1/chat/completions",
                json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
                timeout=30,
            )

        first = chat(a)
        assert first.status_code == 200 and first.headers["x-infermux-backend"] == "fallback"
        assert upstream.num_requests == 1  # the 503 opened a's circuit
        deadline = time.monotonic() + 30
        while httpx.get(f"{b}/ready").json()["circuits"]["up"] != "open":
            assert time.monotonic() < deadline, "b never saw the shared circuit"
            time.sleep(0.1)
        second = chat(b)
        assert second.status_code == 200 and second.headers["x-infermux-backend"] == "fallback"
        assert upstream.num_requests == 1  # b never tried the failing upstream
        assert "opened by another replica" in b.log_path.read_text()

"""The ledger survives ``kill -9``: every response that completed is in it after a restart."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import httpx

from tests.telemetry.served_process import ServedGateway, mock_config_toml


def test_after_sigkill_mid_load_the_ledger_opens_cleanly_and_lost_nothing_completed(
    tmp_path: Path,
) -> None:
    ledger = tmp_path / "ledger.sqlite3"
    config = mock_config_toml(tmp_path / "infermux.toml", token_delay_s=0.01)
    env = {"INFERMUX_LEDGER_PATH": str(ledger), "OTEL_SDK_DISABLED": "true"}
    completed: list[str] = []
    lock = threading.Lock()
    enough = threading.Event()

    def client(url: str, worker: int) -> None:
        payload = {
            "model": "echo",
            "messages": [{"role": "user", "content": " ".join(f"t{i}" for i in range(20))}],
        }
        with httpx.Client(base_url=url, timeout=30) as http:
            for i in range(10_000):
                stream = (worker + i) % 2 == 0
                try:
                    with http.stream(
                        "POST", "/v1/chat/completions", json={**payload, "stream": stream}
                    ) as answer:
                        body = answer.read()
                        request_id = answer.headers["x-request-id"]
                except httpx.HTTPError:
                    return  # the server is gone
                finished = (
                    body.rstrip().endswith(b"data: [DONE]")
                    if stream
                    else (json.loads(body)["choices"][0]["finish_reason"] == "stop")
                )
                if finished:
                    with lock:
                        completed.append(request_id)
                        if len(completed) >= 40:
                            enough.set()

    server = ServedGateway(config, env=env, log=tmp_path / "first.log").wait_ready()
    workers = [threading.Thread(target=client, args=(server.url, w)) for w in range(8)]
    for worker in workers:
        worker.start()
    assert enough.wait(120), server.log.read_text()
    server.kill()  # mid-load: eight requests are in flight right now
    for worker in workers:
        worker.join(60)
    server.stop()

    with ServedGateway(config, env=env, log=tmp_path / "second.log") as restarted:
        usage = httpx.get(f"{restarted.url}/v1/usage").json()
        with sqlite3.connect(ledger) as connection:
            assert connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            recorded = {
                row[0]: row[1]
                for row in connection.execute("SELECT request_id, status FROM usage_records")
            }
    missing = [request_id for request_id in completed if request_id not in recorded]
    assert not missing, f"{len(missing)} of {len(completed)} completed requests lost"
    assert all(recorded[request_id] == "ok" for request_id in completed)
    assert usage["totals"]["requests"] == len(recorded) >= len(completed)

"""What tracing, metrics and the usage ledger add to a request's latency, side by side.

The same gateway (one mock backend, no token delay, so the gateway is all there is to
measure) runs in four set-ups, and the same sequential requests go to each, interleaved
round by round so that machine noise hits all alike:

* ``bare``        - ``builtin.cost``, ``builtin.metrics`` and ``builtin.tracing`` disabled
* ``default``     - metrics + the ledger (``synchronous = "normal"``), tracing off
* ``ledger_full`` - as default, ledger with ``synchronous = "full"`` (an fsync per commit)
* ``tracing_down``- as default, plus tracing to a collector that is not there

Printed: p50 / p99 latency of non-streaming and streaming requests per set-up, and each
p50 as a ratio of ``bare``. The ``tracing_down`` ratio is the "unreachable collector costs
nothing" claim of docs/observability.md.

    .venv/bin/python benchmarks/observability_overhead.py             # 300 rounds
    .venv/bin/python benchmarks/observability_overhead.py --rounds 50 # a short proof run
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from gateway.config.load import config_from_dict  # noqa: E402
from gateway.testing import run_gateway  # noqa: E402

SETUPS = ("bare", "default", "ledger_full", "tracing_down")


def _config(setup: str, folder: Path) -> Any:
    raw: dict[str, Any] = {
        "backends": [{"name": "mock", "kind": "mock"}],
        "models": [{"alias": "echo", "backends": ["mock"]}],
        "cost": {"ledger_path": str(folder / f"{setup}.sqlite3")},
    }
    if setup == "bare":
        raw["plugins"] = {"disable": ["builtin.cost", "builtin.metrics", "builtin.tracing"]}
    if setup == "ledger_full":
        raw["cost"]["synchronous"] = "full"
    # The OTLP endpoint variable below is process-wide: only tracing_down may trace.
    raw["telemetry"] = {"tracing": {"enabled": setup == "tracing_down"}}
    return config_from_dict(raw)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _request(client: httpx.Client, stream: bool) -> float:
    payload = {
        "model": "echo",
        "messages": [{"role": "user", "content": "one two three four five six seven eight"}],
        "stream": stream,
    }
    started = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=payload) as answer:
        answer.read()
        assert answer.status_code == 200, answer.text
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    # The tracing_down set-up exports to a port where nothing listens.
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = (
        f"http://127.0.0.1:{_closed_port()}/v1/traces"
    )
    os.environ["OTEL_METRICS_EXPORTER"] = "none"
    samples: dict[tuple[str, bool], list[float]] = {
        (s, st): [] for s in SETUPS for st in (False, True)
    }
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        clients = {}
        for setup in SETUPS:
            gateway = stack.enter_context(run_gateway(_config(setup, Path(tmp))))
            clients[setup] = stack.enter_context(httpx.Client(base_url=gateway, timeout=30))
        for client in clients.values():  # warm-up: connections, first-use imports
            for stream in (False, True):
                for _ in range(10):
                    _request(client, stream)
        for _ in range(args.rounds):
            for setup in SETUPS:
                for stream in (False, True):
                    samples[(setup, stream)].append(_request(clients[setup], stream))
    print(f"{'set-up':<14}{'mode':<8}{'p50 ms':>9}{'p99 ms':>9}{'p50 / bare':>12}")
    for stream in (False, True):
        bare = statistics.median(samples[("bare", stream)])
        for setup in SETUPS:
            values = sorted(samples[(setup, stream)])
            p50 = statistics.median(values)
            p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
            mode = "stream" if stream else "body"
            print(f"{setup:<14}{mode:<8}{p50 * 1e3:>9.2f}{p99 * 1e3:>9.2f}{p50 / bare:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

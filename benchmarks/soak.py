"""Soak: many mixed requests at high concurrency with client disconnects, then leak checks.

The gateway runs in this process (uvicorn on a free loopback port, real HTTP, the built-in
plugins with the usage ledger in a temporary file); the load comes from a child process
(``--client`` mode) so that the figures measured here are the server's own. The mix:
chat and completions, streaming and not, ``n`` = 2, invalid requests (400) and unknown
models (404); ``--disconnect-ratio`` of all requests (all drawn among the valid ones) are
abandoned by the client: a stream after its first frames, a plain request after 10 ms.

After a warm-up and after the soak, once the gateway is idle again, it measures open file
descriptors, asyncio tasks and threads of the server, and its RSS. Checks:

* file descriptors and asyncio tasks back to their warm-up level; threads within what the
  lazily growing thread pools may add,
* RSS growth under 10 %,
* no admission slot or backend stream left open,
* every KV block free again (``--backend core_engine``),
* ledger rows = HTTP requests that reached a backend (counted by a plugin on
  ``infermux_on_attempt_start``), each exactly once.

    .venv/bin/python benchmarks/soak.py                              # 10,000 requests, mock
    .venv/bin/python benchmarks/soak.py --num-requests 2000          # a shorter run
    .venv/bin/python benchmarks/soak.py --backend core_engine --num-requests 200 --concurrency 16

Prints a summary and writes ``benchmarks/results/soak-<UTC time>.json``; exits 1 when a
check fails. Not part of the test suite (it runs for minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as dt
import gc
import json
import os
import platform
import random
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from plugins.hookspecs import hookimpl

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = ROOT / "benchmarks" / "results"

#: Requests sent, at the full concurrency, before the baseline is measured: imports, pools,
#: caches and the allocator's high-water mark for that many connections warm up (a tenth of
#: the run when that is less).
NUM_WARMUP = 1000
RSS_GROWTH_LIMIT = 0.10


# -- the client (a child process) ---------------------------------------------------------

#: The request mix (relative weights); the last two are refused before any backend work.
_MIX = {
    "chat_stream": 30,
    "chat": 25,
    "completion_stream": 10,
    "completion": 10,
    "chat_n2": 10,
    "invalid": 8,
    "unknown": 7,
}
_REFUSED = ("invalid", "unknown")


def _request_plan(index: int, rng: random.Random, disconnect_ratio: float) -> dict[str, Any]:
    """One request of the mix: endpoint, body, whether the client abandons it."""
    words = " ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randint(3, 40)))
    kind = rng.choices(list(_MIX), weights=list(_MIX.values()))[0]
    max_tokens = rng.randint(4, 24)
    if kind.startswith("chat"):
        path = "/v1/chat/completions"
        body: dict[str, Any] = {
            "model": "soak",
            "messages": [{"role": "user", "content": words}],
            "max_tokens": max_tokens,
        }
    else:
        path = "/v1/completions"
        body = {"model": "soak", "prompt": words, "max_tokens": max_tokens}
    body["stream"] = kind.endswith("stream")
    if kind == "chat_n2":
        body["n"] = 2
    if kind == "invalid":
        body["temperature"] = 7
    if kind == "unknown":
        body["model"] = f"missing-{index}"
    valid = kind not in _REFUSED
    # Only requests that do work can be abandoned mid-way: they carry the whole ratio.
    valid_share = sum(w for k, w in _MIX.items() if k not in _REFUSED) / sum(_MIX.values())
    return {
        "kind": kind,
        "path": path,
        "body": body,
        "disconnect": valid and rng.random() < disconnect_ratio / valid_share,
    }


async def _client_main(
    base_url: str, num_requests: int, concurrency: int, disconnect_ratio: float, seed: int
) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    plans = [_request_plan(i, rng, disconnect_ratio) for i in range(num_requests)]
    outcomes: collections.Counter[str] = collections.Counter()
    statuses: collections.Counter[int] = collections.Counter()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for plan in plans:
        queue.put_nowait(plan)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0, limits=limits) as client:

        async def one(plan: dict[str, Any]) -> None:
            body = plan["body"]
            if body["stream"]:
                async with client.stream("POST", plan["path"], json=body) as response:
                    statuses[response.status_code] += 1
                    frames = 0
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            frames += 1
                            if plan["disconnect"] and frames >= 2:
                                outcomes["disconnected_stream"] += 1
                                return  # leaving the block closes the connection
                outcomes["completed_stream"] += 1
                return
            if plan["disconnect"]:
                try:
                    response = await asyncio.wait_for(client.post(plan["path"], json=body), 0.01)
                except TimeoutError:
                    outcomes["disconnected_plain"] += 1
                    return
            else:
                response = await client.post(plan["path"], json=body)
            statuses[response.status_code] += 1
            outcomes["completed_plain"] += 1

        async def worker() -> None:
            while not queue.empty():
                plan = queue.get_nowait()
                try:
                    await one(plan)
                except httpx.HTTPError as exc:
                    outcomes[f"transport_error:{type(exc).__name__}"] += 1

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - started
    return {
        "num_requests": num_requests,
        "elapsed_s": elapsed,
        "requests_per_s": num_requests / elapsed,
        "outcomes": dict(outcomes),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "planned_disconnects": sum(p["disconnect"] for p in plans),
    }


def _run_client(
    base_url: str, num_requests: int, concurrency: int, ratio: float, seed: int
) -> dict[str, Any]:
    """The load, from a child process; its report as a dict."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--client",
        base_url,
        "--num-requests",
        str(num_requests),
        "--concurrency",
        str(concurrency),
        "--disconnect-ratio",
        str(ratio),
        "--seed",
        str(seed),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the load client failed:\n{done.stderr}")
    return json.loads(done.stdout)


# -- the server (this process) ------------------------------------------------------------


class AttemptCounter:
    """Plugin: how many HTTP requests reached a backend, and the server's event loop.

    A request reached a backend when its choice 0 made its first try (every choice of a
    request is opened at once). A count, not a set of ids, so that the harness itself does
    not add to the memory it measures.
    """

    def __init__(self) -> None:
        self.num_reached = 0
        self.loop: asyncio.AbstractEventLoop | None = None

    @hookimpl
    def infermux_on_attempt_start(self, request: Any, attempt: int) -> None:
        self.loop = asyncio.get_running_loop()
        if attempt == 0 and request.choice_index == 0:
            self.num_reached += 1


def _process_figures(counter: AttemptCounter) -> dict[str, int]:
    gc.collect()
    rss_kib = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    tasks = -1
    if counter.loop is not None:

        async def count() -> int:
            return len(asyncio.all_tasks())

        tasks = asyncio.run_coroutine_threadsafe(count(), counter.loop).result(timeout=30)
    return {
        "open_fds": len(os.listdir("/proc/self/fd")),
        "asyncio_tasks": tasks,
        "threads": threading.active_count(),
        "rss_kib": rss_kib,
    }


def _wait_idle(gw: Any, timeout_s: float = 120.0) -> None:
    """Until no request is admitted and no backend stream is open (then a short settle)."""
    state = gw.state
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        router = state.router
        open_streams = sum(router.outstanding().values()) if router is not None else 0
        if state.admission.num_in_flight == 0 and open_streams == 0:
            break
        time.sleep(0.05)
    time.sleep(1.0)  # background reporting and closed connections finish


def _ledger_rows(path: Path) -> tuple[int, int]:
    """(rows, distinct request ids) of the usage ledger."""
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows, distinct = connection.execute(
            "SELECT COUNT(*), COUNT(DISTINCT request_id) FROM usage_records"
        ).fetchone()
    finally:
        connection.close()
    return int(rows), int(distinct)


def _config(backend: str, ledger: Path, concurrency: int) -> Any:
    import msgspec

    from backends.base import BackendConfig
    from gateway.config.types import LimitsConfig
    from gateway.testing import gateway_config
    from plugins.builtin.cost.config import CostConfig

    if backend == "core_engine":
        backend_config = BackendConfig(
            name="soak-backend",
            kind="core_engine",
            options={"kv_cache_memory_mb": 64, "num_threads": 2},
        )
    else:
        backend_config = BackendConfig(
            name="soak-backend", kind="mock", options={"token_delay_s": 0.002}
        )
    config = gateway_config(
        backend_config,
        models={"soak": ["soak-backend"]},
        limits=LimitsConfig(max_concurrent_requests=max(64, concurrency), max_queued_requests=4096),
    )
    return msgspec.structs.replace(
        config, cost=CostConfig(ledger_path=str(ledger), synchronous="normal")
    )


def _kv_free(gw: Any) -> dict[str, Any] | None:
    backend = gw.backend("soak-backend")
    engine = getattr(backend, "engine", None)
    if engine is None:
        return None
    return {"free_blocks": engine.num_free_blocks, "num_blocks": engine.num_blocks}


def run_soak(args: argparse.Namespace) -> int:
    from gateway.testing import run_gateway
    from plugins.manager import create_plugin_manager

    counter = AttemptCounter()
    pm = create_plugin_manager(load_entry_points=False)
    pm.register(counter, name="soak-attempt-counter")
    with tempfile.TemporaryDirectory(prefix="infermux-soak-") as tmp:
        ledger = Path(tmp) / "ledger.sqlite3"
        config = _config(args.backend, ledger, args.concurrency)
        print(f"soak: backend {args.backend}, starting the gateway ...", flush=True)
        with run_gateway(config, plugin_manager=pm) as gw:
            num_warmup = min(NUM_WARMUP, max(20, args.num_requests // 10))
            print(f"soak: warm-up ({num_warmup} requests) ...", flush=True)
            _run_client(gw, num_warmup, args.concurrency, args.disconnect_ratio, args.seed + 1)
            _wait_idle(gw)
            before = _process_figures(counter)
            print(f"soak: baseline {before}", flush=True)
            print(
                f"soak: {args.num_requests} requests at {args.concurrency} in flight, "
                f"{args.disconnect_ratio:.0%} abandoned ...",
                flush=True,
            )
            load = _run_client(
                gw, args.num_requests, args.concurrency, args.disconnect_ratio, args.seed
            )
            _wait_idle(gw)
            after = _process_figures(counter)
            admission = gw.state.admission.num_in_flight
            router = gw.state.router
            open_streams = sum(router.outstanding().values()) if router is not None else -1
            kv = _kv_free(gw)
        # The gateway has stopped: the ledger is flushed and closed.
        rows, distinct = _ledger_rows(ledger)
    reached = counter.num_reached
    rss_growth = (after["rss_kib"] - before["rss_kib"]) / before["rss_kib"]
    checks = {
        "open_fds_back_to_baseline": after["open_fds"] <= before["open_fds"],
        "asyncio_tasks_back_to_baseline": after["asyncio_tasks"] <= before["asyncio_tasks"],
        # Thread pools (asyncio's default executor) grow lazily up to their cap.
        "threads_bounded": after["threads"]
        <= before["threads"] + min(32, (os.cpu_count() or 1) + 4),
        "rss_growth_under_10_percent": rss_growth < RSS_GROWTH_LIMIT,
        "no_admitted_request_left": admission == 0,
        "no_backend_stream_left": open_streams == 0,
        "kv_blocks_all_free": kv is None or kv["free_blocks"] == kv["num_blocks"],
        "ledger_rows_equal_requests_that_reached_a_backend": rows == reached == distinct,
        "no_server_errors": all(int(s) < 500 for s in load["statuses"]),
    }
    result = {
        "benchmark": "soak",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "load_average": os.getloadavg(),
        },
        "settings": {
            "backend": args.backend,
            "num_requests": args.num_requests,
            "concurrency": args.concurrency,
            "disconnect_ratio": args.disconnect_ratio,
            "seed": args.seed,
        },
        "load": load,
        "server_before": before,
        "server_after": after,
        "rss_growth": rss_growth,
        "ledger": {"rows": rows, "distinct_request_ids": distinct, "reached_a_backend": reached},
        "kv": kv,
        "checks": checks,
        "passed": all(checks.values()),
    }
    _print_summary(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.output) if args.output else RESULTS / f"soak-{stamp}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"soak: wrote {out}")
    return 0 if result["passed"] else 1


def _print_summary(result: dict[str, Any]) -> None:
    load, before, after = result["load"], result["server_before"], result["server_after"]
    print()
    print(
        f"{load['num_requests']} requests in {load['elapsed_s']:.1f} s "
        f"({load['requests_per_s']:.0f}/s); statuses {load['statuses']}"
    )
    print(f"client outcomes: {load['outcomes']}")
    print(f"{'':24}{'baseline':>12}{'after':>12}")
    for key in ("open_fds", "asyncio_tasks", "threads", "rss_kib"):
        print(f"{key:24}{before[key]:>12}{after[key]:>12}")
    print(f"RSS growth: {result['rss_growth']:+.1%}")
    ledger = result["ledger"]
    print(
        f"ledger rows: {ledger['rows']} (distinct {ledger['distinct_request_ids']}); "
        f"requests that reached a backend: {ledger['reached_a_backend']}"
    )
    if result["kv"] is not None:
        print(f"KV blocks free: {result['kv']['free_blocks']} / {result['kv']['num_blocks']}")
    for name, ok in result["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    print("PASSED" if result["passed"] else "FAILED")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--disconnect-ratio", type=float, default=0.2)
    parser.add_argument("--backend", choices=["mock", "core_engine"], default="mock")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output", default=None, help="the JSON file (default: benchmarks/results/)"
    )
    parser.add_argument("--client", metavar="BASE_URL", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client is not None:
        report = asyncio.run(
            _client_main(
                args.client, args.num_requests, args.concurrency, args.disconnect_ratio, args.seed
            )
        )
        print(json.dumps(report))
        return 0
    return run_soak(args)


if __name__ == "__main__":
    sys.exit(main())

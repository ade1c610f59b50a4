"""Gateway overhead: the latency infermux adds in front of a fast upstream, next to LiteLLM.

A minimal OpenAI-shaped upstream (raw ASGI under uvicorn, answers from precomputed bytes)
is called three ways with the same requests:

* ``direct``   - the upstream itself,
* ``infermux`` - through infermux (a ``kind = "openai"`` backend pointing at the upstream),
* ``litellm``  - through LiteLLM's proxy (``litellm[proxy]`` in its own venv, ``.venv-litellm``;
  created on first use with ``python3 -m venv`` + ``pip install``).

Scenarios: sequential non-streaming, sequential streaming (``--chunks`` content chunks), and
non-streaming at ``--concurrency`` in flight. "Added" latency is a gateway's percentile minus
the direct percentile; the added time per streamed chunk is the added stream duration after
the first byte divided by the chunks after the first.

Sequential requests are interleaved so that noise hits a gateway and its baseline alike:
each gateway is measured in blocks of ``--block`` rounds, a round being one direct request
and one through the gateway (in alternating order), and the gateways' blocks alternate. The
direct requests of a gateway's blocks are its baseline (``direct`` for infermux,
``direct:litellm`` for LiteLLM). Blocks rather than one rotation over all three: a LiteLLM
request is ~12 ms of Python that evicts the other processes' working sets from the CPU
caches, so in a rotation every infermux request ran cold and its added p50 rose by a
quarter to a half (``--block 1`` gives that rotation back, pairwise). Target on the dev machine: added p50
<= 1 ms, p99 <= 5 ms. Every process runs on this machine, so the figures include the CPU
the gateways take from the client and the upstream (as a sidecar gateway would).

Each scenario also reports the CPU time each gateway process (and the upstream) used per
request it served (``/proc``, Linux): on a shared, noisy machine this moves far less than
wall-clock percentiles do.

    .venv/bin/python benchmarks/gateway_overhead.py                 # full run
    .venv/bin/python benchmarks/gateway_overhead.py --quick         # a short proof run
    .venv/bin/python benchmarks/gateway_overhead.py --no-litellm    # infermux only

Writes ``benchmarks/results/gateway_overhead-<UTC time>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fast_upstream import UPSTREAM_MODEL
from overhead_report import plot, print_table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = ROOT / "benchmarks" / "results"
LITELLM_VENV = ROOT / ".venv-litellm"
ALIAS = "bench"
TARGETS = ("direct", "infermux", "litellm")
DIRECT = "direct"
#: Sequential rounds run before the measured ones (connections, caches).
_WARMUP = 20
#: LiteLLM's proxy refuses to start without a master key; every target gets the same header.
MASTER_KEY = "sk-bench-" + os.urandom(16).hex()

#: target -> {"total": latencies, and for streams "first": times to first byte}, seconds.
Samples = dict[str, dict[str, list[float]]]


def _run_infermux(config_path: Path, port: int) -> None:
    """What ``infermux serve --config`` does, kept here so the run does not depend on it."""
    import uvicorn

    from gateway.app import create_app
    from gateway.config.load import load_config

    app = create_app(load_config(config_path))
    # What `infermux serve` picks when uvicorn[standard] is installed, made explicit here.
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


# -- processes ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} during start-up")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready at {url} after {timeout_s} s")


@contextlib.contextmanager
def _process(
    args: list[str], env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(args, cwd=ROOT, env={**os.environ, **(env or {})})
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (all its threads) so far; None off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _CpuMeter:
    """CPU time per request of the gateway processes and the upstream, per scenario."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    def measure(
        self, scenario: Callable[[], tuple[Samples, int]]
    ) -> tuple[Samples, dict[str, float]]:
        """Run ``scenario``; its samples and each process's CPU µs per request it served
        (a gateway serves its target's requests, the upstream every target's)."""
        before = {name: _cpu_seconds(pid) for name, pid in self.pids.items()}
        samples, per_target = scenario()
        cpu: dict[str, float] = {}
        for name, pid in self.pids.items():
            start, end = before[name], _cpu_seconds(pid)
            if start is not None and end is not None:
                served = per_target * (len(samples) if name == "upstream" else 1)
                cpu[name] = 1e6 * (end - start) / served
        return samples, cpu


def _ensure_litellm() -> Path:
    """The LiteLLM proxy executable, installing ``litellm[proxy]`` into .venv-litellm if needed."""
    executable = LITELLM_VENV / "bin" / "litellm"
    if executable.exists():
        return executable
    print(f"installing litellm[proxy] into {LITELLM_VENV} (one time, a few minutes)...", flush=True)
    subprocess.run(["python3", "-m", "venv", str(LITELLM_VENV)], check=True)
    pip = LITELLM_VENV / "bin" / "pip"
    subprocess.run([str(pip), "install", "-q", "litellm[proxy]"], check=True)
    return executable


def _litellm_version() -> str | None:
    python = LITELLM_VENV / "bin" / "python"
    with contextlib.suppress(Exception):
        out = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    return None


# -- measuring ----------------------------------------------------------------------------


def _body(target: str, stream: bool, chunks: int) -> bytes:
    model = UPSTREAM_MODEL if target == "direct" else ALIAS
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": chunks,
            "stream": stream,
        }
    ).encode()


def baseline_of(target: str) -> str:
    """The samples a gateway's added latency is measured against (see the module doc)."""
    return DIRECT if target in (DIRECT, "infermux") else f"{DIRECT}:{target}"


def _sequential(
    urls: dict[str, str], *, requests: int, block: int, stream: bool, chunks: int, label: str
) -> tuple[Samples, int]:
    """Latency (and for streams, first byte) of each gateway and of its direct baseline, in
    alternating blocks of rounds (see the module doc). Also the number of requests each
    target served per gateway, warm-up included."""
    import httpx
    from tqdm import tqdm

    headers = {"content-type": "application/json", "authorization": f"Bearer {MASTER_KEY}"}
    clients = {t: httpx.Client(base_url=u, headers=headers, timeout=30.0) for t, u in urls.items()}
    gateways = [t for t in urls if t != DIRECT]
    samples: Samples = {}
    for gateway in gateways:
        samples[baseline_of(gateway)] = {"total": [], "first": []}
        samples[gateway] = {"total": [], "first": []}
    bodies = {t: _body(t, stream, chunks) for t in urls}
    # (gateway, round of that gateway): the warm-up rounds first, then blocks in turn.
    plan = [(g, i) for g in gateways for i in range(_WARMUP)]
    for start in range(_WARMUP, _WARMUP + requests, block):
        plan += [
            (g, i) for g in gateways for i in range(start, min(start + block, _WARMUP + requests))
        ]
    try:
        for gateway, i in tqdm(plan, desc=label, unit="round", leave=False):
            pair = (DIRECT, gateway) if i % 2 == 0 else (gateway, DIRECT)
            for target in pair:
                client = clients[target]
                started = time.perf_counter()
                first = None
                with client.stream(
                    "POST", "/v1/chat/completions", content=bodies[target]
                ) as response:
                    for _ in response.iter_raw():
                        if first is None:
                            first = time.perf_counter() - started
                    if response.status_code != 200:
                        raise RuntimeError(f"{target}: HTTP {response.status_code}")
                total = time.perf_counter() - started
                if i >= _WARMUP:  # the first rounds warm connections and caches
                    series = samples[gateway if target == gateway else baseline_of(gateway)]
                    series["total"].append(total)
                    series["first"].append(first if first is not None else total)
    finally:
        for client in clients.values():
            client.close()
    return samples, _WARMUP + requests


async def _concurrent_round(url: str, body: bytes, requests: int, concurrency: int) -> list[float]:
    import httpx

    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"content-type": "application/json", "authorization": f"Bearer {MASTER_KEY}"}
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=60.0
    ) as client:
        queue = list(range(requests))

        async def worker() -> None:
            while queue:
                queue.pop()
                started = time.perf_counter()
                response = await client.post("/v1/chat/completions", content=body)
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def _concurrent(
    urls: dict[str, str], *, requests: int, concurrency: int, rounds: int, chunks: int
) -> tuple[Samples, int]:
    """Latencies per target, a round at a time; also the requests each target served."""
    from tqdm import tqdm

    samples: Samples = {t: {"total": []} for t in urls}
    names = list(urls)
    per_round = max(concurrency, requests // rounds)
    for r in tqdm(range(rounds + 1), desc=f"concurrent x{concurrency}", unit="round", leave=False):
        for target in names[r % len(names) :] + names[: r % len(names)]:
            latencies = asyncio.run(
                _concurrent_round(
                    urls[target], _body(target, False, chunks), per_round, concurrency
                )
            )
            if r > 0:  # round 0 warms up
                samples[target]["total"].extend(latencies)
    return samples, (rounds + 1) * per_round


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _summary(samples: Samples, chunks: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"latency_ms": {}, "added_ms": {}}
    for target, series in samples.items():
        total = series["total"]
        out["latency_ms"][target] = {
            "p50": 1000 * _percentile(total, 50),
            "p99": 1000 * _percentile(total, 99),
            "mean": 1000 * statistics.fmean(total),
            "n": len(total),
        }
    for target in samples:
        if target.startswith(DIRECT):
            continue
        base = baseline_of(target) if baseline_of(target) in samples else DIRECT
        direct = out["latency_ms"][base]
        mine = out["latency_ms"][target]
        added = {"p50": mine["p50"] - direct["p50"], "p99": mine["p99"] - direct["p99"]}
        if chunks and samples[target].get("first"):
            # Added time per chunk after the first byte: stream duration minus time to first byte.
            def body_time(t: str) -> float:
                return statistics.median(
                    a - b for a, b in zip(samples[t]["total"], samples[t]["first"], strict=True)
                )

            added["per_chunk"] = (body_time(target) - body_time(base)) / max(1, chunks - 1)
            added["first_byte_p50"] = 1000 * (
                statistics.median(samples[target]["first"])
                - statistics.median(samples[base]["first"])
            )
            added["per_chunk"] *= 1000
        out["added_ms"][target] = added
    return out


def _ratios(results: dict[str, Any]) -> dict[str, float | None]:
    ratios: dict[str, float | None] = {}
    for scenario, summary in results.items():
        added = summary["added_ms"]
        if "litellm" not in added:
            continue
        for key in ("p50", "p99", "per_chunk"):
            if key in added["infermux"] and key in added["litellm"]:
                theirs = added["litellm"][key]
                ratios[f"{scenario}.{key}"] = (
                    added["infermux"][key] / theirs if theirs > 0 else None
                )
    return ratios


def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500, help="sequential requests per target")
    parser.add_argument("--concurrent-requests", type=int, default=1024, help="per target")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=16, help="content chunks per answer")
    parser.add_argument(
        "--block",
        type=int,
        default=50,
        help="sequential rounds of one gateway before the other's (1: rotate every round)",
    )
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM proxy")
    parser.add_argument("--quick", action="store_true", help="a short run that proves it works")
    parser.add_argument("--role", choices=("infermux",), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.role == "infermux":
        _run_infermux(args.config, args.port)
        return 0
    if args.quick:
        args.requests, args.concurrent_requests = (
            min(args.requests, 100),
            min(args.concurrent_requests, 256),
        )

    script = str(Path(__file__).resolve())
    upstream_port, infermux_port, litellm_port = _free_port(), _free_port(), _free_port()
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        config = Path(tmp) / "infermux.toml"
        config.write_text(
            '[[backends]]\nname = "upstream"\nkind = "openai"\n'
            f'[backends.options]\nbase_url = "{upstream_url}/v1"\nmodel = "{UPSTREAM_MODEL}"\n\n'
            f'[[models]]\nalias = "{ALIAS}"\nbackends = ["upstream"]\n'
        )
        print(f"upstream on :{upstream_port}, infermux on :{infermux_port}", flush=True)
        upstream = stack.enter_context(
            _process(
                [
                    sys.executable,
                    str(HERE / "fast_upstream.py"),
                    "--port",
                    str(upstream_port),
                    "--chunks",
                    str(args.chunks),
                ]
            )
        )
        _wait_http(f"{upstream_url}/v1/models", upstream, 60, "upstream")
        infermux = stack.enter_context(
            _process(
                [
                    sys.executable,
                    script,
                    "--role",
                    "infermux",
                    "--port",
                    str(infermux_port),
                    "--config",
                    str(config),
                ],
                # Its own ledger: the benchmark's requests stay out of the user's.
                env={"PYTHONPATH": str(ROOT), "INFERMUX_LEDGER_PATH": str(Path(tmp) / "ledger")},
            )
        )
        _wait_http(f"http://127.0.0.1:{infermux_port}/ready", infermux, 120, "infermux")
        urls = {"direct": upstream_url, "infermux": f"http://127.0.0.1:{infermux_port}"}
        pids = {"upstream": upstream.pid, "infermux": infermux.pid}
        if not args.no_litellm:
            litellm = _ensure_litellm()
            litellm_config = Path(tmp) / "litellm.yaml"
            litellm_config.write_text(
                "model_list:\n"
                f"  - model_name: {ALIAS}\n"
                "    litellm_params:\n"
                f"      model: openai/{UPSTREAM_MODEL}\n"
                f"      api_base: {upstream_url}/v1\n"
                "      api_key: sk-none\n"
                "litellm_settings:\n  drop_params: true\n  telemetry: false\n"
            )
            print(f"LiteLLM proxy on :{litellm_port} (start-up takes a while)...", flush=True)
            proxy = stack.enter_context(
                _process(
                    [
                        str(litellm),
                        "--config",
                        str(litellm_config),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(litellm_port),
                    ],
                    env={
                        "LITELLM_MASTER_KEY": MASTER_KEY,
                        "LITELLM_LOG": "ERROR",
                        "LITELLM_TELEMETRY": "False",
                        "DISABLE_SCHEMA_UPDATE": "true",
                    },
                )
            )
            _wait_http(
                f"http://127.0.0.1:{litellm_port}/health/liveliness", proxy, 300, "LiteLLM proxy"
            )
            urls["litellm"] = f"http://127.0.0.1:{litellm_port}"
            pids["litellm"] = proxy.pid

        meter = _CpuMeter(pids)
        results: dict[str, Any] = {}

        def sequential(stream: bool, label: str) -> Callable[[], tuple[Samples, int]]:
            return lambda: _sequential(
                urls,
                requests=args.requests,
                block=args.block,
                stream=stream,
                chunks=args.chunks,
                label=label,
            )

        for scenario, run, chunks in (
            ("sequential", sequential(False, "sequential"), None),
            ("sequential_stream", sequential(True, "streaming"), args.chunks),
            (
                f"concurrent_{args.concurrency}",
                lambda: _concurrent(
                    urls,
                    requests=args.concurrent_requests,
                    concurrency=args.concurrency,
                    rounds=4,
                    chunks=args.chunks,
                ),
                None,
            ),
        ):
            samples, cpu = meter.measure(run)
            results[scenario] = _summary(samples, chunks=chunks) | {"cpu_us_per_request": cpu}

    ratios = _ratios(results)
    print_table(results, ratios)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "gateway_overhead",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": _machine(),
        "settings": {
            "requests": args.requests,
            "concurrent_requests": args.concurrent_requests,
            "concurrency": args.concurrency,
            "chunks": args.chunks,
            "block": args.block,
            "litellm_version": None if args.no_litellm else _litellm_version(),
        },
        "results": results,
        "ratios_infermux_to_litellm": ratios,
    }
    json_path = RESULTS / f"gateway_overhead-{stamp}.json"
    json_path.write_text(json.dumps(record, indent=2))
    png_path = json_path.with_suffix(".png")
    plot(results, png_path)
    print(f"\nwrote {json_path.relative_to(ROOT)} and {png_path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the engine process buys: gateway latency for a remote alias while the core engine is busy.

One gateway serves two aliases: ``remote`` (a ``kind = "openai"`` backend in front of the
fast precomputed upstream of ``fast_upstream.py``) and ``core`` (the core engine on the
embedded model). The gateway is run twice, identical but for ``engine_process``:

* ``in_process``     - ``engine_process = false``: the engine loop is a thread of the gateway
  process, so its Python work shares the gateway's GIL;
* ``engine_process`` - the default: the engine runs in its own supervised process.

For each, sequential non-streamed ``remote`` requests are timed, each paired with one sent
straight to the upstream (the baseline), first with the engine idle and then while a load
process keeps ``--streams`` streaming requests on ``core`` in flight (the engine saturated).
"Added" latency is the gateway's percentile minus the direct one. The figure to read is the
added p50/p99 under load, ``in_process`` / ``engine_process``.

    .venv/bin/python benchmarks/engine_isolation.py            # 300 requests per phase
    .venv/bin/python benchmarks/engine_isolation.py --quick    # a short proof run

Writes ``benchmarks/results/engine_isolation-<UTC time>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fast_upstream import UPSTREAM_MODEL
from gateway_overhead import _free_port, _machine, _percentile, _process, _wait_http

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = ROOT / "benchmarks" / "results"
MODES = ("in_process", "engine_process")
BODY = {"model": "remote", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _config(upstream_url: str, engine_process: bool, threads: int) -> str:
    return (
        '[[backends]]\nname = "upstream"\nkind = "openai"\n'
        f'[backends.options]\nbase_url = "{upstream_url}/v1"\nmodel = "{UPSTREAM_MODEL}"\n\n'
        '[[backends]]\nname = "core"\nkind = "core_engine"\n'
        f"[backends.options]\nengine_process = {str(engine_process).lower()}\n"
        f"num_threads = {threads}\nkv_cache_memory_mb = 256\n\n"
        '[[models]]\nalias = "remote"\nbackends = ["upstream"]\n\n'
        '[[models]]\nalias = "core"\nbackends = ["core"]\n'
    )


async def _load(url: str, streams: int, stop_file: Path) -> None:
    """Keep ``streams`` streamed ``core`` requests in flight until ``stop_file`` exists."""
    import httpx

    body = {
        "model": "core", "max_tokens": 64, "ignore_eos": True, "stream": True,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
    }  # fmt: skip

    async def one(client: httpx.AsyncClient) -> None:
        while not stop_file.exists():
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    pass

    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(one(client) for _ in range(streams)))


def _timed(requests: int, gateway: str, direct: str) -> dict[str, list[float]]:
    """Paired sequential requests: one through the gateway, one to the upstream, alternating."""
    import httpx

    samples: dict[str, list[float]] = {"gateway": [], "direct": []}
    with httpx.Client(timeout=60) as client:
        for i in range(requests + 10):
            order = (("gateway", gateway), ("direct", direct))
            for name, base in order if i % 2 else order[::-1]:
                began = time.perf_counter()
                response = client.post(f"{base}/v1/chat/completions", json=BODY | {"model": _model(name)})
                elapsed = time.perf_counter() - began
                response.raise_for_status()
                if i >= 10:  # warm-up rounds are not counted
                    samples[name].append(elapsed)
    return samples


def _model(target: str) -> str:
    return "remote" if target == "gateway" else UPSTREAM_MODEL


def _summary(samples: dict[str, list[float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for q in (50, 99):
        gateway, direct = _percentile(samples["gateway"], q), _percentile(samples["direct"], q)
        out[f"p{q}_ms"] = 1000 * gateway
        out[f"direct_p{q}_ms"] = 1000 * direct
        out[f"added_p{q}_ms"] = 1000 * (gateway - direct)
    out["n"] = len(samples["gateway"])
    return out


def _measure_mode(args: argparse.Namespace, mode: str, upstream_url: str, tmp: Path) -> dict[str, Any]:
    port = _free_port()
    config = tmp / f"{mode}.toml"
    config.write_text(_config(upstream_url, mode == "engine_process", args.threads))
    gateway_script = str(HERE / "gateway_overhead.py")
    env = {"PYTHONPATH": str(ROOT), "INFERMUX_LEDGER_PATH": str(tmp / f"ledger-{mode}")}
    with _process(
        [sys.executable, gateway_script, "--role", "infermux", "--port", str(port), "--config", str(config)],
        env=env,
    ) as gateway:
        url = f"http://127.0.0.1:{port}"
        print(f"[{mode}] gateway on :{port}, loading the model...", flush=True)
        _wait_http(f"{url}/ready", gateway, 300, f"infermux ({mode})")
        print(f"[{mode}] engine idle: {args.requests} paired requests", flush=True)
        idle = _summary(_timed(args.requests, url, upstream_url))
        stop = tmp / f"stop-{mode}"
        load = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--role", "load", "--url", url,
             "--streams", str(args.streams), "--stop-file", str(stop)],
            cwd=ROOT,
        )  # fmt: skip
        try:
            time.sleep(args.settle_s)  # the engine's batch fills up
            print(f"[{mode}] engine saturated ({args.streams} streams): {args.requests} paired requests", flush=True)
            busy = _summary(_timed(args.requests, url, upstream_url))
        finally:
            stop.touch()
            try:
                load.wait(timeout=120)
            except subprocess.TimeoutExpired:
                load.kill()
    return {"idle": idle, "saturated": busy}


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharey=True)
    for ax, q in zip(axes, ("p50", "p99"), strict=True):
        phases = ("idle", "saturated")
        width = 0.38
        for k, mode in enumerate(MODES):
            values = [results[mode][phase][f"added_{q}_ms"] for phase in phases]
            ax.bar([i + (k - 0.5) * width for i in range(2)], values, width, label=mode)
        ax.set_xticks(range(2), ["engine idle", "engine saturated"])
        ax.set_title(f"added {q} latency, remote alias")
        ax.set_ylabel("ms over direct")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="paired requests per phase")
    parser.add_argument("--streams", type=int, default=8, help="streams kept on the core engine")
    parser.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true", help="a short run that proves it works")
    parser.add_argument("--role", choices=("load",), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--stop-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "load":
        asyncio.run(_load(args.url, args.streams, args.stop_file))
        return 0
    if args.quick:
        args.requests = min(args.requests, 60)

    upstream_port = _free_port()
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        upstream = stack.enter_context(
            _process([sys.executable, str(HERE / "fast_upstream.py"), "--port", str(upstream_port), "--chunks", "8"])
        )
        _wait_http(f"{upstream_url}/v1/models", upstream, 60, "upstream")
        for mode in MODES:
            results[mode] = _measure_mode(args, mode, upstream_url, Path(tmp))

    ratios = {
        f"saturated.added_{q}": results["in_process"]["saturated"][f"added_{q}_ms"]
        / max(1e-6, results["engine_process"]["saturated"][f"added_{q}_ms"])
        for q in ("p50", "p99")
    }
    print(f"\n{'mode':<16}{'phase':<11}{'p50 ms':>9}{'p99 ms':>9}{'added p50':>11}{'added p99':>11}")
    for mode in MODES:
        for phase in ("idle", "saturated"):
            r = results[mode][phase]
            print(f"{mode:<16}{phase:<11}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}"
                  f"{r['added_p50_ms']:>11.2f}{r['added_p99_ms']:>11.2f}")  # fmt: skip
    for key, value in ratios.items():
        print(f"{key}: in_process / engine_process = {value:.1f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"engine_isolation-{stamp}.json"
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date": stamp, "machine": _machine(), "settings": vars(args) | {"stop_file": None},
        "results": results, "ratios": ratios,
    }  # fmt: skip
    out.write_text(json.dumps(record, indent=2, default=str))
    _plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

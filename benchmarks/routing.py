"""Prefix-cache-aware routing against round robin and least outstanding, through the gateway.

Four core-engine replicas of the default model (each in its worker process) serve three
aliases, one per strategy: ``cache_aware``, ``round_robin``, ``least_outstanding``. The
workload is multi-tenant and multi-turn: each tenant has a long system prompt shared by its
sessions; each session sends its turns one after another, every turn carrying the whole
conversation so far (the previous answers included). Sessions run concurrently. The
strategies run one after the other over the same replicas; each phase uses its own tenants
(a salt in every system prompt), so no phase profits from another's cache.

Figures per strategy: prefix hit rate (cached prompt tokens / prompt tokens, as the engines
count them in usage), TTFT p50/p99 (first content chunk over SSE), throughput (requests/s
and completion tokens/s over the phase). Ratios are cache_aware over round_robin.

    PYTHONPATH=. python benchmarks/routing.py [--quick]

Writes ``benchmarks/results/routing-<UTC time>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway_overhead import _free_port, _machine, _percentile, _process, _wait_http

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = ROOT / "benchmarks" / "results"
STRATEGIES = ("cache_aware", "round_robin", "least_outstanding")
REPLICAS = ("r0", "r1", "r2", "r3")
_TOPICS = "billing shipping returns warranty accounts security travel insurance payroll support".split()


def _config(args: argparse.Namespace) -> str:
    out = []
    for name in REPLICAS:
        out.append(
            f'[[backends]]\nname = "{name}"\nkind = "core_engine"\n[backends.options]\n'
            f"num_threads = {args.threads}\nkv_cache_memory_mb = {args.kv_cache_mb}\n"
            "max_num_seqs = 8\nmax_num_batched_tokens = 512\nmax_model_len = 2048\n"
        )
    for strategy in STRATEGIES:
        out.append(f'[[models]]\nalias = "{strategy}"\nbackends = {json.dumps(list(REPLICAS))}\nstrategy = "{strategy}"\n')
    if args.tenant_keys:  # each workload tenant its own API key and gateway tenant
        from gateway.http.auth import hash_key

        for tenant in range(args.tenants):
            out.append(f'[[auth.keys]]\nid = "k{tenant}"\ntenant = "t{tenant}"\nkey_sha256 = "{hash_key(_key(tenant))}"\n')
    return "\n".join(out)


def _key(tenant: int) -> str:
    return f"sk-routing-bench-tenant-{tenant}"


def _system_prompt(salt: str, tenant: int, sentences: int) -> str:
    topic = _TOPICS[tenant % len(_TOPICS)]
    rules = " ".join(f"Rule {i}: for {topic} questions, answer briefly, cite policy {i}, stay polite." for i in range(sentences))
    return f"[{salt}] You are the assistant of tenant {tenant}, the {topic} desk. {rules}"


async def _turn(
    client: Any, url: str, alias: str, messages: list[dict[str, str]], max_tokens: int, key: str | None = None
) -> dict[str, Any]:
    body = {
        "model": alias, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    ttft = None
    text = []
    usage: dict[str, Any] = {}
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frame = json.loads(line[6:])
            for choice in frame.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    text.append(piece)
            if frame.get("usage"):
                usage = frame["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft if ttft is not None else time.perf_counter() - started,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": details.get("cached_tokens", 0) or 0,
        "completion_tokens": usage.get("completion_tokens", 0),
        "text": "".join(text),
        "backend": response.headers.get("x-infermux-backend"),
    }


async def _phase(url: str, strategy: str, args: argparse.Namespace, salt: str) -> dict[str, Any]:
    import httpx

    sessions = [(t, s) for s in range(args.sessions) for t in range(args.tenants)]
    queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    for item in sessions:
        queue.put_nowait(item)
    results: list[dict[str, Any]] = []

    async def session_worker(client: Any) -> None:
        while not queue.empty():
            tenant, session = queue.get_nowait()
            messages = [{"role": "system", "content": _system_prompt(salt, tenant, args.system_sentences)}]
            for turn in range(args.turns):
                messages.append({"role": "user", "content": f"Session {session}, question {turn}: what should I do next?"})
                key = _key(tenant) if args.tenant_keys else None
                result = await _turn(client, url, strategy, messages, args.max_tokens, key)
                results.append(result)
                messages.append({"role": "assistant", "content": result["text"]})

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(session_worker(client) for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
    ttfts = [r["ttft_s"] for r in results]
    prompt = sum(r["prompt_tokens"] for r in results)
    spread: dict[str, int] = {}
    for r in results:
        spread[r["backend"]] = spread.get(r["backend"], 0) + 1
    return {
        "requests": len(results),
        "elapsed_s": elapsed,
        "prefix_hit_rate": sum(r["cached_tokens"] for r in results) / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "ttft_ms": {"p50": 1000 * _percentile(ttfts, 50), "p99": 1000 * _percentile(ttfts, 99),
                    "mean": 1000 * statistics.fmean(ttfts)},
        "requests_per_s": len(results) / elapsed,
        "completion_tokens_per_s": sum(r["completion_tokens"] for r in results) / elapsed,
        "requests_per_replica": spread,
    }


def _ratios(results: dict[str, Any]) -> dict[str, float | None]:
    ca, rr = results["cache_aware"], results["round_robin"]

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    return {
        "hit_rate": ratio(ca["prefix_hit_rate"], rr["prefix_hit_rate"]),
        "ttft_p50": ratio(ca["ttft_ms"]["p50"], rr["ttft_ms"]["p50"]),
        "ttft_p99": ratio(ca["ttft_ms"]["p99"], rr["ttft_ms"]["p99"]),
        "throughput": ratio(ca["requests_per_s"], rr["requests_per_s"]),
    }


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    axes[0].bar(names, [100 * results[n]["prefix_hit_rate"] for n in names], color="tab:green")
    axes[0].set_title("prefix hit rate (%)")
    x = range(len(names))
    axes[1].bar([i - 0.2 for i in x], [results[n]["ttft_ms"]["p50"] for n in names], width=0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [results[n]["ttft_ms"]["p99"] for n in names], width=0.4, label="p99")
    axes[1].set_xticks(list(x), names)
    axes[1].set_title("TTFT (ms)")
    axes[1].legend()
    axes[2].bar(names, [results[n]["requests_per_s"] for n in names], color="tab:orange")
    axes[2].set_title("throughput (requests/s)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("4 core-engine replicas, multi-tenant multi-turn chat, through the gateway")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _run_infermux(config_path: Path, port: int) -> None:
    import uvicorn

    from gateway.app import create_app
    from gateway.config.load import load_config

    uvicorn.run(create_app(load_config(config_path)), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=3, help="per tenant")
    parser.add_argument("--turns", type=int, default=4, help="per session")
    parser.add_argument("--concurrency", type=int, default=8, help="sessions at once")
    parser.add_argument("--system-sentences", type=int, default=24, help="length of each system prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="per replica")
    parser.add_argument("--kv-cache-mb", type=int, default=96, help="per replica")
    parser.add_argument("--quick", action="store_true", help="a short run that proves it works")
    parser.add_argument("--tenant-keys", action="store_true",
                        help="one API key per workload tenant (each its own gateway tenant: prefix caches salted per tenant)")
    parser.add_argument("--role", choices=("infermux",), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "infermux":
        _run_infermux(args.config, args.port)
        return 0
    if args.quick:
        args.tenants, args.sessions, args.turns = min(args.tenants, 6), min(args.sessions, 2), min(args.turns, 3)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "infermux.toml"
        config.write_text(_config(args))
        script = str(Path(__file__).resolve())
        with _process([sys.executable, script, "--role", "infermux", "--port", str(port), "--config", str(config)]) as gw:
            _wait_http(f"{url}/ready", gw, 900, "gateway")
            for strategy in STRATEGIES:
                print(f"-- {strategy}", flush=True)
                results[strategy] = asyncio.run(_phase(url, strategy, args, salt=f"{strategy}-{time.time_ns()}"))
                r = results[strategy]
                print(
                    f"   hit rate {100 * r['prefix_hit_rate']:.1f}%  TTFT p50 {r['ttft_ms']['p50']:.0f} ms "
                    f"p99 {r['ttft_ms']['p99']:.0f} ms  {r['requests_per_s']:.2f} req/s  "
                    f"spread {r['requests_per_replica']}",
                    flush=True,
                )
    ratios = _ratios(results)
    print("cache_aware / round_robin: " + ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} n/a" for k, v in ratios.items()))
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"routing-{stamp}.json"
    out.write_text(json.dumps({
        "benchmark": "routing", "date": stamp, "machine": _machine(), "args": vars(args) | {"config": None},
        "results": results, "ratios_vs_round_robin": ratios,
        "targets": {"hit_rate": ">= 2.0", "ttft_p50": "<= 0.7", "throughput": ">= 0.95"},
    }, indent=2, default=str))  # fmt: skip
    _plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

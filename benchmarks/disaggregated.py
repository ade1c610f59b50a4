"""Disaggregated prefill / decode: decode smoothness while long prompts arrive.

One workload, run against two gateways in turn, identical but for how the alias ``bench`` is
served:

* ``colocated``      - one core engine prefills and decodes (``--colocated-threads`` torch
  threads; default 2, the cores the two engines below use together);
* ``disaggregated``  - a ``disaggregated`` backend over a prefill core engine and a decode
  core engine (``role = "prefill"`` / ``"decode"``, one thread each, each in its own worker
  process), KV moved over ``--transport`` (shared memory by default).

The workload: ``--streams`` streaming requests decode without end (each restarted when it
finishes), and every ``--arrival-s`` seconds a request with a long prompt (``--prompt-words``
words; 600 words are 607 tokens) arrives. The figure is the inter-token latency (ITL, the
gap between two SSE chunks of one stream) of the decoding streams over ``--window-s`` s: in the
colocated engine a long prompt's prefill chunk shares a step with the decodes, which then
wait for it; disaggregated, only its KV import and its own decode reach the decode engine.
The ratio printed is ITL p99 colocated / disaggregated. On a 2-core machine the two engines
and the gateway share the cores, so the figure is indicative only.

    .venv/bin/python benchmarks/disaggregated.py            # 40 s window per mode
    .venv/bin/python benchmarks/disaggregated.py --quick    # a short proof run

Writes ``benchmarks/results/disaggregated-<UTC time>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway_overhead import _free_port, _machine, _percentile, _process, _wait_http

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = ROOT / "benchmarks" / "results"
MODES = ("colocated", "disaggregated")
_WORDS = "amber river quietly folds seven paper lanterns under the northern bridge at dusk".split()


def _engine_options(threads: int, extra: str = "") -> str:
    return (
        f"[backends.options]\nnum_threads = {threads}\nkv_cache_memory_mb = 192\n"
        f"max_num_seqs = 32\nmax_num_batched_tokens = 512\n{extra}"
    )


def _config(mode: str, args: argparse.Namespace) -> str:
    if mode == "colocated":
        return (
            '[[backends]]\nname = "co"\nkind = "core_engine"\n'
            + _engine_options(args.colocated_threads)
            + '\n[[models]]\nalias = "bench"\nbackends = ["co"]\n'
        )
    address = f', address = "tcp://127.0.0.1:{_free_port()}"' if args.transport == "tcp" else ""
    transfer = f'kv_transfer = {{ transport = "{args.transport}"{address} }}\n'
    return (
        '[[backends]]\nname = "pf"\nkind = "core_engine"\n'
        + _engine_options(1, f'role = "prefill"\n{transfer}')
        + '\n[[backends]]\nname = "dc"\nkind = "core_engine"\n'
        + _engine_options(1, f'role = "decode"\n{transfer}')
        + '\n[[backends]]\nname = "pd"\nkind = "disaggregated"\n'
        + '[backends.options]\nprefill = "pf"\ndecode = "dc"\n'
        + '\n[[models]]\nalias = "bench"\nbackends = ["pd"]\n'
    )


def _long_prompt(i: int, words: int) -> str:
    # Distinct from the first word on, so that no prefix cache serves it.
    return f"Request {i}. " + " ".join(_WORDS[(i + j) % len(_WORDS)] for j in range(words)) + " Summarise."


async def _workload(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    stream_body = {
        "model": "bench", "max_tokens": args.stream_tokens, "ignore_eos": True, "stream": True,
        "temperature": 0, "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
    }  # fmt: skip
    itl: list[float] = []
    itl_times: list[float] = []
    long_latency: list[float] = []
    stream_tokens = 0
    window: dict[str, float] = {}
    stop = asyncio.Event()

    async def stream(client: httpx.AsyncClient) -> None:
        nonlocal stream_tokens
        while not stop.is_set():
            last = None
            async with client.stream("POST", f"{url}/v1/chat/completions", json=stream_body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if '"content":"' not in line.replace(" ", ""):
                        continue
                    now = time.perf_counter()
                    if last is not None and window and window["start"] <= now <= window.get("end", float("inf")):
                        itl.append(now - last)
                        itl_times.append(now - window["start"])
                        stream_tokens += 1
                    last = now
                    if stop.is_set():
                        break

    async def arrivals(client: httpx.AsyncClient) -> None:
        i = 0
        while not stop.is_set():
            body = {"model": "bench", "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "user", "content": _long_prompt(i, args.prompt_words)}]}
            began = time.perf_counter()
            task = asyncio.create_task(client.post(f"{url}/v1/chat/completions", json=body))

            def done(t: asyncio.Task[Any], began: float = began) -> None:
                if not t.cancelled() and t.exception() is None:
                    long_latency.append(time.perf_counter() - began)

            task.add_done_callback(done)
            i += 1
            try:
                await asyncio.wait_for(stop.wait(), timeout=args.arrival_s)
            except TimeoutError:
                pass

    async with httpx.AsyncClient(timeout=600) as client:
        streams = [asyncio.create_task(stream(client)) for _ in range(args.streams)]
        await asyncio.sleep(args.settle_s)  # every stream decoding
        window["start"] = time.perf_counter()
        feeder = asyncio.create_task(arrivals(client))
        await asyncio.sleep(args.window_s)
        window["end"] = time.perf_counter()
        stop.set()
        await feeder
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    summary: dict[str, Any] = {"n_itl": len(itl), "stream_tokens_per_s": stream_tokens / args.window_s,
                               "long_requests_done": len(long_latency)}
    for q in (50, 90, 99):
        summary[f"itl_p{q}_ms"] = 1000 * _percentile(itl, q) if itl else None
    summary["itl_max_ms"] = 1000 * max(itl) if itl else None
    summary["long_latency_p50_s"] = _percentile(long_latency, 50) if long_latency else None
    return {"summary": summary, "itl_ms": [round(1000 * v, 2) for v in itl],
            "itl_at_s": [round(t, 3) for t in itl_times]}


def _measure_mode(mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    port = _free_port()
    config = tmp / f"{mode}.toml"
    config.write_text(_config(mode, args))
    env = {"PYTHONPATH": str(ROOT), "INFERMUX_LEDGER_PATH": str(tmp / f"ledger-{mode}")}
    script = str(HERE / "gateway_overhead.py")
    with _process([sys.executable, script, "--role", "infermux", "--port", str(port), "--config", str(config)],
                  env=env) as gateway:
        url = f"http://127.0.0.1:{port}"
        print(f"[{mode}] gateway on :{port}, loading...", flush=True)
        _wait_http(f"{url}/ready", gateway, 600, f"infermux ({mode})")
        print(f"[{mode}] {args.streams} streams, a {args.prompt_words}-word prompt every {args.arrival_s} s, "
              f"{args.window_s} s window", flush=True)
        return asyncio.run(_workload(url, args))


def _plot(results: dict[str, Any], ratio: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, trace) = plt.subplots(1, 2, figsize=(11, 4))
    qs = ("p50", "p90", "p99")
    width = 0.38
    for k, mode in enumerate(MODES):
        values = [results[mode]["summary"][f"itl_{q}_ms"] or 0.0 for q in qs]
        bars.bar([i + (k - 0.5) * width for i in range(len(qs))], values, width, label=mode)
        trace.scatter(results[mode]["itl_at_s"], results[mode]["itl_ms"], s=3, label=mode, alpha=0.5)
    bars.set_xticks(range(len(qs)), [f"ITL {q}" for q in qs])
    bars.set_ylabel("ms")
    title = "decoding streams' ITL while long prompts arrive"
    bars.set_title(title + (f"\np99 colocated / disaggregated = {ratio:.2f}x" if ratio else ""))
    bars.legend()
    trace.set_xlabel("s into the window")
    trace.set_ylabel("ITL ms")
    trace.set_yscale("log")
    trace.set_title("every gap between two tokens of a stream")
    trace.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8, help="decoding streams kept open")
    parser.add_argument("--stream-tokens", type=int, default=256, help="max_tokens of each stream")
    parser.add_argument("--prompt-words", type=int, default=600, help="words of each long prompt")
    parser.add_argument("--arrival-s", type=float, default=3.0, help="seconds between long prompts")
    parser.add_argument("--window-s", type=float, default=40.0, help="measured seconds per mode")
    parser.add_argument("--settle-s", type=float, default=8.0, help="seconds before the window opens")
    parser.add_argument("--colocated-threads", type=int, default=2)
    parser.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    parser.add_argument("--quick", action="store_true", help="a short run that proves it works")
    args = parser.parse_args(argv)
    if args.quick:
        args.window_s = min(args.window_s, 12.0)
        args.settle_s = min(args.settle_s, 5.0)

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            results[mode] = _measure_mode(mode, args, Path(tmp))
    co, dis = (results[m]["summary"]["itl_p99_ms"] for m in MODES)
    ratio = co / dis if co and dis else None
    print(f"\n{'mode':<15}{'ITL p50':>9}{'p90':>9}{'p99':>9}{'max':>9}{'tok/s':>8}{'long done':>11}")
    for mode in MODES:
        s = results[mode]["summary"]
        cells = [f"{s[k]:>9.1f}" if s[k] is not None else f"{'-':>9}" for k in
                 ("itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "itl_max_ms")]
        print(f"{mode:<15}{''.join(cells)}{s['stream_tokens_per_s']:>8.1f}{s['long_requests_done']:>11}")
    if ratio is not None:
        print(f"ITL p99: colocated / disaggregated = {ratio:.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"disaggregated-{stamp}.json"
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date": stamp, "machine": _machine(), "settings": vars(args),
        "results": results, "ratio_itl_p99_colocated_over_disaggregated": ratio,
    }  # fmt: skip
    out.write_text(json.dumps(record, indent=2, default=str))
    _plot(results, ratio, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

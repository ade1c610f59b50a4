"""The per-token cost of the worker-process hop: one backend in-process vs in its worker.

Both copies of the backend (same kind, same options, the default model) are loaded side by
side; single-stream greedy requests of ``--tokens`` tokens (``ignore_eos``) alternate between
them (ABBA), never at the same time. Per request the decode rate is the tokens after the
first over the time from the first to the last token (TPOT's inverse), so prefill is left
out. Prints the medians and the ratio worker/in-process, writes JSON and a PNG::

    .venv/bin/python benchmarks/worker_hop.py                   # llamacpp, 16 rounds x 128
    .venv/bin/python benchmarks/worker_hop.py --kind mlx --rounds 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.base import BackendConfig, GenerationRequest, SamplingParams  # noqa: E402
from backends.default_model import default_model_path  # noqa: E402
from backends.worker import WorkerBackend  # noqa: E402
from core_engine.cpu_features import cpu_model  # noqa: E402


def _factory(kind: str) -> Any:
    if kind == "llamacpp":
        from backends.llamacpp import create_backend
    elif kind == "mlx":
        from backends.mlx import create_backend
    else:
        raise SystemExit(f"unknown kind {kind!r} (llamacpp, mlx)")
    return create_backend


async def _one(backend: Any, tokens: int, k: int) -> float:
    request = GenerationRequest(
        request_id=f"hop-{k}",
        model="m",
        kind="completion",
        prompt="Once upon a time, in a land far away,",
        params=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
        stream=True,
    )
    times: list[float] = []
    count = 0
    async for chunk in backend.generate(request):
        n = len(chunk.token_ids)
        if n:
            times.append(time.perf_counter())
            count += n
    if count < tokens or len(times) < 2:
        raise RuntimeError(f"expected {tokens} tokens, got {count}")
    return (count - 1) / (times[-1] - times[0])


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="llamacpp")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/worker_hop")
    args = parser.parse_args()

    factory = _factory(args.kind)
    options = {"model_path": str(default_model_path()), "n_ctx": 1024}
    if args.kind == "llamacpp":
        options["n_threads"] = args.threads
    config = BackendConfig(name="hop", kind=args.kind, options=options)
    inline = factory(config)
    worker = WorkerBackend(config, factory, factory(config))
    print(f"loading {args.kind} in-process and in a worker process...", flush=True)
    await inline.start()
    await worker.start()
    rates: dict[str, list[float]] = {"in_process": [], "worker": []}
    try:
        for backend in (inline, worker):  # warm-up
            await _one(backend, 16, -1)
        for r in range(args.rounds):
            order = [("in_process", inline), ("worker", worker)]
            if r % 2:
                order.reverse()
            for name, backend in order:
                rates[name].append(await _one(backend, args.tokens, r))
            print(
                f"round {r + 1}/{args.rounds}: in-process {rates['in_process'][-1]:.1f} tok/s, "
                f"worker {rates['worker'][-1]:.1f} tok/s",
                flush=True,
            )
    finally:
        await worker.aclose()
        await inline.aclose()

    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["worker"] / medians["in_process"]
    print(
        f"\n{args.kind}, single stream, {args.tokens} tokens, {args.rounds} rounds (median decode rate)\n"
        f"  in-process  {medians['in_process']:8.1f} tok/s\n"
        f"  worker      {medians['worker']:8.1f} tok/s\n"
        f"  ratio worker/in-process: {ratio:.3f}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"cpu": cpu_model(), "python": platform.python_version()},
        "kind": args.kind,
        "tokens": args.tokens,
        "rates_tok_s": rates,
        "median_tok_s": medians,
        "ratio_worker_over_in_process": ratio,
    }
    (args.out / f"{args.kind}.json").write_text(json.dumps(record, indent=2))
    _plot(rates, ratio, args, args.out / f"{args.kind}.png")
    print(f"wrote {args.out / f'{args.kind}.json'} and .png")
    return 0


def _plot(rates: dict[str, list[float]], ratio: float, args: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.boxplot([rates["in_process"], rates["worker"]], tick_labels=["in-process", "worker process"])
    ax.set_ylabel("decode tok/s (single stream)")
    ax.set_title(f"{args.kind}: worker hop, {args.tokens} tokens x {args.rounds} (ratio {ratio:.3f})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

"""The MLX backend next to the llama.cpp backend on the same GGUF, in one run.

Both are infermux backends in this process (``kind = "mlx"`` and ``kind = "llamacpp"``),
driven through ``Backend.generate`` as the gateway drives them, on the default model
(SmolLM2-135M-Instruct Q4_1). Figures, each measured for both engines, interleaved so that
machine noise hits both alike, best of ``--repeats``:

* ``decode_1``  single-stream decode tok/s: output tokens after the first / their time
* ``prefill``   prefill tok/s: prompt tokens / time to first token, one long cold prompt
* ``ttft``      time to first token (s) of a short chat request with a cold prompt cache

Every prompt starts with a fresh number, so neither engine's prompt cache can help.
Ratios are MLX ÷ llama.cpp (above 1: MLX is faster, except for ``ttft`` where above 1
means MLX is slower).

    .venv/bin/python benchmarks/mlx_vs_llamacpp.py            # 512-token prefill, 128 decoded
    .venv/bin/python benchmarks/mlx_vs_llamacpp.py --quick    # proof run (small sizes)

Writes ``benchmarks/results/mlx_vs_llamacpp-<UTC time>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import json
import os
import platform
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.base import (  # noqa: E402
    Backend,
    BackendConfig,
    ChatMessage,
    GenerationRequest,
    SamplingParams,
)
from backends.default_model import default_model_path  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SENTENCE = (
    "The old lighthouse stood on a rock at the mouth of the bay, and every evening its keeper "
    "climbed the spiral stairs to light the lamp before the fishing boats came home. "
)
SENTENCE_TOKENS = 36  # SmolLM2's tokenizer; the exact count comes back in usage
_fresh = itertools.count(1)


def _completion(prompt: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        request_id="bench",
        model="smollm2",
        kind="completion",
        prompt=prompt,
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def _long_prompt(num_tokens: int) -> str:
    """About ``num_tokens`` tokens of text, starting with a number never used before."""
    return f"{next(_fresh)}. " + SENTENCE * max(1, round(num_tokens / SENTENCE_TOKENS))


async def _timed(backend: Backend, request: GenerationRequest) -> dict[str, float]:
    started = time.perf_counter()
    first: float | None = None
    usage = None
    async for chunk in backend.generate(request):
        if first is None and (chunk.token_ids or chunk.finish_reason):
            first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.perf_counter()
    assert usage is not None and first is not None
    return {
        "ttft_s": first - started,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "decode_s": ended - first,
    }


async def measure(backend: Backend, metric: str, args: argparse.Namespace) -> float:
    if metric == "decode_1":
        run = await _timed(backend, _completion(f"{next(_fresh)}. {SENTENCE}", args.decode))
        return (run["completion_tokens"] - 1) / run["decode_s"]
    if metric == "prefill":
        run = await _timed(backend, _completion(_long_prompt(args.prefill), 1))
        return run["prompt_tokens"] / run["ttft_s"]
    request = GenerationRequest(
        request_id="bench",
        model="smollm2",
        kind="chat",
        messages=(ChatMessage(role="user", content=f"{next(_fresh)}: name three rivers."),),
        params=SamplingParams(max_tokens=1, temperature=0.0),
    )
    return (await _timed(backend, request))["ttft_s"]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from backends.llamacpp import create_backend as create_llamacpp
    from backends.mlx import create_backend as create_mlx

    model = str(default_model_path())
    backends: dict[str, Backend] = {
        "llama.cpp": create_llamacpp(
            BackendConfig(
                name="llamacpp",
                kind="llamacpp",
                options={"model_path": model, "n_ctx": 2048, "n_threads": args.threads},
            )
        ),
        "MLX": create_mlx(
            BackendConfig(name="mlx", kind="mlx", options={"model_path": model, "n_ctx": 2048})
        ),
    }
    for backend in backends.values():
        await backend.start()
    metrics = ("decode_1", "prefill", "ttft")
    samples: dict[str, dict[str, list[float]]] = {m: {n: [] for n in backends} for m in metrics}
    try:
        for backend in backends.values():  # warm-up: first-call costs are not the engine's
            await measure(backend, "ttft", args)
        for repeat in range(args.repeats):
            for metric in metrics:
                for name, backend in backends.items():
                    value = await measure(backend, metric, args)
                    samples[metric][name].append(value)
                    print(f"repeat {repeat + 1}/{args.repeats} {metric:9s} {name:9s} {value:9.3f}")
    finally:
        for backend in backends.values():
            await backend.aclose()
    best: dict[str, dict[str, float]] = {}
    for metric, by_engine in samples.items():
        pick = min if metric == "ttft" else max
        best[metric] = {name: pick(values) for name, values in by_engine.items()}
    return {"samples": samples, "best": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--prefill", type=int, default=None, help="prompt tokens for prefill")
    parser.add_argument("--decode", type=int, default=None, help="tokens decoded")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.prefill = args.prefill or (128 if args.quick else 512)
    args.decode = args.decode or (32 if args.quick else 128)

    started = dt.datetime.now(dt.UTC)
    results = asyncio.run(run(args))
    best = results["best"]
    print()
    print(f"{'metric':10s} {'llama.cpp':>10s} {'MLX':>10s} {'MLX/llama.cpp':>14s}")
    ratios = {}
    for metric, values in best.items():
        ratios[metric] = values["MLX"] / values["llama.cpp"]
        unit = "s" if metric == "ttft" else "tok/s"
        print(
            f"{metric:10s} {values['llama.cpp']:10.2f} {values['MLX']:10.2f} "
            f"{ratios[metric]:13.2f}x  ({unit})"
        )
    payload = {
        "benchmark": "mlx_vs_llamacpp",
        "started_utc": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "platform": platform.platform(),
            "processor": _cpu_name(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "python": platform.python_version(),
        },
        "versions": {p: _version(p) for p in ("mlx", "mlx-lm", "llama_cpp_python")},
        "settings": {
            "model": default_model_path().name,
            "prefill_tokens": args.prefill,
            "decode_tokens": args.decode,
            "repeats": args.repeats,
            "llamacpp_threads": args.threads,
        },
        "best": best,
        "ratio_mlx_over_llamacpp": ratios,
        "samples": results["samples"],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = RESULTS / f"mlx_vs_llamacpp-{started.strftime('%Y%m%dT%H%M%SZ')}"
    base.with_suffix(".json").write_text(json.dumps(payload, indent=2))
    _plot(best, ratios, base.with_suffix(".png"))
    print(f"wrote {base}.json and .png")


def _plot(best: dict[str, dict[str, float]], ratios: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {
        "decode_1": "decode, 1 stream (tok/s)",
        "prefill": "prefill (tok/s)",
        "ttft": "time to first token (s)",
    }
    figure, axes = plt.subplots(1, len(best), figsize=(4 * len(best), 3.5))
    for axis, (metric, values) in zip(axes, best.items(), strict=True):
        names = list(values)
        bars = axis.bar(names, [values[n] for n in names], color=["#4c72b0", "#dd8452"])
        axis.bar_label(bars, fmt="%.2f")
        axis.set_title(f"{titles[metric]}\nMLX ÷ llama.cpp = {ratios[metric]:.2f}")
    figure.suptitle("SmolLM2-135M Q4_1: MLX (CPU) vs llama.cpp, same GGUF")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _version(package: str) -> str | None:
    try:
        return version(package)
    except Exception:
        return None


if __name__ == "__main__":
    main()

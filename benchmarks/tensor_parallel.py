"""Tensor parallelism on this machine: what a step costs at TP=1, 2, 3 on the default model.

For each ``tensor_parallel_size`` the engine (rank 0 here, the other ranks as processes) is
built on the embedded SmolLM2-135M in its default weight format, then:

* ``batch 1`` and ``batch 8`` decode: tokens per second and the step time (ITL) p50/p99 of
  a greedy 64-token generation after a short prompt;
* agreement with TP=1: the share of TP=1's greedy tokens the TP=N engine picks when fed
  TP=1's text (teacher-forced top-1), and the greedy tokens equal before TP=1's first
  near-tie.

On a 2-core CPU the ranks share the cores and every all-reduce is a round trip through the
kernel, so TP > 1 is slower here: the figure says what the split costs, not what it buys (on
N GPUs it divides the weights and KV per device by N). The script runs unchanged on a CUDA
host (``--device cuda``: rank r on cuda:r).

    .venv/bin/python benchmarks/tensor_parallel.py            # TP = 1, 2, 3
    .venv/bin/python benchmarks/tensor_parallel.py --quick    # TP = 1, 2, fewer tokens

Writes ``benchmarks/results/tensor_parallel-<UTC time>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gateway_overhead import _machine, _percentile  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PROMPTS = [
    "<|im_start|>user\nTell me about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a short poem about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "One, two, three, four,",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]


def _engine(world: int, args: argparse.Namespace) -> Any:
    from backends.default_model import default_model_path
    from core_engine.config import EngineConfig
    from core_engine.llm_engine import LLMEngine

    config = EngineConfig(
        model_path=str(default_model_path()), device=args.device, num_threads=args.threads,
        tensor_parallel_size=world, kv_cache_memory_bytes=128 * 2**20,
    )
    return LLMEngine.from_config(config)


def _decode(engine: Any, batch: int, tokens: int) -> dict[str, Any]:
    from core_engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", PROMPTS[i % len(PROMPTS)], params)
    engine.step()  # the prefill
    steps: list[float] = []
    generated = 0
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        generated += sum(len(o.new_token_ids) for o in outs)
    seconds = time.perf_counter() - started
    return {
        "tokens_per_s": generated / seconds, "itl_p50_ms": _percentile(steps, 50) * 1e3,
        "itl_p99_ms": _percentile(steps, 99) * 1e3,
    }


def _greedy(engine: Any, tokens: int) -> dict[str, Any]:
    from core_engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, logprobs=2)
    out: dict[str, Any] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"g{i}", prompt, params)
        out[f"g{i}"] = {"token_ids": [], "margins": []}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.req_id]["token_ids"] += list(o.new_token_ids)
            out[o.req_id]["margins"] += [r.top[0][1] - r.top[1][1] for r in o.logprobs or ()]
    return out


def _agreement(engine: Any, reference: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    from core_engine.sampling_params import SamplingParams

    agree = total = clear_equal = clear_total = 0
    for i, prompt in enumerate(PROMPTS):
        ref = reference[f"g{i}"]
        clear = next((k for k, m in enumerate(ref["margins"]) if m < 0.1), len(ref["margins"]))
        clear_total += clear
        clear_equal += got[f"g{i}"]["token_ids"][:clear] == ref["token_ids"][:clear]
        ids = engine.tokenizer.encode(prompt, add_special=True, parse_special=True)
        engine.add_request(f"t{i}", ids + ref["token_ids"], SamplingParams(max_tokens=1, prompt_logprobs=1))
        rows = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                rows = o.prompt_logprobs if o.prompt_logprobs is not None else rows
        assert rows is not None
        for row, token in zip(rows[len(ids):], ref["token_ids"], strict=True):
            agree += row.top[0][0] == token
            total += 1
    return {
        "teacher_forced_top1": agree / total, "tokens_compared": total,
        "greedy_equal_before_first_near_tie": clear_equal == len(PROMPTS), "tokens_before_near_ties": clear_total,
    }


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted(results, key=int)
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for k, batch in enumerate(("batch_1", "batch_8")):
        axes[0].bar([i + (k - 0.5) * 0.38 for i in range(len(worlds))],
                    [results[w][batch]["tokens_per_s"] for w in worlds], 0.38, label=batch.replace("_", " "))
        axes[1].bar([i + (k - 0.5) * 0.38 for i in range(len(worlds))],
                    [results[w][batch]["itl_p50_ms"] for w in worlds], 0.38, label=batch.replace("_", " "))
    for ax, title in zip(axes, ("decode tokens/s", "step time p50 (ms)"), strict=True):
        ax.set_xticks(range(len(worlds)), [f"TP={w}" for w in worlds])
        ax.set_title(title)
        ax.legend()
    fig.suptitle("core engine, SmolLM2-135M default format, tensor parallel over processes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, shared out among the ranks")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.tokens = [1, 2], 16
    results: dict[str, Any] = {}
    reference = None
    for world in args.sizes:
        print(f"TP={world}: loading ...", flush=True)
        started = time.perf_counter()
        engine = _engine(world, args)
        entry: dict[str, Any] = {"start_s": time.perf_counter() - started}
        try:
            for batch in (1, 8):
                print(f"TP={world}: decode batch {batch} ...", flush=True)
                entry[f"batch_{batch}"] = _decode(engine, batch, args.tokens)
            greedy = _greedy(engine, 32)
            if reference is None:
                reference = greedy
            else:
                entry["agreement_with_tp1"] = _agreement(engine, reference, greedy)
        finally:
            engine.close()
        results[str(world)] = entry
    base = results[str(args.sizes[0])]
    print(f"\n{'TP':<4}{'start s':>9}{'b1 tok/s':>10}{'b1 ITL p50':>12}{'b8 tok/s':>10}{'b8 ITL p50':>12}{'vs TP=1 b8':>12}")
    for world, r in results.items():
        ratio = r["batch_8"]["tokens_per_s"] / base["batch_8"]["tokens_per_s"]
        print(f"{world:<4}{r['start_s']:>9.1f}{r['batch_1']['tokens_per_s']:>10.1f}{r['batch_1']['itl_p50_ms']:>12.1f}"
              f"{r['batch_8']['tokens_per_s']:>10.1f}{r['batch_8']['itl_p50_ms']:>12.1f}{ratio:>11.2f}x")
        if "agreement_with_tp1" in r:
            print(f"    agreement with TP=1: {r['agreement_with_tp1']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = RESULTS / f"tensor_parallel-{stamp}.json"
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date": stamp, "machine": _machine(), "settings": vars(args), "results": results,
    }
    out.write_text(json.dumps(record, indent=2))
    _plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The core engine next to llama.cpp on the same GGUF, same thread count, in one run.

Figures (each measured for both, interleaved so that machine noise hits both alike):

* ``decode_1``     single-stream decode tok/s (128 tokens after a short prompt)
* ``prefill_512``  prefill tok/s of one 512-token prompt
* ``batch_16``, ``batch_64``  aggregate output tok/s, N concurrent requests x 128 tokens,
  wall clock from submission to the last token (short distinct prompts, greedy)
* ``ttft_prefix``  time to first token of a request whose 1,500-token prefix is cached,
  against the same request cold (llama.cpp: the prefix kept in its KV cache, as its server's
  prompt cache does)

llama.cpp runs in-process through llama-cpp-python's low-level batch API
(``benchmarks/llamacpp_batch.py``: one ``llama_decode`` per step over all sequences, one KV
stream per sequence), which is stronger than its HTTP server. Each figure is also printed as a fraction of its roofline on
this machine: decode is bounded by weight bytes / measured memory bandwidth, prefill by
FLOPs / measured matmul FLOP/s in the engine's dtype, a batch of N by the larger of the two;
and as a fraction of the roofline ``infermux plan`` computes for the engine's weight format
and KV dtype (its own measurements of this machine, the block kernels timed). Then the
accuracy against the exact model (mean KL, top-1) of the engine's format, of each explicit
weight format in the engine's dtype, and of llama.cpp,
and where a decode step's time goes (cProfile, batch 1 and 16).

    .venv/bin/python benchmarks/core_engine_vs_llamacpp.py            # the full run
    .venv/bin/python benchmarks/core_engine_vs_llamacpp.py --quick    # reduced sizes

Writes ``benchmarks/results/core_engine_vs_llamacpp-<UTC time>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from backends.default_model import default_model_path  # noqa: E402
from core_engine.config import EngineConfig  # noqa: E402
from core_engine.llm_engine import LLMEngine  # noqa: E402
from core_engine.sampling_params import SamplingParams  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TARGETS = {"batch_16": 2.5, "batch_64": 3.5, "prefill_512": 3.0, "decode_1": 1.0}
TEXT = (
    "The history of mountain huts begins with shepherds who needed shelter in summer pastures. "
    "Later, alpine clubs built stone refuges along the main routes, each with a warden, a stove "
    "and a logbook where climbers wrote the weather, their route and the time they left. "
    "Today many huts have solar panels, radio links and menus with three courses; the logbook "
    "remains, and so does the rule that nobody is turned away in a storm. "
)


# -- machine limits -----------------------------------------------------------------------


def measure_bandwidth() -> float:
    """Read bandwidth in bytes/s (sum over a 512 MiB fp32 buffer; best of 5)."""
    x = torch.ones(128 * 2**20)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def measure_matmul_flops(dtype: torch.dtype) -> float:
    """FLOP/s of a prefill-shaped linear (512 x 576 @ 576 x 3072) in ``dtype``; best of 10."""
    x, w = torch.randn(512, 576, dtype=dtype), torch.randn(3072, 576, dtype=dtype)
    torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - t)
    return 2 * 512 * 576 * 3072 / best


def model_costs(engine: LLMEngine) -> dict[str, float]:
    """Weight bytes read per decode step and matmul FLOPs per token."""
    model = engine.model_runner.model
    cfg = engine.model_config
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up, down
    matmul_params = cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size
    return {
        "weight_bytes": float(model.matmul_weight_bytes()),
        "flops_per_token": 2.0 * matmul_params,
    }


# -- the core engine ----------------------------------------------------------------------


def engine_run(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[float, float | None]:
    """Run ``prompts`` to completion; (wall seconds, seconds to the first token of request 0)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    first: float | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.req_id == "b0" and out.new_token_ids:
                first = time.perf_counter() - started
    return time.perf_counter() - started, first


def engine_decode_1(engine: LLMEngine, prompt: list[int], n: int) -> float:
    engine.add_request("d", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    engine.step()  # prefill + first token
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (n - 1) / (time.perf_counter() - started)


# -- runs ---------------------------------------------------------------------------------


#: CPU seconds used / (wall seconds x threads) per measured call: well below 1 means the
#: process waited for cores that other work held (a noisy measurement).
CPU_SHARE: list[float] = []


def side_by_side(
    repeats: int, engine_fn: Callable[[], float], llama_fn: Callable[[], float] | None
) -> tuple[float, float | None]:
    """Best of ``repeats`` (machine noise only ever slows a run down), engine and llama.cpp
    alternating so that a noisy period hits both."""
    engine_values: list[float] = []
    llama_values: list[float] = []
    for _ in range(repeats):
        for fn, values in ((engine_fn, engine_values), (llama_fn, llama_values)):
            if fn is None:
                continue
            wall, cpu = time.perf_counter(), time.process_time()
            values.append(fn())
            busy = (time.perf_counter() - wall) * torch.get_num_threads()
            CPU_SHARE.append((time.process_time() - cpu) / max(busy, 1e-9))
    return max(engine_values), (max(llama_values) if llama_values else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="GGUF (default: SmolLM2-135M Q4_1)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--weight-format",
        default="auto",
        choices=["auto", "dense", "fp16", "int8", "int4"],
        help="matmul weight storage (EngineConfig.weight_format)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefix-len", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs per figure")
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument(
        "--compile-decode", action="store_true", help="torch.compile the decode step"
    )
    parser.add_argument("--quick", action="store_true", help="reduced sizes: a proof run")
    parser.add_argument("--note", default="", help="free text stored in the JSON (machine state)")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the KL / top-1 comparison")
    parser.add_argument("--no-profile", action="store_true", help="skip the per-step time breakdown")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.output_len, args.prefix_len, args.repeats = [16, 64], 32, 1500, 2

    torch.set_num_threads(args.threads)
    model_path = args.model or default_model_path()
    max_len = max(args.prefix_len + 64, args.prefill_len + 8, 64 + args.output_len)
    print(f"model {model_path.name}, {args.threads} threads", flush=True)
    engine = LLMEngine.from_config(
        EngineConfig(
            model_path=str(model_path),
            dtype=args.dtype,
            weight_format=args.weight_format,
            num_threads=args.threads,
            max_num_batched_tokens=max(512, args.prefill_len),
            max_num_seqs=max(args.concurrency),
            kv_cache_memory_bytes=1 << 30,
            compile_decode=args.compile_decode,
        )
    )
    dtype = engine.model_runner.kv_cache.dtype
    tok = engine.tokenizer
    corpus = tok.encode(TEXT * 60, add_special=False)
    llama = llama_multi = None
    if not args.no_llamacpp:
        from llamacpp_batch import LlamaCppBatch

        # One sequence (decode, prefill, prefix reuse) and one context for the batches with a
        # KV stream per sequence: at 64 sequences llama.cpp's unified KV cache was ~3x slower
        # (every sequence's attention spans all cells), so the split one is its stronger setup.
        llama = LlamaCppBatch(model_path, threads=args.threads, max_seqs=1, n_ctx=max_len + 32)
        llama_multi = LlamaCppBatch(
            model_path,
            threads=args.threads,
            max_seqs=max(args.concurrency),
            n_ctx=max(args.concurrency) * (12 + args.output_len + 16),
            kv_unified=False,
        )

    machine = {"bandwidth_Bps": measure_bandwidth(), "matmul_flops": measure_matmul_flops(dtype)}
    costs = model_costs(engine)
    gguf_bytes = float(model_path.stat().st_size)
    print(
        f"bandwidth {machine['bandwidth_Bps'] / 1e9:.1f} GB/s, {dtype} matmul "
        f"{machine['matmul_flops'] / 1e9:.0f} GFLOP/s, engine weights "
        f"{costs['weight_bytes'] / 2**20:.0f} MiB, GGUF {gguf_bytes / 2**20:.0f} MiB",
        flush=True,
    )

    from core_engine.plan import plan_model

    engine_format = engine.model_runner.model.weight_format
    kv_name = str(dtype).removeprefix("torch.")
    plans: dict[str, Any] = {}

    def plan_row(context: int, concurrency: int) -> Any:
        """The row of ``infermux plan`` for the engine's format and KV dtype."""
        key = f"{context}x{concurrency}"
        if key not in plans:
            plans[key] = plan_model(model_path, device="cpu", context=context, concurrency=concurrency)
        plan = plans[key]
        # dtype float32 on a bf16 CPU: plan rows are per compute dtype; the weights set the roofline.
        kv = kv_name if any(r.kv_dtype == kv_name for r in plan.rows) else plan.device.compute_dtype
        # The engine at weight_format "auto" (the file's 8-bit tensors at int8): the plan's auto row.
        mixed = args.weight_format == "auto" and engine.model_runner.model.layer_formats
        return plan.row("auto" if mixed else engine_format, kv)

    def roofline(batch: int, weight_bytes: float) -> float:
        step = max(
            weight_bytes / machine["bandwidth_Bps"],
            batch * costs["flops_per_token"] / machine["matmul_flops"],
        )
        return batch / step

    results: dict[str, dict[str, Any]] = {}
    short = [corpus[i * 7 : i * 7 + 12] for i in range(max(args.concurrency))]

    # Warm both up (first calls pay one-off allocations).
    engine_run(engine, short[:4], 4)
    if llama and llama_multi:
        llama.generate(short[:1], 4)
        llama_multi.generate(short[:4], 4)

    print("single-stream decode...", flush=True)
    n = args.output_len
    eng_tps, llama_tps = side_by_side(
        args.repeats,
        lambda: engine_decode_1(engine, short[0], n),
        (lambda: (n - 1) / _llama_decode_time(llama, short[0], n)) if llama else None,
    )
    results["decode_1"] = {
        "unit": "tok/s",
        "engine": eng_tps,
        "llamacpp": llama_tps,
        "engine_roofline": None,
        "roofline_fn": lambda: (roofline(1, costs["weight_bytes"]), roofline(1, gguf_bytes)),
        "plan_fn": lambda: plan_row(12 + n, 1).decode_tok_s_batch1,
    }

    print("prefill...", flush=True)
    prompt = corpus[: args.prefill_len]

    def engine_prefill() -> float:
        engine.reset_prefix_cache()
        return args.prefill_len / engine_run(engine, [prompt], 1)[0]

    def llama_prefill() -> float:
        assert llama is not None
        llama.clear()
        t = time.perf_counter()
        llama.prefill([prompt])
        return args.prefill_len / (time.perf_counter() - t)

    eng_tps, llama_tps = side_by_side(
        args.repeats, engine_prefill, llama_prefill if llama else None
    )
    results[f"prefill_{args.prefill_len}"] = {
        "unit": "tok/s",
        "engine": eng_tps,
        "llamacpp": llama_tps,
        "engine_roofline": None,
        "roofline_fn": lambda: (machine["matmul_flops"] / costs["flops_per_token"],) * 2,
        "plan_fn": lambda: plan_row(args.prefill_len, 1).prefill_tok_s,
    }

    for conc in args.concurrency:
        print(f"{conc} concurrent x {n} tokens...", flush=True)
        prompts = short[:conc]

        def engine_batch(conc: int = conc, prompts: list[list[int]] = prompts) -> float:
            engine.reset_prefix_cache()
            return conc * n / engine_run(engine, prompts, n)[0]

        def llama_batch(conc: int = conc, prompts: list[list[int]] = prompts) -> float:
            assert llama_multi is not None
            return conc * n / llama_multi.generate(prompts, n)[1]

        eng_tps, llama_tps = side_by_side(
            args.repeats, engine_batch, llama_batch if llama else None
        )
        results[f"batch_{conc}"] = {
            "unit": "tok/s",
            "engine": eng_tps,
            "llamacpp": llama_tps,
            "engine_roofline": None,
            "roofline_fn": lambda conc=conc: (
                roofline(conc, costs["weight_bytes"]),
                roofline(conc, gguf_bytes),
            ),
            "plan_fn": lambda conc=conc: plan_row(12 + n, conc).decode_tok_s_concurrency,
        }

    print(f"TTFT with a {args.prefix_len}-token cached prefix...", flush=True)
    prefix = corpus[: args.prefix_len]
    cold_prompt = prefix + tok.encode(
        " Question: who keeps the logbook? Answer:", add_special=False
    )
    warm_prompt = prefix + tok.encode(" Question: what is on the menu? Answer:", add_special=False)
    engine.reset_prefix_cache()
    cold = engine_run(engine, [cold_prompt], 1)[1]
    warm = engine_run(engine, [warm_prompt], 1)[1]
    ttft: dict[str, Any] = {
        "unit": "s",
        "engine_cold": cold,
        "engine_warm": warm,
        "engine": warm / cold,
    }
    if llama:
        llama.clear()
        t = time.perf_counter()
        llama.prefill([cold_prompt])
        ttft["llamacpp_cold"] = time.perf_counter() - t
        llama.truncate(0, args.prefix_len)
        t = time.perf_counter()
        llama.prefill([warm_prompt], start=[args.prefix_len])
        ttft["llamacpp_warm"] = time.perf_counter() - t
        ttft["llamacpp"] = ttft["llamacpp_warm"] / ttft["llamacpp_cold"]
    results["ttft_prefix"] = ttft
    accuracy = None if args.no_accuracy else measure_accuracy(engine, model_path, llama, corpus)
    if llama and llama_multi:
        llama.close()
        llama_multi.close()
    profile = None if args.no_profile else profile_steps(engine, short, n)
    # Limits again at the end (best of both): a busy moment at the start must not lower them.
    machine["bandwidth_Bps"] = max(machine["bandwidth_Bps"], measure_bandwidth())
    machine["matmul_flops"] = max(machine["matmul_flops"], measure_matmul_flops(dtype))
    print("rooflines of infermux plan...", flush=True)
    for r in results.values():
        if "engine_roofline" in r:
            r["engine_roofline"], r["llamacpp_roofline"] = r["roofline_fn"]()
            del r["roofline_fn"]
            r["plan_roofline"] = r.pop("plan_fn")()
    extra = {
        "weight_format": engine_format,
        "layer_formats": engine.model_runner.model.layer_formats,
        "accuracy": accuracy,
        "profile": profile,
    }
    report(args, results, machine, costs, gguf_bytes, str(dtype), model_path.name, extra)


def measure_accuracy(engine: LLMEngine, model_path: Path, llama: Any, corpus: list[int]) -> dict[str, Any]:
    """Mean KL from the exact (dense fp32) model's next-token distribution and top-1
    agreement, teacher-forced on 300 tokens of the corpus: the engine's format, and llama.cpp."""
    from core_engine.attention import ContiguousAttention
    from core_engine.gguf_loader import load_model

    print("accuracy against the exact model...", flush=True)
    ids = corpus[:300]
    exact_model, _, _ = load_model(model_path, dtype=torch.float32, show_progress=False)

    def logits(model: Any) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention(model.config.num_layers)).float()

    exact = logits(exact_model).float().log_softmax(-1)
    del exact_model

    def compare(other: torch.Tensor) -> dict[str, float]:
        lp = other.float().log_softmax(-1)
        return {
            "kl": float((exact.exp() * (exact - lp)).sum(-1).mean()),
            "top1": float((exact.argmax(-1) == lp.argmax(-1)).float().mean()),
        }

    out: dict[str, Any] = {"positions": len(ids), "engine": compare(logits(engine.model_runner.model))}
    # Each explicit format this CPU runs in the engine's compute dtype, the file's blocks as
    # the engine takes them.
    from core_engine.model.linear import check_weight_format

    dtype = engine.model_runner.model.dtype
    out["formats"] = {}
    for fmt in ("dense", "fp16", "int8", "int4"):
        try:
            check_weight_format(fmt, dtype=dtype, device="cpu")
        except ValueError:
            continue
        model, _, _ = load_model(model_path, dtype=dtype, show_progress=False)
        model.set_weight_format(fmt)
        out["formats"][f"{fmt} ({str(dtype).removeprefix('torch.')})"] = compare(logits(model))
        del model
    if llama is not None:
        import llama_cpp
        import numpy as np

        ref = llama_cpp.Llama(str(model_path), n_ctx=512, n_threads=torch.get_num_threads(), logits_all=True, verbose=False)
        try:
            ref.eval(ids)
            out["llamacpp"] = compare(torch.from_numpy(np.array(ref.scores[: len(ids)])))
        finally:
            ref.close()
    return out


#: Where a decode step's time goes: cProfile's own time per function, grouped.
_PROFILE_GROUPS = (
    ("products (quant_linear / linear kernels)", ("quant_linear", "linear", "addmm", "linear_dynamic")),
    ("attention (cache write + decode kernel)", ("paged_decode", "scaled_dot_product", "index_copy", "index_select", "write_quantized", "paged_attention")),
    ("sampling", ("sampler", "sample", "topk", "argmax", "softmax", "multinomial")),
    ("scheduler + metadata + outputs", ("scheduler", "kv_cache_manager", "block_pool", "build_attention_metadata", "_make_output", "stop_checker", "detoken", "request")),
)


def profile_steps(engine: LLMEngine, prompts: list[list[int]], n: int) -> dict[str, Any]:
    """Per-step time breakdown (cProfile, own time) of decode at batch 1 and 16."""
    import cProfile
    import pstats

    print("profiling decode steps...", flush=True)
    out: dict[str, Any] = {}
    for batch in (1, 16):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"prof{batch}-{i}", prompts[i], params)
        engine.step()  # prefill
        prof = cProfile.Profile()
        steps = 0
        started = time.perf_counter()
        prof.enable()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        prof.disable()
        wall = time.perf_counter() - started
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        groups = {name: 0.0 for name, _ in _PROFILE_GROUPS}
        groups["other python / torch ops"] = 0.0
        total = 0.0
        for (filename, _, func), (_, _, tottime, _, _) in stats.items():
            total += tottime
            key = f"{filename}:{func}".lower()
            for name, needles in _PROFILE_GROUPS:
                if any(needle in key for needle in needles):
                    groups[name] += tottime
                    break
            else:
                groups["other python / torch ops"] += tottime
        out[f"batch_{batch}"] = {
            "steps": steps,
            "ms_per_step_profiled": total / max(steps, 1) * 1e3,
            "ms_per_step_wall": wall / max(steps, 1) * 1e3,
            "ms_per_step": {name: t / max(steps, 1) * 1e3 for name, t in groups.items()},
        }
    return out


def _llama_decode_time(llama: Any, prompt: list[int], n: int) -> float:
    llama.clear()
    token = llama.prefill([prompt])[0]
    t = time.perf_counter()
    pos = len(prompt)
    for _ in range(n - 1):
        llama._decode([(token, pos, 0, True)])
        token = llama._argmax(0)
        pos += 1
    return time.perf_counter() - t


def report(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    machine: dict[str, float],
    costs: dict[str, float],
    gguf_bytes: float,
    dtype: str,
    model_name: str,
    extra: dict[str, Any],
) -> None:
    print()
    print(f"engine weights: {extra['weight_format']}" + (f" ({extra['layer_formats']})" if extra["layer_formats"] else ""))
    print(
        f"limits (best of start and end): read bandwidth {machine['bandwidth_Bps'] / 1e9:.1f} GB/s, "
        f"{dtype} matmul {machine['matmul_flops'] / 1e9:.0f} GFLOP/s"
    )
    print(
        f"{'figure':<14}{'engine':>12}{'llama.cpp':>12}{'ratio':>8}{'target':>8}{'eng/roof':>10}{'lcpp/roof':>10}"
        f"{'plan':>10}{'eng/plan':>10}"
    )
    for name, r in results.items():
        if name == "ttft_prefix":
            continue
        ratio = r["engine"] / r["llamacpp"] if r.get("llamacpp") else None
        r["ratio"] = ratio
        r["engine_fraction_of_roofline"] = r["engine"] / r["engine_roofline"]
        r["llamacpp_fraction_of_roofline"] = (
            r["llamacpp"] / r["llamacpp_roofline"] if r.get("llamacpp") else None
        )
        print(
            f"{name:<14}{r['engine']:>12.1f}{_fmt(r.get('llamacpp'), '.1f'):>12}{_fmt(ratio, '.2f'):>8}"
            f"{_fmt(TARGETS.get(name), '.1f'):>8}{r['engine_fraction_of_roofline']:>10.2f}"
            f"{_fmt(r['llamacpp_fraction_of_roofline'], '.2f'):>10}"
            f"{_fmt(r.get('plan_roofline'), '.0f'):>10}"
            f"{_fmt(r['engine'] / r['plan_roofline'] if r.get('plan_roofline') else None, '.2f'):>10}"
        )
        r["engine_fraction_of_plan"] = r["engine"] / r["plan_roofline"] if r.get("plan_roofline") else None
    t = results["ttft_prefix"]
    print(
        f"TTFT {args.prefix_len}-token prefix: engine cold {t['engine_cold'] * 1e3:.0f} ms, warm "
        f"{t['engine_warm'] * 1e3:.0f} ms (warm/cold {t['engine']:.3f}, target <= 0.2)"
        + (
            f"; llama.cpp cold {t['llamacpp_cold'] * 1e3:.0f} ms, warm {t['llamacpp_warm'] * 1e3:.0f} ms"
            if "llamacpp_cold" in t
            else ""
        )
    )
    acc = extra.get("accuracy")
    if acc:
        line = f"accuracy vs the exact model ({acc['positions']} positions): engine KL {acc['engine']['kl']:.5f}, top-1 {acc['engine']['top1']:.3f}"
        if "llamacpp" in acc:
            line += f"; llama.cpp KL {acc['llamacpp']['kl']:.5f}, top-1 {acc['llamacpp']['top1']:.3f}"
        print(line)
        for fmt, figures in acc.get("formats", {}).items():
            print(f"  format {fmt:<18} KL {figures['kl']:.5f}, top-1 {figures['top1']:.3f}")
    for batch, prof in (extra.get("profile") or {}).items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in prof["ms_per_step"].items())
        print(f"profile {batch}: {prof['ms_per_step_wall']:.2f} ms/step wall ({prof['ms_per_step_profiled']:.2f} under cProfile): {parts}")
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = RESULTS / f"core_engine_vs_llamacpp-{stamp}"
    payload = {
        "benchmark": "core_engine_vs_llamacpp",
        "time_utc": stamp,
        "model": model_name,
        "engine_dtype": dtype,
        "threads": args.threads,
        "compile_decode": args.compile_decode,
        "llamacpp_mode": "llama-cpp-python low-level batch API (llama_batch, one seq_id per request, "
        "kv_unified=False for the batches)",
        "quick": args.quick,
        "output_len": args.output_len,
        "note": args.note,
        "cpu_share_min_median": [min(CPU_SHARE), sorted(CPU_SHARE)[len(CPU_SHARE) // 2]]
        if CPU_SHARE
        else None,
        "machine": {**machine, "cpu": platform.processor() or platform.machine()},
        "costs": {**costs, "gguf_bytes": gguf_bytes},
        "targets": TARGETS,
        "results": results,
        **extra,
    }
    base.with_suffix(".json").write_text(json.dumps(payload, indent=2))
    _plot(results, base.with_suffix(".png"), args)
    print(f"wrote {base}.json and .png")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _plot(results: dict[str, dict[str, Any]], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in results if n != "ttft_prefix"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = range(len(names))
    eng = [results[n]["engine"] for n in names]
    lc = [results[n].get("llamacpp") or 0 for n in names]
    ax1.bar([x - 0.2 for x in xs], eng, 0.4, label="core engine")
    ax1.bar([x + 0.2 for x in xs], lc, 0.4, label="llama.cpp")
    ax1.set_xticks(list(xs), names)
    ax1.set_ylabel("tok/s")
    ax1.set_title(f"throughput, {args.threads} threads")
    ax1.legend()
    ax2.bar(
        [x - 0.2 for x in xs],
        [results[n]["engine_fraction_of_roofline"] for n in names],
        0.4,
        label="core engine",
    )
    ax2.bar(
        [x + 0.2 for x in xs],
        [results[n].get("llamacpp_fraction_of_roofline") or 0 for n in names],
        0.4,
        label="llama.cpp",
    )
    ax2.set_xticks(list(xs), names)
    ax2.set_ylabel("fraction of roofline")
    t = results["ttft_prefix"]
    ax2.set_title(f"roofline fraction; TTFT warm/cold = {t['engine']:.3f}")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

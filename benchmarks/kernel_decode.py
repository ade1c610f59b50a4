"""Decode micro-benchmark of the core engine's kernels: Triton vs the torch references.

    python benchmarks/kernel_decode.py                       # on CUDA (scripts/gpu_check.sh)
    python benchmarks/kernel_decode.py --device cpu --quick  # proves the script on a CPU box

Three sections, each printed as a table and collected into one JSON document (``--json PATH``,
default ``$OUT/kernel_decode.json`` when ``$OUT`` is set):

1. ``paged_attention``: the paged decode kernel against its torch reference and, as a peer
   that pays no paging, torch's ``scaled_dot_product_attention`` on a dense padded cache, at
   several batch sizes; µs per call, K/V bytes read per second and the fraction of the GPU's
   memory bandwidth (decode attention is bandwidth-bound: it reads every cached K/V once).
2. ``ops``: RMSNorm, fused add+RMSNorm, rotary, the KV slot write, greedy pick and the
   top-k/top-p/min-p filter, each Triton vs torch.
3. ``engine``: aggregate decode tok/s of ``core_engine.LLM`` with the Triton kernels
   (``INFERMUX_KERNELS=auto``) and without (``=torch``), on the default GGUF when installed,
   else a random-weight model of the same shape written with ``tests/core_engine/gguf_factory``.

On CPU the Triton columns are empty (the interpreter is a test vehicle, not a backend).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core_engine.kernels import (  # noqa: E402
    apply_rotary_embedding_reference,
    fused_add_rms_norm_reference,
    paged_attention_decode_reference,
    reshape_and_cache_reference,
    rms_norm_reference,
    rotary_cos_sin,
    use_triton,
)

# (n_heads, n_kv_heads, head_dim) of the attention shapes measured.
MODELS = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}
# Peak HBM bandwidth (GB/s) by device-name fragment, for the fraction-of-roofline column.
PEAK_GBPS = {
    "H200": 4800.0,
    "H100": 3350.0,
    "A100": 2039.0,
    "L40S": 864.0,
    "A10G": 600.0,
    "L4": 300.0,
}


def time_us(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Median wall time of one call after a warm-up call, in µs (CUDA events on a GPU)."""
    fn()  # compiles the Triton kernel for these constexprs and warms the allocator
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _peak_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gbps for key, gbps in PEAK_GBPS.items() if key in name), None)


def bench_paged_attention(
    device: torch.device, batches: list[int], context: int, dtype: torch.dtype, iters: int
) -> list[dict]:
    """Paged decode at each batch size; contexts are ragged around ``context`` tokens."""
    from core_engine.kernels.paged_attention import paged_attention_decode

    gen = torch.Generator().manual_seed(0)
    block_size, rows, peak = 16, [], _peak_gbps(device)
    for model, (n_heads, n_kv, head_dim) in MODELS.items():
        for batch in batches:
            lens = torch.randint(context // 2, context * 3 // 2 + 1, (batch,), generator=gen)
            blocks_per_seq = (lens + block_size - 1) // block_size
            num_blocks = int(blocks_per_seq.sum())
            max_blocks = int(blocks_per_seq.max())
            k_cache = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=gen).to(
                device, dtype
            )
            v_cache = torch.randn(num_blocks, block_size, n_kv, head_dim, generator=gen).to(
                device, dtype
            )
            order = torch.randperm(num_blocks, generator=gen)
            tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
            start = 0
            for s, nb in enumerate(blocks_per_seq.tolist()):
                tables[s, :nb] = order[start : start + nb]
                start += nb
            tables, context_lens = tables.to(device), lens.to(torch.int32).to(device)
            q = torch.randn(batch, n_heads, head_dim, generator=gen).to(device, dtype)
            args = (q, k_cache, v_cache, tables, context_lens, head_dim**-0.5)
            # Peer: dense padded K/V, masked SDPA (no block-table gather inside the timed call).
            max_len = max_blocks * block_size
            dense_k = k_cache[tables.long()].reshape(batch, max_len, n_kv, head_dim).transpose(1, 2)
            dense_v = v_cache[tables.long()].reshape(batch, max_len, n_kv, head_dim).transpose(1, 2)
            mask = (torch.arange(max_len, device=device)[None, :] < context_lens[:, None])[
                :, None, None, :
            ]
            q4 = q[:, :, None, :]  # (B, H, 1, D)

            def sdpa(q4=q4, dense_k=dense_k, dense_v=dense_v, mask=mask) -> torch.Tensor:
                return F.scaled_dot_product_attention(
                    q4, dense_k, dense_v, attn_mask=mask, enable_gqa=True
                )

            try:
                sdpa()
            except TypeError:  # torch < 2.5 has no enable_gqa: give the peer expanded heads
                group = n_heads // n_kv
                dense_k = dense_k.repeat_interleave(group, dim=1)
                dense_v = dense_v.repeat_interleave(group, dim=1)

                def sdpa(q4=q4, dense_k=dense_k, dense_v=dense_v, mask=mask) -> torch.Tensor:
                    return F.scaled_dot_product_attention(q4, dense_k, dense_v, attn_mask=mask)

            kv_bytes = int(lens.sum()) * n_kv * head_dim * 2 * k_cache.element_size()
            row: dict[str, Any] = {
                "model": model,
                "batch": batch,
                "mean_context": float(lens.float().mean()),
            }
            row["torch_us"] = time_us(
                lambda args=args: paged_attention_decode_reference(*args), device, iters
            )
            row["sdpa_dense_us"] = time_us(sdpa, device, iters)
            if use_triton(device):
                row["triton_us"] = time_us(
                    lambda args=args: paged_attention_decode(*args), device, iters
                )
                row["triton_gbps"] = kv_bytes / row["triton_us"] / 1e3
                row["speedup_vs_torch"] = row["torch_us"] / row["triton_us"]
                row["speedup_vs_sdpa"] = row["sdpa_dense_us"] / row["triton_us"]
                if peak is not None:
                    row["fraction_of_peak_bw"] = row["triton_gbps"] / peak
            rows.append(row)
            del k_cache, v_cache, dense_k, dense_v
    return rows


def bench_ops(device: torch.device, quick: bool, dtype: torch.dtype, iters: int) -> list[dict]:
    """Each non-attention kernel at Llama-8B-like sizes (smaller with ``quick``)."""
    import core_engine.kernels as K

    gen = torch.Generator().manual_seed(1)
    tokens, hidden, n_heads, n_kv, head_dim = (
        (32, 1024, 8, 2, 64) if quick else (256, 4096, 32, 8, 128)
    )

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    x, residual, weight = rand(tokens, hidden), rand(tokens, hidden), rand(hidden)
    qkv = rand(tokens, (n_heads + 2 * n_kv) * head_dim)
    q = qkv[:, : n_heads * head_dim].view(tokens, n_heads, head_dim)
    k = qkv[:, n_heads * head_dim : (n_heads + n_kv) * head_dim].view(tokens, n_kv, head_dim)
    v = qkv[:, (n_heads + n_kv) * head_dim :].view(tokens, n_kv, head_dim)
    cos, sin = (t.to(device) for t in rotary_cos_sin(head_dim, 8192))
    positions = torch.randint(0, 8192, (tokens,), generator=gen).to(device)
    k_cache = torch.zeros(tokens * 4 // 16 + 1, 16, n_kv, head_dim, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * 16, generator=gen)[:tokens].to(device)
    cases: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        (
            "rms_norm",
            lambda: K.rms_norm(x, weight, 1e-5),
            lambda: rms_norm_reference(x, weight, 1e-5),
        ),
        (
            "fused_add_rms_norm",
            lambda: K.fused_add_rms_norm(x, residual, weight, 1e-5),
            lambda: fused_add_rms_norm_reference(x, residual, weight, 1e-5),
        ),
        (
            "rotary (in place)",
            lambda: K.apply_rotary_embedding(q, k, positions, cos, sin, inplace=True),
            lambda: apply_rotary_embedding_reference(q, k, positions, cos, sin, inplace=True),
        ),
        (
            "reshape_and_cache",
            lambda: K.reshape_and_cache(k, v, k_cache, v_cache, slots),
            lambda: reshape_and_cache_reference(k, v, k_cache, v_cache, slots),
        ),
    ]
    rows = []
    for name, kernel, reference in cases:
        row: dict[str, Any] = {"op": name, "torch_us": time_us(reference, device, iters)}
        if use_triton(device):
            row["triton_us"] = time_us(kernel, device, iters)
            row["speedup_vs_torch"] = row["torch_us"] / row["triton_us"]
        rows.append(row)
    return rows


def _engine_model(quick: bool, workdir: Path) -> tuple[Path, str]:
    """The default GGUF if installed, else a random-weight model of SmolLM2-135M's shape."""
    try:
        from backends.default_model import default_model_path

        return default_model_path(), "default GGUF (SmolLM2-135M-Instruct Q4_1)"
    except (ImportError, FileNotFoundError):
        pass
    sys.path.insert(0, str(ROOT / "tests" / "core_engine"))
    from gguf import GGMLQuantizationType
    from gguf_factory import TinyLlamaSpec, write_llama_gguf  # type: ignore[import-not-found]

    spec = (
        TinyLlamaSpec()
        if quick
        else TinyLlamaSpec(
            hidden_size=576,
            intermediate_size=1536,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            context_length=2048,
        )
    )
    path = write_llama_gguf(
        workdir / "random.gguf", weight_type=GGMLQuantizationType.F16, spec=spec
    )
    return path, f"random-weight F16 GGUF ({spec.num_layers} layers, hidden {spec.hidden_size})"


def bench_engine(device: torch.device, batches: list[int], max_tokens: int, quick: bool) -> dict:
    """Aggregate output tok/s of ``LLM.generate`` with and without the Triton kernels."""
    try:
        from core_engine.llm import LLM
        from core_engine.sampling_params import SamplingParams
    except ImportError as exc:
        return {"skipped": f"core engine not importable: {exc}"}
    result: dict[str, Any] = {"max_tokens": max_tokens, "runs": []}
    previous = os.environ.get("INFERMUX_KERNELS")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path, result["model"] = _engine_model(quick, Path(tmp))
        except Exception as exc:  # no gguf package, no factory: report instead of failing
            return {"skipped": f"no model could be built: {exc!r}"}
        choices = ["auto", "torch"] if use_triton(device) else ["torch"]
        try:
            for kernels in choices:
                # Read when the engine builds its attention context.
                os.environ["INFERMUX_KERNELS"] = kernels
                llm = LLM(
                    str(path),
                    device=str(device),
                    kv_cache_memory_bytes=2**30,
                    max_num_seqs=max(batches),
                    seed=0,
                )
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                llm.generate(
                    ["warm up"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
                )
                for batch in batches:
                    prompts = [
                        f"Request {i}: tell me a story about the number {i}." for i in range(batch)
                    ]
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    outputs = llm.generate(prompts, params)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    elapsed = time.perf_counter() - t0
                    generated = sum(len(o.token_ids) for o in outputs)
                    result["runs"].append(
                        {
                            "kernels": kernels,
                            "batch": batch,
                            "tokens": generated,
                            "tok_per_s": generated / elapsed,
                        }
                    )
                del llm
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        except Exception as exc:  # the engine is another team's; record its failure, keep the rest
            result["error"] = "".join(traceback.format_exception_only(exc)).strip()
        finally:
            if previous is None:
                os.environ.pop("INFERMUX_KERNELS", None)
            else:
                os.environ["INFERMUX_KERNELS"] = previous
    return result


def _print_table(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    if not rows:
        print("(nothing)")
        return
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument(
        "--context", type=int, default=None, help="mean context length (default 1024)"
    )
    parser.add_argument(
        "--no-engine", action="store_true", help="skip the end-to-end engine section"
    )
    parser.add_argument("--iters", type=int, default=20, help="timed calls per figure (median)")
    parser.add_argument(
        "--json", type=Path, default=None, help="default: $OUT/kernel_decode.json if $OUT is set"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    batches = [1, 4] if args.quick else [1, 8, 32, 128]
    context = args.context or (128 if args.quick else 1024)
    iters = max(1, args.iters)

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "triton_kernels": use_triton(device),
        "peak_gbps_assumed": _peak_gbps(device),
    }
    if use_triton(device):
        import triton

        report["triton"] = triton.__version__
    print(
        f"kernel_decode on {report['device']} ({args.dtype}); Triton kernels: {report['triton_kernels']}"
    )
    t0 = time.perf_counter()
    report["paged_attention"] = bench_paged_attention(device, batches, context, dtype, iters)
    _print_table(
        f"paged attention decode, mean context {context}, block 16", report["paged_attention"]
    )
    report["ops"] = bench_ops(device, args.quick, dtype, iters)
    _print_table("other kernels", report["ops"])
    if not args.no_engine:
        report["engine"] = bench_engine(
            device, [1, 4] if args.quick else [1, 16, 64], 8 if args.quick else 64, args.quick
        )
        engine = report["engine"]
        print(f"\n== core engine end to end: {engine.get('model', '')}")
        _print_table("aggregate output tok/s (short prompts, greedy)", engine.get("runs", []))
        for key in ("skipped", "error"):
            if key in engine:
                print(f"{key}: {engine[key]}")
    report["elapsed_s"] = time.perf_counter() - t0
    out_path = args.json or (
        Path(os.environ["OUT"]) / "kernel_decode.json" if os.environ.get("OUT") else None
    )
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {out_path}")
    # An engine section that was asked for and did not run is a failed check, not a pass.
    engine = report.get("engine", {})
    return 3 if "skipped" in engine or "error" in engine else 0


if __name__ == "__main__":
    raise SystemExit(main())

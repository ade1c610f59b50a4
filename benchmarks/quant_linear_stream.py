"""The block kernel (``core_engine/kernels/cpu/quant_linear.cpp``) streaming a decode step's
weights from memory: SmolLM2-135M's product shapes (30 layers x qkv/o/gate_up/down + the LM
head), ``--copies`` distinct copies so the working set is larger than the caches, timed per
step at each row count. Prints ms per step, GB/s of weights read and the products-only tok/s,
next to this machine's read bandwidth (``infermux plan``'s probe), and writes JSON.

    PYTHONPATH=. .venv/bin/python benchmarks/quant_linear_stream.py --rows 1 2 4 16 --copies 4
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from core_engine.kernels.cpu import cpu_extension
from core_engine.plan.probe import measure_bandwidth, random_block_weight

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]  # (K, N)


def weights(fmt: str, copies: int) -> tuple[list[tuple[torch.Tensor, int, int]], int]:
    """The step's weights packed for the kernel, as (packed, K, N), and the bytes it reads."""
    gen = torch.Generator().manual_seed(0)
    kernel = cpu_extension("quant_linear")
    out, total = [], 0
    for K, N in SHAPES * copies:
        weight = random_block_weight(fmt, N, K, gen)
        out.append((kernel.quant_pack(*weight), K, N))
        total += out[-1][0].numel()
    return out, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16])
    parser.add_argument("--formats", nargs="+", default=["int4", "int8"], choices=["int4", "int8"])
    parser.add_argument("--copies", type=int, default=4, help="distinct copies of the step's weights")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu_extension("quant_linear")
    print(f"kernel isa {kernel.isa()}; measuring read bandwidth...", flush=True)
    bandwidth = measure_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    results = []
    for fmt in args.formats:
        ws, total = weights(fmt, args.copies)
        for rows in args.rows:
            x = {K: torch.randn(rows, K) for K, _ in SHAPES}
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                for packed, K, N in ws:
                    kernel.quant_linear(x[K], packed, N)
                best = min(best, (time.perf_counter() - started) / args.copies)
            row = {"format": fmt, "rows": rows, "ms_per_step": best * 1e3, "gb_per_s": total / args.copies / best / 1e9,
                   "tok_per_s_products_only": rows / best, "fraction_of_bandwidth": total / args.copies / best / bandwidth}
            results.append(row)
            print(f"{fmt} rows={rows:3d}: {row['ms_per_step']:7.2f} ms/step  {row['gb_per_s']:5.1f} GB/s "
                  f"({row['fraction_of_bandwidth']:.2f} of bandwidth)  {row['tok_per_s_products_only']:6.0f} tok/s products only",
                  flush=True)
    args.output.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.output / f"quant_linear_stream-{stamp}.json"
    path.write_text(json.dumps({"isa": kernel.isa(), "threads": args.threads, "copies": args.copies,
                                "bandwidth_gb_s": bandwidth / 1e9, "results": results}, indent=2))
    plot(results, bandwidth, path.with_suffix(".png"))
    print(f"wrote {path} and .png")


def plot(results: list[dict[str, float | str | int]], bandwidth: float, path: Path) -> None:
    """GB/s of weights read per row count and format, against the measured read bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for fmt in sorted({str(r["format"]) for r in results}):
        rows = [r for r in results if r["format"] == fmt]
        ax.plot([r["rows"] for r in rows], [r["gb_per_s"] for r in rows], marker="o", label=fmt)
    ax.axhline(bandwidth / 1e9, linestyle="--", color="grey", label="read bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("activation rows per call")
    ax.set_ylabel("weights read, GB/s")
    ax.set_title("quant_linear: a decode step's products from memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

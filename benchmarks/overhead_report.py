"""Printing and plotting the gateway-overhead results (see gateway_overhead.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot", "print_table"]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels: list[str] = []
    series: dict[str, list[float]] = {"infermux": [], "litellm": []}
    for scenario, summary in results.items():
        for key in ("p50", "p99", "per_chunk"):
            if key not in summary["added_ms"].get("infermux", {}):
                continue
            labels.append(f"{scenario}\n{key}")
            for target in series:
                series[target].append(summary["added_ms"].get(target, {}).get(key, float("nan")))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(labels)), 4))
    width = 0.38
    xs = range(len(labels))
    ax.bar([x - width / 2 for x in xs], series["infermux"], width, label="infermux")
    if any(v == v for v in series["litellm"]):  # not all NaN
        ax.bar([x + width / 2 for x in xs], series["litellm"], width, label="LiteLLM proxy")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("added latency vs direct (ms)")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_title("Gateway overhead (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(results: dict[str, Any], ratios: dict[str, float | None]) -> None:
    print()
    print(
        f"{'scenario':<22}{'target':<16}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>9}{'+p99 ms':>9}"
        f"{'+/chunk ms':>11}{'CPU us/req':>11}"
    )
    for scenario, summary in results.items():
        cpu = summary.get("cpu_us_per_request", {})
        for target, latency in summary["latency_ms"].items():
            added = summary["added_ms"].get(target, {})
            per_chunk = added.get("per_chunk")
            # The gateway process's CPU per request; for "direct", the upstream's.
            used = cpu.get("upstream" if target.startswith("direct") else target)
            print(
                f"{scenario:<22}{target:<16}{latency['p50']:>9.3f}{latency['p99']:>9.3f}"
                f"{added.get('p50', 0.0):>9.3f}{added.get('p99', 0.0):>9.3f}"
                f"{per_chunk if per_chunk is not None else float('nan'):>11.4f}"
                f"{used if used is not None else float('nan'):>11.0f}"
            )
    if ratios:
        print("\ninfermux added latency as a fraction of LiteLLM's (lower is better):")
        for key, value in ratios.items():
            print(f"  {key:<28} {'n/a' if value is None else f'{value:.3f}'}")
    seq = results.get("sequential", {}).get("added_ms", {}).get("infermux")
    if seq:
        ok = seq["p50"] <= 1.0 and seq["p99"] <= 5.0
        print(
            f"\ntarget (sequential, non-streaming): added p50 <= 1 ms, p99 <= 5 ms -> "
            f"{'met' if ok else 'NOT met'} (p50 {seq['p50']:.3f} ms, p99 {seq['p99']:.3f} ms)"
        )

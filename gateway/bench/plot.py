"""``--plot DIR``: PNG figures of a run, drawn with matplotlib's Agg backend (no display).

- ``latency_cdf.png``: the empirical CDFs of TTFT, TPOT, ITL and E2E, a line per endpoint and
  rate.
- For a sweep over two or more finite rates: ``throughput_vs_rate.png`` (request and output
  token throughput against the offered rate), ``latency_vs_rate.png`` (TTFT and TPOT p50/p99)
  and, when SLOs were given, ``goodput_vs_rate.png``. The ``inf`` rate has no place on a rate
  axis and is left out of these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gateway.bench.report import rate_label
from gateway.bench.runner import BenchResult

__all__ = ["write_plots"]

_LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: works on servers without a display
    import matplotlib.pyplot as plt

    return plt


def write_plots(result: BenchResult, directory: str | Path) -> list[Path]:
    """Write the figures into ``directory`` (created if missing); return their paths."""
    plt = _pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [_latency_cdf(plt, result, directory)]
    finite = [rate for rate in result.config.request_rates if rate is not None]
    if len(finite) >= 2:
        paths.append(_throughput_vs_rate(plt, result, directory, finite))
        paths.append(_latency_vs_rate(plt, result, directory, finite))
        if not result.config.slo.is_empty:
            paths.append(_goodput_vs_rate(plt, result, directory, finite))
    return paths


def _save(plt: Any, figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _latency_cdf(plt: Any, result: BenchResult, directory: Path) -> Path:
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, (field, title) in zip(axes.flat, _LATENCIES, strict=True):
        for run in result.runs:
            done = [r for r in run.records if r.ok]
            if field == "itl_ms":
                values = [gap for r in done for gap in r.itl_ms]
            else:
                values = [getattr(r, field) for r in done if getattr(r, field) is not None]
            if not values:
                continue
            xs = np.sort(np.asarray(values))
            ys = np.arange(1, len(xs) + 1) / len(xs)
            axis.step(
                xs, ys, where="post", label=f"{run.target} · rate {rate_label(run.request_rate)}"
            )
        axis.set_title(f"{title} CDF")
        axis.set_xlabel(f"{title} (ms)")
        axis.set_ylabel("fraction of " + ("gaps" if field == "itl_ms" else "requests"))
        axis.set_ylim(0, 1.02)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    figure.suptitle(_title(result))
    return _save(plt, figure, directory / "latency_cdf.png")


def _title(result: BenchResult) -> str:
    models = " vs ".join(
        f"{t.label}: {result.runs[i].model}" for i, t in enumerate(result.config.targets)
    )
    return f"infermux bench · {result.config.workload.name} · {models}"


def _series(result: BenchResult, label: str, rates: list[float], getter: Any) -> list[float]:
    return [
        value if (value := getter(result.run_for(label, rate).summary)) is not None else np.nan
        for rate in rates
    ]


def _throughput_vs_rate(plt: Any, result: BenchResult, directory: Path, rates: list[float]) -> Path:
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for target in result.config.targets:
        label = target.label
        left.plot(
            rates,
            _series(result, label, rates, lambda s: s.request_throughput),
            marker="o",
            label=label,
        )
        right.plot(
            rates,
            _series(result, label, rates, lambda s: s.output_throughput),
            marker="o",
            label=label,
        )
    left.plot(rates, rates, linestyle=":", color="grey", label="offered")
    left.set_ylabel("completed requests / s")
    right.set_ylabel("output tokens / s")
    for axis in (left, right):
        axis.set_xlabel("offered request rate (req/s)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(_title(result))
    return _save(plt, figure, directory / "throughput_vs_rate.png")


def _latency_vs_rate(plt: Any, result: BenchResult, directory: Path, rates: list[float]) -> Path:
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for number, target in enumerate(result.config.targets):
        label = target.label
        color = f"C{number}"  # one colour per endpoint; the line style tells the percentile
        for name, style in (("p50", "-"), ("p99", "--")):
            left.plot(
                rates,
                _series(result, label, rates, lambda s, n=name: getattr(s.ttft_ms, n)),
                style,
                color=color,
                marker="o",
                label=f"{label} {name}",
            )
            right.plot(
                rates,
                _series(result, label, rates, lambda s, n=name: getattr(s.tpot_ms, n)),
                style,
                color=color,
                marker="o",
                label=f"{label} {name}",
            )
    left.set_ylabel("TTFT (ms)")
    right.set_ylabel("TPOT (ms)")
    for axis in (left, right):
        axis.set_xlabel("offered request rate (req/s)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(_title(result))
    return _save(plt, figure, directory / "latency_vs_rate.png")


def _goodput_vs_rate(plt: Any, result: BenchResult, directory: Path, rates: list[float]) -> Path:
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for number, target in enumerate(result.config.targets):
        label = target.label
        axis.plot(
            rates,
            _series(result, label, rates, lambda s: s.goodput),
            color=f"C{number}",
            marker="o",
            label=f"{label} goodput",
        )
        axis.plot(
            rates,
            _series(result, label, rates, lambda s: s.request_throughput),
            color=f"C{number}",
            linestyle="--",
            label=f"{label} throughput",
        )
    axis.set_xlabel("offered request rate (req/s)")
    axis.set_ylabel("requests / s")
    axis.set_title(f"goodput under {result.config.slo.describe()}")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return _save(plt, figure, directory / "goodput_vs_rate.png")

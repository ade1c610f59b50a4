"""The end-of-run table and the ``--json`` file.

In a comparison the table has one column per endpoint and a last column with the ratio
B/A (B's figure divided by A's): above 1 means B is higher — slower for a latency, faster for
a throughput.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec

from gateway.bench.config import Target
from gateway.bench.metrics import RunSummary, Stats
from gateway.bench.runner import BenchResult, RunResult

__all__ = ["format_report", "rate_label", "redacted", "write_json"]

_SECRET_HEADER_WORDS = ("auth", "key", "token", "secret", "cookie")


def rate_label(rate: float | None) -> str:
    return "inf" if rate is None else f"{rate:g}"


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{b / a:.2f}"


_Row = tuple[str, Callable[[RunSummary], float | None], Callable[[float | None], str]]


def _latency_rows(title: str, field: str) -> list[_Row]:
    def getter(name: str) -> Callable[[RunSummary], float | None]:
        return lambda s: getattr(getattr(s, field), name)

    return [
        (f"{title} {name} (ms)", getter(name), lambda v: _number(v, 1))
        for name in ("mean", "p50", "p90", "p95", "p99")
    ]


def _rows(result: BenchResult) -> list[_Row]:
    rows: list[_Row] = [
        ("successful requests", lambda s: s.num_completed, lambda v: _number(v, 0)),
        ("failed requests", lambda s: s.num_failed, lambda v: _number(v, 0)),
        ("duration (s)", lambda s: s.duration_s, _number),
        ("request throughput (req/s)", lambda s: s.request_throughput, _number),
        ("output throughput (tok/s)", lambda s: s.output_throughput, _number),
        ("total token throughput (tok/s)", lambda s: s.total_token_throughput, _number),
        # Estimated (workload length + template overhead) for streams without usage.
        ("mean prompt tokens", lambda s: s.mean_prompt_tokens, lambda v: _number(v, 1)),
        ("mean output tokens", lambda s: s.mean_output_tokens, lambda v: _number(v, 1)),
    ]
    rows += _latency_rows("TTFT", "ttft_ms")
    rows += _latency_rows("TPOT", "tpot_ms")
    rows += _latency_rows("ITL", "itl_ms")
    rows += _latency_rows("E2E", "e2e_ms")
    if not result.config.slo.is_empty:
        slo = result.config.slo.describe()
        rows.append((f"goodput (req/s) [{slo}]", lambda s: s.goodput, _number))
        rows.append(("SLO attainment (%)", lambda s: s.slo_attainment, _percent))
    rows.append(("prefix-cache hit rate (%)", lambda s: s.cache_hit_rate, _percent))
    # Without usage, token counts are chunk counts and prompt lengths the workload's estimate.
    rows.append(("streams with usage (%)", lambda s: s.usage_reported_fraction, _percent))
    if result.config.prices is not None:
        rows.append(("cost (total)", lambda s: s.cost, lambda v: _number(v, 6)))
        rows.append(("cost per 1k requests", lambda s: s.cost_per_1k_requests, _number))
    return rows


def _table(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for line in lines:
        cells = [line[0].ljust(widths[0])] + [
            cell.rjust(width) for cell, width in zip(line[1:], widths[1:], strict=True)
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def _describe_target(target: Target, run: RunResult) -> str:
    headers = ", ".join(f"{k}: {v}" for k, v in redacted(target).headers.items())
    return f"{target.label} = {run.model} at {run.url}" + (f" [{headers}]" if headers else "")


def format_report(result: BenchResult) -> str:
    """The human-readable report printed at the end of a run."""
    config = result.config
    spec = config.workload
    labels = [t.label for t in config.targets]
    cal = result.calibration
    lines = [
        f"infermux bench · workload {spec.name} · {config.endpoint} endpoint · seed {config.seed}",
        f"tokens per word {cal.tokens_per_word:.3f} ({cal.source}"
        + (f"; template overhead {cal.overhead_tokens:.0f} tokens" if cal.overhead_tokens else "")
        + (f"; {cal.note}" if cal.note else "")
        + ")",
        f"concurrency {config.concurrency or 'unlimited'} · burstiness {config.burstiness:g}"
        + (f" · compare mode {config.compare_mode}" if len(labels) > 1 else ""),
    ]
    for target in config.targets:
        lines.append(
            _describe_target(target, result.run_for(target.label, config.request_rates[0]))
        )
    if len(labels) > 1:
        lines.append(
            "ratio column: B/A (above 1: B higher; slower for latencies, faster for throughput)"
        )
    for rate in config.request_rates:
        runs = [result.run_for(label, rate) for label in labels]
        header = ["metric", *labels] + (["B/A"] if len(labels) > 1 else [])
        table = [header]
        for title, get, fmt in _rows(result):
            values = [get(run.summary) for run in runs]
            line = [title, *(fmt(v) for v in values)]
            if len(values) > 1:
                line.append(_ratio(values[0], values[1]))
            table.append(line)
        lines += [
            "",
            f"== request rate {rate_label(rate)} req/s · {len(runs[0].records)} requests per endpoint ==",
        ]
        lines.append(_table(table))
        for run in runs:
            for message, count in run.summary.errors.items():
                lines.append(f"  {run.target}: {count} x {message}")
    if len(config.request_rates) > 1:
        lines += ["", "== sweep ==", _table(_sweep_table(result, labels))]
    return "\n".join(lines)


def _sweep_table(result: BenchResult, labels: list[str]) -> list[list[str]]:
    with_slo = not result.config.slo.is_empty
    table = [
        ["rate (req/s)", "endpoint", "req/s", "out tok/s"]
        + (["goodput"] if with_slo else [])
        + ["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    ]

    def ms(stats: Stats, name: str) -> str:
        return _number(getattr(stats, name), 1)

    for rate in result.config.request_rates:
        for label in labels:
            s = result.run_for(label, rate).summary
            table.append(
                [
                    rate_label(rate),
                    label,
                    _number(s.request_throughput),
                    _number(s.output_throughput),
                ]
                + ([_number(s.goodput)] if with_slo else [])
                + [
                    ms(s.ttft_ms, "p50"),
                    ms(s.ttft_ms, "p99"),
                    ms(s.tpot_ms, "p50"),
                    ms(s.tpot_ms, "p99"),
                ]
            )
    return table


def redacted(target: Target) -> Target:
    """``target`` without its API key or secret-looking header values."""
    headers = {
        key: ("***" if any(word in key.lower() for word in _SECRET_HEADER_WORDS) else value)
        for key, value in target.headers.items()
    }
    return msgspec.structs.replace(
        target, api_key="***" if target.api_key else None, headers=headers
    )


def write_json(result: BenchResult, path: str | Path) -> Path:
    """Write the whole result (config, calibration, summaries, every record) as JSON."""
    config = msgspec.structs.replace(
        result.config, targets=[redacted(t) for t in result.config.targets]
    )
    safe = msgspec.structs.replace(result, config=config)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(safe), indent=1) + b"\n")
    return path

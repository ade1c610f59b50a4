"""The serving benchmark behind ``infermux bench``, usable as a library::

    from gateway.bench import BenchConfig, Target, WorkloadSpec, format_report, run_benchmark

    config = BenchConfig(
        targets=[Target(label="A", url="http://127.0.0.1:8000")],
        workload=WorkloadSpec(name="fixed", num_requests=50),
        concurrency=4,
    )
    result = await run_benchmark(config)
    print(format_report(result))

Names are imported on first use, so that ``infermux --help`` (which imports
:mod:`gateway.bench.cli`) does not load httpx, numpy or tqdm.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.bench.config import (
        BenchConfig,
        Prices,
        Slo,
        Target,
        parse_prices,
        parse_slo,
    )
    from gateway.bench.errors import BenchConfigError, BenchError
    from gateway.bench.metrics import RunSummary, Stats
    from gateway.bench.record import RequestRecord
    from gateway.bench.report import format_report, write_json
    from gateway.bench.runner import BenchResult, Calibration, RunResult, run_benchmark
    from gateway.bench.workload import BenchPrompt, WorkloadSpec, build_workload

_EXPORTS = {
    "BenchConfig": "config",
    "BenchConfigError": "errors",
    "BenchError": "errors",
    "BenchPrompt": "workload",
    "BenchResult": "runner",
    "Calibration": "runner",
    "Prices": "config",
    "RequestRecord": "client",
    "RunResult": "runner",
    "RunSummary": "metrics",
    "Slo": "config",
    "Stats": "metrics",
    "Target": "config",
    "WorkloadSpec": "workload",
    "build_workload": "workload",
    "format_report": "report",
    "parse_prices": "config",
    "parse_slo": "config",
    "run_benchmark": "runner",
    "write_json": "report",
}

__all__ = [
    "BenchConfig",
    "BenchConfigError",
    "BenchError",
    "BenchPrompt",
    "BenchResult",
    "Calibration",
    "Prices",
    "RequestRecord",
    "RunResult",
    "RunSummary",
    "Slo",
    "Stats",
    "Target",
    "WorkloadSpec",
    "build_workload",
    "format_report",
    "parse_prices",
    "parse_slo",
    "run_benchmark",
    "write_json",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gateway.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gateway.bench.{module}"), name)

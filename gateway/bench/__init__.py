"""The serving benchmark behind ``infermux bench``, usable as a library.

config = BenchConfig(targets=[Target(label="A", url="http://127.0.0.1:8000")],
                     workload=WorkloadSpec(name="fixed", num_requests=50))
result = await run_benchmark(config)
print(format_report(result))
"""

from __future__ import annotations

from gateway.bench.client import RequestRecord, Target
from gateway.bench.config import BenchConfig
from gateway.bench.errors import BenchConfigError, BenchError
from gateway.bench.metrics import Prices, RunSummary, Slo, Stats, parse_prices, parse_slo
from gateway.bench.report import format_report, write_json
from gateway.bench.runner import BenchResult, Calibration, RunResult, run_benchmark
from gateway.bench.workload import BenchPrompt, WorkloadSpec, build_workload

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

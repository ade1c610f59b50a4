"""Helpers of the telemetry and accounting tests (fixtures: tests/telemetry/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from backends.base import Backend, BackendConfig
from gateway.config.load import config_from_dict
from gateway.config.types import InfermuxConfig
from gateway.testing import LiveGateway, run_gateway
from plugins.builtin.metrics import MetricsPlugin
from plugins.builtin.tracing import TracingPlugin
from plugins.manager import create_plugin_manager


def make_config(
    *backends: BackendConfig,
    models: dict[str, list[str]] | None = None,
    max_retries: int = 2,
    resume_on_failure: bool = False,
    **sections: Any,
) -> InfermuxConfig:
    """A validated config: backends, models (default: alias "echo" on all), extra sections
    (``cost={...}``, ``telemetry={...}``, ``auth={...}``) as plain TOML-like dicts."""
    if models is None:
        models = {"echo": [b.name for b in backends]}
    raw: dict[str, Any] = {
        "backends": [msgspec.to_builtins(b) for b in backends],
        "models": [
            {
                "alias": alias,
                "backends": names,
                "max_retries": max_retries,
                "resume_on_failure": resume_on_failure,
            }
            for alias, names in models.items()
        ],
        **sections,
    }
    return config_from_dict(raw)


def mock(name: str = "mock", **options: Any) -> BackendConfig:
    return BackendConfig(name=name, kind="mock", options=options)


def remote(name: str, base_url: str, **settings: Any) -> BackendConfig:
    return BackendConfig(name=name, kind="openai", options={"base_url": base_url}, **settings)


class Telemetry:
    """In-memory span exporter and metric reader shared by one test's gateways."""

    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.metric_reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.metric_reader])

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def trace_of(self, request_id: str) -> list[ReadableSpan]:
        """Every span of the trace whose request span has this ``infermux.request_id``."""
        spans = self.finished()
        root = next(
            s for s in spans if (s.attributes or {}).get("infermux.request_id") == request_id
        )
        assert root.context is not None
        return [s for s in spans if s.context and s.context.trace_id == root.context.trace_id]

    def metric_points(self, name: str) -> list[Any]:
        data = self.metric_reader.get_metrics_data()
        points: list[Any] = []
        if data is None:
            return points
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        points.extend(metric.data.data_points)
        return points


@contextmanager
def telemetry_gateway_for(
    telemetry: Telemetry,
    tmp_path: Path,
    config: InfermuxConfig,
    *,
    backends: dict[str, Backend] | None = None,
    **kwargs: Any,
) -> Iterator[LiveGateway]:
    """A live gateway whose tracing and metrics plugins export to ``telemetry``; its ledger
    is ``tmp_path / "ledger.sqlite3"`` unless the config names one."""
    if config.cost.ledger_path is None:
        config = msgspec.structs.replace(
            config,
            cost=msgspec.structs.replace(config.cost, ledger_path=str(tmp_path / "ledger.sqlite3")),
        )
    pm = create_plugin_manager(config=config.plugins, load_entry_points=False)
    for name, plugin in (
        ("builtin.tracing", TracingPlugin(tracer_provider=telemetry.tracer_provider)),
        ("builtin.metrics", MetricsPlugin(meter_provider=telemetry.meter_provider)),
    ):
        pm.unregister(name=name)
        pm.register(plugin, name=name)
    with run_gateway(config, plugin_manager=pm, backends=backends, **kwargs) as gateway:
        yield gateway

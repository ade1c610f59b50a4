"""OpenTelemetry SDK set-up from the standard ``OTEL_*`` environment variables.

Shared by the built-in tracing and metrics plugins. Each app gets its own providers (never
the process-global ones: several apps may run in one process). Exporters speak OTLP/HTTP
protobuf; the batch span processor has a bounded queue and exports from its own thread, so
an unreachable collector costs dropped spans, never a slower request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

__all__ = [
    "build_meter_provider",
    "build_tracer_provider",
    "metrics_export_wanted",
    "shutdown_quietly",
    "tracing_wanted",
]

logger = logging.getLogger("plugins.telemetry")

_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _exporters(env: Mapping[str, str], name: str) -> list[str]:
    raw = env.get(name)
    if raw is None:
        return []
    return [part.strip().lower() for part in raw.split(",") if part.strip()]


def _wanted(
    forced: bool | None, env: Mapping[str, str], exporter_var: str, endpoint_var: str
) -> bool:
    if forced is not None:
        return forced and not _truthy(env.get("OTEL_SDK_DISABLED"))
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return False
    exporters = _exporters(env, exporter_var)
    if exporters == ["none"]:
        return False
    if any(e in ("otlp", "console") for e in exporters):
        return True
    return bool(env.get(_ENDPOINT) or env.get(endpoint_var))


def tracing_wanted(enabled: bool | None, env: Mapping[str, str]) -> bool:
    """Config ``enabled`` if set, else whether ``OTEL_*`` asks for trace export."""
    return _wanted(enabled, env, "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def metrics_export_wanted(otel_export: bool | None, env: Mapping[str, str]) -> bool:
    """Config ``otel_export`` if set, else whether ``OTEL_*`` asks for metric export."""
    return _wanted(otel_export, env, "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")


def _resource(service_name: str, env: Mapping[str, str]) -> Resource:
    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource

    try:
        service_version = version("infermux")
    except PackageNotFoundError:
        service_version = "0.0.0"
    # Resource.create also merges OTEL_RESOURCE_ATTRIBUTES; OTEL_SERVICE_NAME wins over config.
    return Resource.create(
        {
            SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service_name,
            SERVICE_VERSION: service_version,
        }
    )


def _check_protocol(env: Mapping[str, str], signal: str) -> None:
    protocol = env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    if protocol and protocol != "http/protobuf":
        logger.warning(
            "OTEL_EXPORTER_OTLP_PROTOCOL=%s is not supported; infermux exports OTLP over "
            "http/protobuf (port 4318 on most collectors)",
            protocol,
        )


def build_tracer_provider(
    service_name: str, env: Mapping[str, str], *, max_queue_size: int | None = None
) -> TracerProvider:
    """A provider exporting through ``OTEL_TRACES_EXPORTER`` (default otlp) in batches."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=_resource(service_name, env))
    exporters = _exporters(env, "OTEL_TRACES_EXPORTER") or ["otlp"]
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            _check_protocol(env, "TRACES")
            exporter = OTLPSpanExporter()
        elif name == "console":
            exporter = ConsoleSpanExporter()  # type: ignore[assignment]
        else:
            if name != "none":
                logger.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console)", name)
            continue
        # The SDK reads OTEL_BSP_* for whatever is not given here; the queue is bounded
        # and full means dropped spans, never a blocked request.
        provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=max_queue_size))
    return provider


def build_meter_provider(service_name: str, env: Mapping[str, str]) -> MeterProvider:
    """A provider exporting through ``OTEL_METRICS_EXPORTER`` (default otlp) periodically."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        MetricReader,
        PeriodicExportingMetricReader,
    )

    readers: list[MetricReader] = []
    for name in _exporters(env, "OTEL_METRICS_EXPORTER") or ["otlp"]:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )

            _check_protocol(env, "METRICS")
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        elif name == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        elif name != "none":
            logger.warning("OTEL_METRICS_EXPORTER=%s is not supported (otlp, console)", name)
    return MeterProvider(resource=_resource(service_name, env), metric_readers=readers)


def shutdown_quietly(shutdown: Callable[[], object], what: str, timeout_s: float = 3.0) -> None:
    """Run a provider's ``shutdown`` (a last export) in a thread, waiting at most
    ``timeout_s``: an unreachable collector must not hold the gateway's exit."""

    def run() -> None:
        try:
            shutdown()
        except Exception:
            logger.exception("shutting down the %s failed", what)

    thread = threading.Thread(target=run, name=f"infermux-{what}-shutdown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning(
            "the %s did not flush within %.0f s; remaining data dropped", what, timeout_s
        )

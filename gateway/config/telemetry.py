"""``[telemetry]``: traces, metrics, SLOs.

Part of :class:`gateway.config.types.InfermuxConfig` (in its own module: these tables are
read by the observability plugins, not by the gateway); ``[cost]``'s structs live with their
plugin (:mod:`plugins.builtin.cost.config`) and are cross-checked in
:mod:`gateway.config.validate`.
docs/observability.md explains every key; the standard ``OTEL_*`` environment variables and
``INFERMUX_LEDGER_PATH`` are read by the plugins.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = [
    "MetricsConfig",
    "SloConfig",
    "TelemetryConfig",
    "TracingConfig",
]


class TracingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[telemetry.tracing]``: OpenTelemetry traces (OTLP/HTTP protobuf)."""

    #: None: on when the environment asks for it (``OTEL_EXPORTER_OTLP_ENDPOINT``,
    #: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, or ``OTEL_TRACES_EXPORTER=otlp|console``);
    #: True / False force it on / off. ``OTEL_SDK_DISABLED=true`` always turns it off.
    enabled: bool | None = None
    #: Put prompts and outputs on spans (``gen_ai.input.messages``,
    #: ``gen_ai.output.messages``). Off by default: message content is never recorded.
    record_content: bool = False
    #: Ended spans waiting for export; when full, new spans are dropped (a request never
    #: waits for the collector). None: ``OTEL_BSP_MAX_QUEUE_SIZE``, else 2048.
    max_queue_size: Annotated[int, msgspec.Meta(ge=1)] | None = None


class MetricsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[telemetry.metrics]``: what ``GET /metrics`` shows (always on; ``[server]
    metrics_token_sha256`` may require a token), and the OTel export."""

    #: None: export OTel metrics when ``OTEL_METRICS_EXPORTER=otlp|console``, or when an
    #: OTLP endpoint is set and ``OTEL_METRICS_EXPORTER`` is not ``none``. True / False force.
    otel_export: bool | None = None
    #: Label the series that follow one client (``infermux_cost_total``) by API key id and
    #: tenant. Off: by model only, so that a scrape says nothing about who spends what.
    tenant_labels: bool = False
    #: Also show the request, token, latency and KV-cache series under vLLM's ``vllm:*``
    #: names and ``model_name`` label, for dashboards, KEDA rules and endpoint pickers
    #: written for vLLM (plugins/builtin/vllm_metric_names.py).
    vllm_names: bool = False


class SloConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[telemetry.slo]``: a request counts towards goodput when it meets every set SLO."""

    #: Time to first token, in milliseconds (None: not checked).
    ttft_ms: Annotated[float, msgspec.Meta(gt=0)] | None = None
    #: Mean time per output token after the first, in milliseconds (None: not checked).
    tpot_ms: Annotated[float, msgspec.Meta(gt=0)] | None = None


class TelemetryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[telemetry]``."""

    #: ``service.name`` of traces and OTel metrics (``OTEL_SERVICE_NAME`` wins).
    service_name: str = "infermux"
    tracing: TracingConfig = TracingConfig()
    metrics: MetricsConfig = MetricsConfig()
    slo: SloConfig = SloConfig()

"""``[telemetry]`` and ``[cost]``: traces, metrics, SLOs, prices, the ledger and budgets.

Part of :class:`gateway.config.InfermuxConfig` (kept in its own module so that the routing
config module stays small). docs/observability.md explains every key; the standard
``OTEL_*`` environment variables and ``INFERMUX_LEDGER_PATH`` are read by the plugins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

if TYPE_CHECKING:
    from gateway.config import InfermuxConfig

__all__ = [
    "BudgetConfig",
    "CostConfig",
    "MetricsConfig",
    "PriceConfig",
    "SloConfig",
    "TelemetryConfig",
    "TracingConfig",
    "validate_observability",
]

_NonNegative = Annotated[float, msgspec.Meta(ge=0)]


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
    """``[telemetry.metrics]``: ``GET /metrics`` is always on; this is the OTel export."""

    #: None: export OTel metrics when ``OTEL_METRICS_EXPORTER=otlp|console``, or when an
    #: OTLP endpoint is set and ``OTEL_METRICS_EXPORTER`` is not ``none``. True / False force.
    otel_export: bool | None = None


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


class PriceConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One ``[[cost.prices]]`` rule. The most specific rule wins: model and backend, then
    backend, then model. Token prices are per million tokens; ``per_hour`` is the price
    of running a backend for an hour, shared among the requests it serves (see
    docs/observability.md for the allocation rule)."""

    #: A model alias of ``[[models]]`` (None: any).
    model: str | None = None
    #: A backend name of ``[[backends]]`` (None: any). Required with ``per_hour``.
    backend: str | None = None
    input_per_mtok: _NonNegative = 0.0
    #: Prompt tokens served from a prefix cache (None: the ``input_per_mtok`` price).
    cached_input_per_mtok: _NonNegative | None = None
    output_per_mtok: _NonNegative = 0.0
    per_hour: _NonNegative | None = None


class BudgetConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One ``[[cost.budgets]]``: once ``limit`` is spent in the period, requests get 429."""

    #: The API key id (``[[auth.keys]] id``) or the tenant this budget is for (exactly one).
    api_key: str | None = None
    tenant: str | None = None
    #: In ``[cost] currency``.
    limit: _NonNegative
    #: "total" (ever), "day" or "month" (UTC calendar periods).
    period: Literal["total", "day", "month"] = "month"


class CostConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[cost]``: prices, the usage ledger and budgets."""

    #: Write one usage record per request that reached a backend.
    enabled: bool = True
    #: SQLite file (WAL mode). None: ``$INFERMUX_LEDGER_PATH``, else ``var/ledger.sqlite3``
    #: (relative paths are relative to the working directory).
    ledger_path: str | None = None
    #: A ``postgresql://`` URL: the ledger on Postgres instead of SQLite, shared by replicas
    #: (docs/scale-out.md). Keep the password out of it: libpq reads ``PGPASSWORD`` (or
    #: ``PGPASSFILE``) from the environment.
    database: str | None = None
    #: "normal": a record survives a crash of the gateway (kill -9, OOM) once its response
    #: completed, and a commit costs tens of microseconds; "full": it also survives a power
    #: cut or a kernel crash, for one fsync per group commit (milliseconds on many disks).
    synchronous: Literal["full", "normal"] = "normal"
    currency: str = "USD"
    prices: list[PriceConfig] = []
    budgets: list[BudgetConfig] = []


def validate_observability(config: InfermuxConfig, fail: Callable[[str, str], Exception]) -> None:
    """Cross-checks the decoder cannot do; ``fail(key, reason)`` builds the ConfigError."""
    backends = {b.name for b in config.backends}
    aliases = {m.alias for m in config.models}
    seen: dict[tuple[str | None, str | None], int] = {}
    for i, price in enumerate(config.cost.prices):
        key = f"cost.prices[{i}]"
        if price.model is None and price.backend is None:
            raise fail(key, "name a model, a backend or both")
        if price.model is not None and price.model not in aliases:
            raise fail(f"{key}.model", f"unknown model alias {price.model!r}")
        if price.backend is not None and price.backend not in backends:
            raise fail(f"{key}.backend", f"unknown backend {price.backend!r}")
        if price.per_hour is not None and price.backend is None:
            raise fail(f"{key}.per_hour", "a price per hour needs a backend")
        pair = (price.model, price.backend)
        if pair in seen:
            raise fail(key, f"the same model/backend as cost.prices[{seen[pair]}]")
        seen[pair] = i
    database = config.cost.database
    if database is not None and not database.startswith(("postgresql://", "postgres://")):
        raise fail("cost.database", "expected a postgresql:// URL (SQLite: ledger_path)")
    key_ids = {k.id for k in getattr(getattr(config, "auth", None), "keys", [])}
    for i, budget in enumerate(config.cost.budgets):
        key = f"cost.budgets[{i}]"
        if (budget.api_key is None) == (budget.tenant is None):
            raise fail(key, "name exactly one of api_key or tenant")
        if budget.api_key is not None and key_ids and budget.api_key not in key_ids:
            raise fail(f"{key}.api_key", f"no [[auth.keys]] has the id {budget.api_key!r}")
    if not config.cost.currency.strip():
        raise fail("cost.currency", "must not be empty")

"""The built-in metrics plugin (``builtin.metrics``): Prometheus at ``GET /metrics``, and
the same measurements as OpenTelemetry GenAI metrics when OTel metric export is configured.

Prometheus (the app's own registry; every name starts with ``infermux_``):

=========================================  =========  =====================================
name                                       type       labels
=========================================  =========  =====================================
requests_total                             counter    model, backend, status (ok | code)
request_duration_seconds                   histogram  model, backend, status
time_to_first_token_seconds                histogram  model, backend
time_per_output_token_seconds              histogram  model, backend
inter_token_latency_seconds                histogram  model, backend
queue_time_seconds / prefill_time_seconds  histogram  model, backend (engine phases)
/ decode_time_seconds
prompt_tokens_total, completion_tokens_    counter    model, backend
total, cached_prompt_tokens_total
requests_running, requests_waiting         gauge      model (in the gateway: streaming /
                                                      waiting for a first chunk)
goodput_requests_total                     counter    model (ok and within [telemetry.slo])
backend_requests_running / _waiting,       gauge      backend (from a backend's optional
backend_kv_cache_usage_ratio,                         ``stats()``: the core engine)
backend_prefix_cache_hit_rate
backend_spec_decode_num_drafts_total,      counter    backend (speculative decoding:
_num_draft_tokens_total,                              proposals, proposed and accepted
_num_accepted_tokens_total,                           tokens, n-gram lookup time)
_ngram_seconds_total
backend_kv_tier_blocks, _kv_tier_hit_rate  gauge      backend, tier (KV tiers: device,
backend_kv_tier_hit_tokens_total,          counter    host, disk); bytes_moved by
_bytes_moved_total, _restore_seconds_total,           direction (device_to_host,
_restored_blocks_total                                host_to_device, device_to_disk,
                                                      host_to_disk, disk_to_device)
backend_kv_cache_capacity_tokens,          gauge      backend (KV capacity; the disk tier
backend_kv_disk_enabled / _pending_writes             on/off, its write queue)
backend_kv_disk_invalid_blocks_total,      counter    backend (files that failed their
_write_errors_total, _load_seconds_total              checks; failed writes; read time)
cost_total                                 counter    model; + api_key, tenant with
                                                      [telemetry.metrics] tenant_labels
                                                      (builtin.cost)
=========================================  =========  =====================================

With ``[telemetry.metrics] vllm_names = true`` the request, token, latency and KV-cache
series are also shown under vLLM's ``vllm:*`` names (:mod:`plugins.builtin.vllm_metric_names`).

Only configured model aliases become label values (anything else is ``unknown``), so a
client cannot grow the label set. No series here names an API key or a tenant (the scrape
endpoint may be public), and the prefix-cache figures are per backend, never per tenant.
OTel instruments: ``gen_ai.server.request.duration``, ``gen_ai.server.time_to_first_token``,
``gen_ai.server.time_per_output_token``, ``gen_ai.client.token.usage``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from plugins.builtin.genai_names import operation_name, provider_name
from plugins.builtin.metric_series import (
    CounterSeries,
    GaugeSeries,
    HistogramSeries,
    SeriesCollector,
)
from plugins.builtin.otel_env import build_meter_provider, metrics_export_wanted, shutdown_quietly
from plugins.builtin.vllm_metric_names import ENGINE_LABELS, KV_CACHE_USAGE_NAMES, vllm_views
from plugins.hookspecs import hookimpl
from plugins.request_summary import http_request_id

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider

    from backends.base import Backend, GenerationRequest
    from backends.errors import InfermuxError
    from gateway.config.telemetry import SloConfig
    from gateway.config.types import InfermuxConfig
    from plugins.request_summary import RequestSummary

__all__ = ["BackendStatsCollector", "MetricsPlugin", "create_plugin"]

logger = logging.getLogger("plugins.metrics")

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)

#: backend.stats() key -> (metric name, help).
_STATS = {
    "num_running": ("infermux_backend_requests_running", "Requests the engine is running"),
    "num_waiting": ("infermux_backend_requests_waiting", "Requests waiting in the engine queue"),
    "kv_cache_usage": (
        "infermux_backend_kv_cache_usage_ratio",
        "Fraction of the engine's KV-cache blocks in use (0..1)",
    ),
    "prefix_cache_hit_rate": (
        "infermux_backend_prefix_cache_hit_rate",
        "Fraction of prompt tokens served from the engine's prefix cache (0..1)",
    ),
    "worker_up": (
        "infermux_backend_worker_up",
        "1 while the backend's worker process is up, 0 while it is down or restarting",
    ),
    "kv_cache_capacity_tokens": (
        "infermux_backend_kv_cache_capacity_tokens",
        "Tokens the engine's device KV pool holds (blocks x block size; int8 KV doubles it)",
    ),
    "kv_disk_enabled": (
        "infermux_backend_kv_disk_enabled",
        "1 while the KV disk tier is in use, 0 after it turned itself off (full, read-only)",
    ),
    "kv_disk_pending_writes": (
        "infermux_backend_kv_disk_pending_writes",
        "KV blocks queued for the disk writer",
    ),
}
#: backend.stats() key -> (counter name without _total, help).
_COUNTER_STATS = {
    "worker_restarts": (
        "infermux_backend_worker_restarts",
        "Times the backend's worker process was started again after it died",
    ),
    # Speculative decoding, as vLLM's spec_decode series (engines that speculate).
    "spec_decode_num_drafts": (
        "infermux_backend_spec_decode_num_drafts",
        "Proposals verified (each of one or more tokens, scored in one forward)",
    ),
    "spec_decode_num_draft_tokens": (
        "infermux_backend_spec_decode_num_draft_tokens",
        "Tokens proposed by the speculative proposers",
    ),
    "spec_decode_num_accepted_tokens": (
        "infermux_backend_spec_decode_num_accepted_tokens",
        "Proposed tokens the target model accepted",
    ),
    "spec_decode_ngram_seconds": (
        "infermux_backend_spec_decode_ngram_seconds",
        "Time spent in n-gram lookup (seconds)",
    ),
    "kv_disk_invalid_blocks": (
        "infermux_backend_kv_disk_invalid_blocks",
        "KV block files that failed their checks (torn, truncated, foreign) and were recomputed",
    ),
    "kv_disk_write_errors": (
        "infermux_backend_kv_disk_write_errors",
        "KV block writes that failed (the disk tier turns itself off)",
    ),
    # Disaggregated prefill / decode (backends/disaggregated.py).
    "disaggregated_requests": (
        "infermux_backend_disaggregated_requests",
        "Requests served prefill -> decode by a disaggregated backend",
    ),
    "disaggregated_retries": (
        "infermux_backend_disaggregated_retries",
        "Prefill + transfer attempts tried again after a failure (a prefill worker lost, a transfer not arriving)",
    ),
    "disaggregated_fallbacks": (
        "infermux_backend_disaggregated_fallbacks",
        "Requests the decode engine served whole after every attempt failed",
    ),
    "kv_disk_load_seconds": (
        "infermux_backend_kv_disk_load_seconds",
        "Time from asking for KV blocks on disk to having them in memory, summed over blocks",
    ),
}
#: backend.stats() key "<name>:<label value>" -> (name, help, label, kind): KV tier series.
_LABELED_STATS = {
    "kv_tier_blocks": (
        "infermux_backend_kv_tier_blocks",
        "KV blocks held per tier (device: in use or cached; host and disk: cached prefix blocks)",
        "tier",
        "gauge",
    ),
    "kv_hit_rate": (
        "infermux_backend_kv_tier_hit_rate",
        "Fraction of admitted prompt tokens served from each KV tier (0..1)",
        "tier",
        "gauge",
    ),
    "kv_hit_tokens": (
        "infermux_backend_kv_tier_hit_tokens",
        "Prompt tokens served from cached KV blocks, by the tier they came from",
        "tier",
        "counter",
    ),
    "kv_bytes_moved": (
        "infermux_backend_kv_tier_bytes_moved",
        "KV bytes copied between tiers, by direction",
        "direction",
        "counter",
    ),
    "kv_restore_seconds": (
        "infermux_backend_kv_tier_restore_seconds",
        "Time copying KV blocks up into the device pool, by the tier they came from",
        "tier",
        "counter",
    ),
    "kv_restored_blocks": (
        "infermux_backend_kv_tier_restored_blocks",
        "KV blocks copied up into the device pool, by the tier they came from",
        "tier",
        "counter",
    ),
    "kv_transfer_blocks": (
        "infermux_backend_kv_transfer_blocks",
        "Disaggregated serving: KV blocks exported by a prefill engine, and imported by a decode "
        "engine by writing them or found in its prefix cache already",
        "kind",
        "counter",
    ),
}


class BackendStatsCollector(Collector):
    """Reads each backend's optional ``stats() -> dict`` at scrape time (core engine)."""

    def __init__(self, backends: Mapping[str, Backend]) -> None:
        self._backends = backends
        #: backend -> the model aliases it serves, when vLLM's names are on: its KV-cache
        #: usage is also rendered as vLLM's gauges, from the same ``stats()`` reading.
        self.vllm_models: Mapping[str, Sequence[str]] | None = None

    def describe(self) -> list[Any]:
        return []  # names depend on the backends; nothing to reserve

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            key: GaugeMetricFamily(name, doc, labels=["backend"])
            for key, (name, doc) in _STATS.items()
        }
        families |= {
            key: CounterMetricFamily(name, doc, labels=["backend"])
            for key, (name, doc) in _COUNTER_STATS.items()
        }
        labeled: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            key: (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, doc, labels=["backend", label]
            )
            for key, (name, doc, label, kind) in _LABELED_STATS.items()
        }
        vllm_models = self.vllm_models
        vllm_kv = [
            GaugeMetricFamily(
                name, "KV-cache usage. 1 means 100 percent usage.", labels=ENGINE_LABELS
            )
            for name in (KV_CACHE_USAGE_NAMES if vllm_models is not None else ())
        ]
        for name, backend in list(self._backends.items()):
            stats_of = getattr(backend, "stats", None)
            if not callable(stats_of):
                continue
            try:
                stats = stats_of()
            except Exception:
                logger.debug("stats() of backend %r raised", name, exc_info=True)
                continue
            if not isinstance(stats, Mapping):
                continue
            for key, family in families.items():
                value = stats.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    family.add_metric([name], float(value))
                    if key == "kv_cache_usage" and vllm_models is not None:
                        for model in vllm_models.get(name, ()):
                            for kv in vllm_kv:
                                kv.add_metric([model, name], float(value))
            for key, value in stats.items():
                base, sep, label_value = str(key).partition(":")
                series = labeled.get(base) if sep else None
                if series is not None and isinstance(value, int | float) and not isinstance(value, bool):
                    series.add_metric([name, label_value], float(value))
        yield from families.values()
        yield from labeled.values()
        yield from vllm_kv


class _Prometheus:
    """The Prometheus series of one app (see :mod:`plugins.builtin.metric_series`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        mb = ["model", "backend"]
        self.requests = CounterSeries(
            "infermux_requests",
            "Generation requests, by status (ok, or the error code)",
            [*mb, "status"],
        )
        self.duration = HistogramSeries(
            "infermux_request_duration_seconds",
            "End-to-end request latency (until the final bytes)",
            [*mb, "status"],
            _DURATION_BUCKETS,
        )
        self.ttft = HistogramSeries(
            "infermux_time_to_first_token_seconds", "Time to first token", mb, _TTFT_BUCKETS
        )
        self.tpot = HistogramSeries(
            "infermux_time_per_output_token_seconds",
            "Mean time per output token after the first, per choice",
            mb,
            _TPOT_BUCKETS,
        )
        self.itl = HistogramSeries(
            "infermux_inter_token_latency_seconds",
            "Time between consecutive output chunks",
            mb,
            _TPOT_BUCKETS,
        )
        self.phases = {
            phase: HistogramSeries(
                f"infermux_{phase}_time_seconds",
                f"Engine {phase} time (backends that report phases)",
                mb,
                _TTFT_BUCKETS,
            )
            for phase in ("queue", "prefill", "decode")
        }
        self.prompt_tokens = CounterSeries("infermux_prompt_tokens", "Prompt tokens", mb)
        self.completion_tokens = CounterSeries(
            "infermux_completion_tokens", "Completion tokens", mb
        )
        self.cached_tokens = CounterSeries(
            "infermux_cached_prompt_tokens", "Prompt tokens served from a prefix cache", mb
        )
        self.running = GaugeSeries(
            "infermux_requests_running", "Choices streaming from a backend", ["model"]
        )
        self.waiting = GaugeSeries(
            "infermux_requests_waiting",
            "Choices waiting for their first chunk (routing, queue, prefill)",
            ["model"],
        )
        self.goodput = CounterSeries(
            "infermux_goodput_requests",
            "Successful requests that met every configured SLO ([telemetry.slo])",
            ["model"],
        )
        registry.register(
            SeriesCollector(
                [
                    self.requests,
                    self.duration,
                    self.ttft,
                    self.tpot,
                    self.itl,
                    *self.phases.values(),
                    self.prompt_tokens,
                    self.completion_tokens,
                    self.cached_tokens,
                    self.running,
                    self.waiting,
                    self.goodput,
                ]
            )
        )


class _OTel:
    """The same measurements as OTel GenAI instruments."""

    def __init__(self, provider: MeterProvider) -> None:
        meter = provider.get_meter("infermux")
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description="Generative AI server request duration",
            explicit_bucket_boundaries_advisory=list(_DURATION_BUCKETS),
        )
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to generate the first token",
            explicit_bucket_boundaries_advisory=list(_TTFT_BUCKETS),
        )
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token after the first",
            explicit_bucket_boundaries_advisory=list(_TPOT_BUCKETS),
        )
        self.tokens = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Input and output tokens used",
            explicit_bucket_boundaries_advisory=list(_TOKEN_BUCKETS),
        )


class MetricsPlugin:
    """See the module docstring. ``meter_provider`` (tests) replaces the env set-up."""

    def __init__(
        self,
        *,
        meter_provider: MeterProvider | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._env = env if env is not None else os.environ
        self._given_provider = meter_provider
        self._owned_provider: MeterProvider | None = None
        self._prom: _Prometheus | None = None
        self._registry: CollectorRegistry | None = None
        self._stats: BackendStatsCollector | None = None
        self._otel: _OTel | None = None
        self._aliases: frozenset[str] | None = None
        self._backend_kinds: dict[str, str] = {}
        self._slo: SloConfig | None = None
        #: request id -> {choice index: "waiting" | "running"}
        self._choices: dict[str, dict[int, str]] = {}

    # -- lifecycle ------------------------------------------------------------------------

    @hookimpl
    def infermux_register_metrics(
        self, registry: CollectorRegistry, backends: Mapping[str, Backend]
    ) -> None:
        self._prom = _Prometheus(registry)
        self._registry = registry
        self._stats = BackendStatsCollector(backends)
        registry.register(self._stats)

    @hookimpl
    def infermux_startup(self, config: InfermuxConfig) -> None:
        self._aliases = frozenset(m.alias for m in config.models)
        self._backend_kinds = {b.name: b.kind for b in config.backends}
        self._slo = config.telemetry.slo
        if config.telemetry.metrics.vllm_names:
            self._show_vllm_names(config)
        provider = self._given_provider
        if provider is None and metrics_export_wanted(
            config.telemetry.metrics.otel_export, self._env
        ):
            provider = self._owned_provider = build_meter_provider(
                config.telemetry.service_name, self._env
            )
        if provider is not None:
            self._otel = _OTel(provider)

    def _show_vllm_names(self, config: InfermuxConfig) -> None:
        """Register vLLM's names as views of this app's series (the registry is per app)."""
        prom, registry, stats = self._prom, self._registry, self._stats
        if prom is None or registry is None or stats is None:
            return  # no /metrics registry given to this plugin
        registry.register(
            SeriesCollector(
                vllm_views(
                    requests=prom.requests,
                    duration=prom.duration,
                    ttft=prom.ttft,
                    tpot=prom.tpot,
                    itl=prom.itl,
                    phases=prom.phases,
                    prompt_tokens=prom.prompt_tokens,
                    completion_tokens=prom.completion_tokens,
                    cached_tokens=prom.cached_tokens,
                    running=prom.running,
                    waiting=prom.waiting,
                )
            )
        )
        stats.vllm_models = {
            backend.name: [m.alias for m in config.models if backend.name in m.backends]
            for backend in config.backends
        }

    @hookimpl
    def infermux_shutdown(self) -> None:
        provider, self._owned_provider = self._owned_provider, None
        if provider is not None:
            shutdown_quietly(provider.shutdown, "meter provider")

    # -- the request path -----------------------------------------------------------------

    def _model(self, alias: str) -> str:
        if self._aliases is None or alias in self._aliases:
            return alias
        return "unknown"

    @hookimpl
    def infermux_on_request_start(self, requests: Sequence[GenerationRequest]) -> None:
        if self._prom is None or not requests:
            return
        first = requests[0]
        self._choices[http_request_id(first)] = {r.choice_index: "waiting" for r in requests}
        self._prom.waiting.add((self._model(first.model),), len(requests))

    @hookimpl
    def infermux_on_attempt_end(
        self, request: GenerationRequest, error: InfermuxError | None
    ) -> None:
        if error is not None or self._prom is None:
            return
        choices = self._choices.get(http_request_id(request))
        if choices is None or choices.get(request.choice_index) != "waiting":
            return
        choices[request.choice_index] = "running"
        model = (self._model(request.model),)
        self._prom.waiting.add(model, -1)
        self._prom.running.add(model, 1)

    @hookimpl
    def infermux_on_request_end(self, summary: RequestSummary) -> None:
        if self._prom is None:
            return
        # Recorded in the loop's next turn: after the response's final bytes went out (the
        # gateway sends them right after this hook, without waiting in between), before any
        # request that arrives meanwhile (a scrape) is read. A dozen histogram and counter
        # updates are then off the request's latency.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._record(summary)
        else:
            loop.call_soon(self._record, summary)

    def _record(self, summary: RequestSummary) -> None:
        prom = self._prom
        if prom is None:
            return
        request = summary.request
        model = self._model(request.model)
        for state in self._choices.pop(summary.request_id, {}).values():
            (prom.running if state == "running" else prom.waiting).add((model,), -1)
        backend = ",".join(summary.backend_names) or "none"
        status = "ok" if summary.status == "ok" else str(getattr(summary.error, "code", None))
        prom.requests.inc((model, backend, status))
        prom.duration.observe((model, backend, status), summary.duration_s)
        usage = summary.usage
        prom.prompt_tokens.inc((model, backend), usage.prompt_tokens)
        prom.completion_tokens.inc((model, backend), usage.completion_tokens)
        if usage.cached_tokens:
            prom.cached_tokens.inc((model, backend), usage.cached_tokens)
        for choice in summary.choices:
            name = choice.backend_name
            if name is None:
                continue
            labels = (model, name)
            if choice.ttft_s is not None:
                prom.ttft.observe(labels, choice.ttft_s)
            if choice.tpot_s is not None:
                prom.tpot.observe(labels, choice.tpot_s)
            prom.itl.observe_many(labels, choice.inter_token_s)
            phases = choice.phases
            if phases is not None:
                for phase, value in (
                    ("queue", phases.queued_s),
                    ("prefill", phases.prefill_s),
                    ("decode", phases.decode_s),
                ):
                    if value is not None:
                        prom.phases[phase].observe(labels, value)
        if summary.status == "ok" and self._meets_slo(summary):
            prom.goodput.inc((model,))
        if self._otel is not None:
            self._record_otel(self._otel, summary, model)

    def _meets_slo(self, summary: RequestSummary) -> bool:
        slo = self._slo
        if slo is None:
            return True
        if slo.ttft_ms is not None and (
            summary.ttft_s is None or summary.ttft_s * 1000 > slo.ttft_ms
        ):
            return False
        # A one-token answer has no TPOT: nothing to miss.
        return not (
            slo.tpot_ms is not None
            and summary.tpot_s is not None
            and summary.tpot_s * 1000 > slo.tpot_ms
        )

    def _record_otel(self, otel: _OTel, summary: RequestSummary, model: str) -> None:
        served = summary.backend_names
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation_name(summary.request.kind),
            "gen_ai.request.model": model,
            "gen_ai.provider.name": provider_name(
                self._backend_kinds.get(served[0]) if served else None
            ),
        }
        if summary.status != "ok":
            error = summary.error
            attributes["error.type"] = str(getattr(error, "code", None) or type(error).__name__)
        otel.duration.record(summary.duration_s, attributes)
        if summary.ttft_s is not None:
            otel.ttft.record(summary.ttft_s, attributes)
        if summary.tpot_s is not None:
            otel.tpot.record(summary.tpot_s, attributes)
        usage = summary.usage
        for token_type, count in (
            ("input", usage.prompt_tokens),
            ("output", usage.completion_tokens),
        ):
            otel.tokens.record(count, {**attributes, "gen_ai.token.type": token_type})


def create_plugin() -> MetricsPlugin:
    """A fresh plugin for one plugin manager (one app)."""
    return MetricsPlugin()

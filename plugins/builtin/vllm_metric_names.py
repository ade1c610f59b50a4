"""vLLM's Prometheus names for infermux's series (``[telemetry.metrics] vllm_names = true``).

Dashboards, KEDA scalers and the Gateway API inference extension's endpoint picker read a
vLLM server's ``vllm:*`` series by name. With the option on, ``GET /metrics`` also shows
the series below under those names: each one a :class:`~plugins.builtin.metric_series.
SeriesView` of an ``infermux_*`` series, so both always show the same numbers. Labels are
vLLM's: ``model_name`` (the model alias; backends summed), and ``engine`` (the backend) on
the KV-cache gauges, which :class:`plugins.builtin.metrics.BackendStatsCollector` renders
from the same ``stats()`` reading as ``infermux_backend_kv_cache_usage_ratio``.

``vllm:request_success_total`` counts ``ok`` requests without vLLM's ``finished_reason``
split, and ``vllm:e2e_request_latency_seconds`` is their end-to-end latency.
"""

from __future__ import annotations

from plugins.builtin.metric_series import (
    CounterSeries,
    GaugeSeries,
    HistogramSeries,
    Labels,
    SeriesView,
)

__all__ = ["KV_CACHE_USAGE_NAMES", "ENGINE_LABELS", "vllm_views"]

#: vLLM's KV-cache usage gauge: its current name, and the name before vLLM 0.10 (still the
#: default of older endpoint pickers and dashboards). Values 0..1, as ours.
KV_CACHE_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
ENGINE_LABELS = ["model_name", "engine"]
_MODEL = ["model_name"]


def _model(labels: Labels) -> Labels:
    """(model, backend[, ...]) -> (model,): backends summed."""
    return labels[:1]


def _ok_model(labels: Labels) -> Labels | None:
    """(model, backend, status) -> (model,) for ``ok`` requests only."""
    return labels[:1] if labels[2] == "ok" else None


def vllm_views(
    *,
    requests: CounterSeries,
    duration: HistogramSeries,
    ttft: HistogramSeries,
    tpot: HistogramSeries,
    itl: HistogramSeries,
    phases: dict[str, HistogramSeries],
    prompt_tokens: CounterSeries,
    completion_tokens: CounterSeries,
    cached_tokens: CounterSeries,
    running: GaugeSeries,
    waiting: GaugeSeries,
) -> list[SeriesView]:
    """The vLLM-named views of the metrics plugin's series (docs/observability.md's table)."""
    return [
        SeriesView(running, "vllm:num_requests_running", "Requests running", _MODEL, _model),
        SeriesView(waiting, "vllm:num_requests_waiting", "Requests waiting", _MODEL, _model),
        SeriesView(
            requests, "vllm:request_success", "Successfully processed requests", _MODEL, _ok_model
        ),
        SeriesView(prompt_tokens, "vllm:prompt_tokens", "Prefill tokens processed", _MODEL, _model),
        SeriesView(
            completion_tokens,
            "vllm:generation_tokens",
            "Generation tokens processed",
            _MODEL,
            _model,
        ),
        # vLLM counts every prompt token as a prefix-cache query, the cached ones as hits.
        SeriesView(
            prompt_tokens,
            "vllm:prefix_cache_queries",
            "Prefix-cache queries, in prompt tokens",
            _MODEL,
            _model,
        ),
        SeriesView(
            cached_tokens,
            "vllm:prefix_cache_hits",
            "Prefix-cache hits, in prompt tokens",
            _MODEL,
            _model,
        ),
        SeriesView(ttft, "vllm:time_to_first_token_seconds", "Time to first token", _MODEL, _model),
        # vLLM's time_per_output_token_seconds is per decode step: our inter-token latency;
        # its request_time_per_output_token_seconds is per request: our TPOT.
        SeriesView(
            itl, "vllm:time_per_output_token_seconds", "Time per output token", _MODEL, _model
        ),
        SeriesView(itl, "vllm:inter_token_latency_seconds", "Inter-token latency", _MODEL, _model),
        SeriesView(
            tpot,
            "vllm:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            _MODEL,
            _model,
        ),
        SeriesView(
            duration,
            "vllm:e2e_request_latency_seconds",
            "End-to-end latency of successful requests",
            _MODEL,
            _ok_model,
        ),
        *(
            SeriesView(
                phases[phase],
                f"vllm:request_{phase}_time_seconds",
                f"Time in the {phase} phase",
                _MODEL,
                _model,
            )
            for phase in ("queue", "prefill", "decode")
        ),
    ]

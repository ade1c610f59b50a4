"""The built-in tracing plugin (``builtin.tracing``): one OpenTelemetry trace per request.

Span tree of a request (GenAI semantic conventions, plus ``infermux.*`` attributes)::

    chat smollm2                      SERVER  the whole request, until its final bytes
    ├── route smollm2                 routing of one choice: from its first try to the
    │   │                             first chunk (or to the end, when nothing answered)
    │   ├── attempt remote-a          CLIENT (remote) / INTERNAL: one try of one backend,
    │   │                             until its first chunk or its error (error.type)
    │   └── attempt local             the try that answered
    ├── queued / prefill / decode     engine phases, when the backend reports them
    │                                 (core engine), placed after the answering try began

Speculative decoding (backends that report it on their last chunk) is known only when the
choice ends, after its attempt span closed at the first chunk: its figures go on the
``decode`` span of the choice and, summed over choices, on the request span, as
``infermux.speculation.method``, ``.num_drafts``, ``.proposed_tokens``,
``.accepted_tokens``, ``.acceptance_rate`` and ``.mean_accepted_length``. Engines with KV
tiers (core engine) say where the cached prompt tokens came from: the request span has
``infermux.kv_cache.cached_tokens.device``, ``.host`` and ``.disk`` (tiers with none left
out) beside ``gen_ai.usage.cache_read.input_tokens``.

With ``n`` > 1 each choice has its own route (``infermux.choice_index``). A client's W3C
``traceparent`` becomes the parent of the request span, and each attempt's context is what
the router sends to the backend (``infermux_on_attempt_start`` returns it), so a remote
infermux, vLLM or any OTel-instrumented server continues the same trace under the try.

Tracing is on when ``[telemetry.tracing] enabled`` says so or, by default, when the
``OTEL_*`` environment asks for export (see :mod:`plugins.builtin.otel_env`). Message
content is recorded only with ``record_content = true``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from backends.base import SpeculationStats
from plugins.builtin.genai_names import operation_name, provider_name
from plugins.builtin.otel_env import build_tracer_provider, shutdown_quietly, tracing_wanted
from plugins.builtin.slo_cost import DECISION_LABEL
from plugins.hookspecs import hookimpl
from plugins.request_summary import http_request_id

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from backends.base import BackendConfig, GenerationRequest
    from backends.errors import InfermuxError
    from gateway.config.types import InfermuxConfig
    from plugins.request_summary import ChoiceSummary, RequestSummary

__all__ = ["TracingPlugin", "create_plugin"]

logger = logging.getLogger("plugins.tracing")

_PROPAGATOR = TraceContextTextMapPropagator()
# The response id's prefix per request kind, as the endpoints write it.
_ID_PREFIXES = {"chat": "chatcmpl", "completion": "cmpl", "embedding": "emb"}

# Backend kinds that run in this process: their attempt spans are INTERNAL, not CLIENT.
_LOCAL_KINDS = frozenset({"llamacpp", "core_engine", "mlx", "mock"})


class _Trace:
    """The open spans of one request."""

    __slots__ = ("root", "routes", "attempts", "answered_at_ns", "num_attempts")

    def __init__(self, root: Span) -> None:
        self.root = root
        #: choice -> its route span, until a try answered.
        self.routes: dict[int, Span] = {}
        #: (choice, attempt) -> the attempt span, until the try ended.
        self.attempts: dict[tuple[int, int], Span] = {}
        #: choice -> start (ns) of the try that answered: where engine phases begin.
        self.answered_at_ns: dict[int, int] = {}
        self.num_attempts: dict[int, int] = {}


class _BackendInfo:
    __slots__ = ("kind", "address", "port")

    def __init__(self, config: BackendConfig) -> None:
        self.kind = config.kind
        self.address: str | None = None
        self.port: int | None = None
        url = config.options.get("base_url") if config.kind == "openai" else None
        if isinstance(url, str):
            import httpx

            try:
                parsed = httpx.URL(url)
            except Exception:  # config validation reports it; tracing just skips it
                return
            self.address = parsed.host or None
            self.port = parsed.port or (443 if parsed.scheme == "https" else 80)


class TracingPlugin:
    """See the module docstring. ``tracer_provider`` (tests: an in-memory exporter)
    replaces the set-up from the environment; the plugin never touches the global one."""

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._env = env if env is not None else os.environ
        self._given_provider = tracer_provider
        self._owned_provider: TracerProvider | None = None
        self._tracer: Tracer | None = None
        self._record_content = False
        self._server: tuple[str, int] | None = None
        self._backends: dict[str, _BackendInfo] = {}
        self._traces: dict[str, _Trace] = {}

    # -- lifecycle ------------------------------------------------------------------------

    @hookimpl
    def infermux_startup(self, config: InfermuxConfig) -> None:
        settings = config.telemetry.tracing
        provider = self._given_provider
        if provider is None and tracing_wanted(settings.enabled, self._env):
            provider = self._owned_provider = build_tracer_provider(
                config.telemetry.service_name,
                self._env,
                max_queue_size=settings.max_queue_size,
            )
        if provider is None:
            return
        self._tracer = provider.get_tracer("infermux", _version())
        self._record_content = settings.record_content
        self._server = (config.server.host, config.server.port)
        self._backends = {b.name: _BackendInfo(b) for b in config.backends}
        logger.info("tracing on (%s)", "OTLP/HTTP" if self._owned_provider else "custom")

    @hookimpl
    def infermux_shutdown(self) -> None:
        self._tracer = None
        provider, self._owned_provider = self._owned_provider, None
        if provider is not None:
            shutdown_quietly(provider.shutdown, "tracer provider")

    # -- spans ----------------------------------------------------------------------------

    @hookimpl
    def infermux_on_request_start(self, requests: Sequence[GenerationRequest]) -> None:
        tracer = self._tracer
        if tracer is None or not requests:
            return
        first = requests[0]
        parent = (
            _PROPAGATOR.extract({"traceparent": first.traceparent}) if first.traceparent else None
        )
        operation = operation_name(first.kind)
        params = first.params
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": first.model,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.stream": first.stream,
            "infermux.request_id": http_request_id(first),
        }
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        if params.top_k:
            attributes["gen_ai.request.top_k"] = params.top_k
        if params.stop:
            attributes["gen_ai.request.stop_sequences"] = list(params.stop)
        if len(requests) > 1:
            attributes["gen_ai.request.choice.count"] = len(requests)
        if self._server is not None:
            attributes["server.address"], attributes["server.port"] = self._server
        if self._record_content:
            attributes["gen_ai.input.messages"] = _input_messages(requests)
        root = tracer.start_span(
            f"{operation} {first.model}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        self._traces[http_request_id(first)] = _Trace(root)

    @hookimpl
    def infermux_on_attempt_start(
        self, request: GenerationRequest, backend_name: str, attempt: int
    ) -> str | None:
        tracer = self._tracer
        state = self._traces.get(http_request_id(request))
        if tracer is None or state is None:
            return None
        choice = request.choice_index
        route = state.routes.get(choice)
        if route is None:
            route_attributes: dict[str, Any] = {
                "gen_ai.request.model": request.model,
                "infermux.choice_index": choice,
            }
            decision = request.labels.get(DECISION_LABEL)
            if decision is not None:  # the strategy's decision and its inputs (slo_cost)
                route_attributes["infermux.routing.decision"] = decision
            route = state.routes[choice] = tracer.start_span(
                f"route {request.model}",
                context=trace.set_span_in_context(state.root),
                attributes=route_attributes,
            )
        info = self._backends.get(backend_name)
        kind = info.kind if info is not None else None
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation_name(request.kind),
            "gen_ai.request.model": request.model,
            "gen_ai.provider.name": provider_name(kind),
            "infermux.backend.name": backend_name,
            "infermux.attempt": attempt,
            "infermux.choice_index": choice,
        }
        if kind is not None:
            attributes["infermux.backend.kind"] = kind
        if request.resume is not None:  # continues an answer begun by a failed attempt or the client
            attributes["infermux.resume.num_output_chars"] = len(request.resume.text)
            attributes["infermux.resume.num_output_tokens"] = len(request.resume.token_ids)
        if info is not None and info.address is not None:
            attributes["server.address"] = info.address
            attributes["server.port"] = info.port
        span = tracer.start_span(
            f"attempt {backend_name}",
            context=trace.set_span_in_context(route),
            kind=SpanKind.INTERNAL if kind in _LOCAL_KINDS else SpanKind.CLIENT,
            attributes=attributes,
        )
        state.attempts[(choice, attempt)] = span
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get("traceparent")

    @hookimpl
    def infermux_on_attempt_end(
        self,
        request: GenerationRequest,
        backend_name: str,
        attempt: int,
        error: InfermuxError | None,
    ) -> None:
        state = self._traces.get(http_request_id(request))
        if state is None:
            return
        choice = request.choice_index
        span = state.attempts.pop((choice, attempt), None)
        if span is None:
            return
        state.num_attempts[choice] = attempt + 1
        if error is not None:
            _set_error(span, error)
            span.end()
            return
        span.end()
        start_time = getattr(span, "start_time", None)
        if isinstance(start_time, int):
            state.answered_at_ns[choice] = start_time
        route = state.routes.pop(choice, None)
        if route is not None:
            route.set_attribute("infermux.backend.name", backend_name)
            route.set_attribute("infermux.retries", attempt)
            route.end()

    @hookimpl
    def infermux_on_request_end(self, summary: RequestSummary) -> None:
        tracer = self._tracer
        state = self._traces.pop(summary.request_id, None)
        if state is None:
            return
        for span in state.attempts.values():  # the router always ends its tries; be safe
            span.end()
        for index, route in state.routes.items():  # no try answered this choice
            route.set_attribute("infermux.retries", max(0, state.num_attempts.get(index, 1) - 1))
            if summary.error is not None:
                _set_error(route, summary.error)
            route.end()
        root = state.root
        if tracer is not None:
            for choice in summary.choices:
                self._phase_spans(tracer, state, choice)
        root.set_attributes(self._end_attributes(summary, state))
        if summary.status == "error":
            _set_error(root, summary.error)
        elif summary.status == "aborted":
            root.set_attribute("error.type", _error_type(summary.error))
        root.end()

    def _end_attributes(self, summary: RequestSummary, state: _Trace) -> dict[str, Any]:
        request = summary.request
        served = summary.backend_names
        attributes: dict[str, Any] = {
            "gen_ai.response.id": f"{_ID_PREFIXES.get(request.kind, 'cmpl')}-{summary.request_id}",
            "gen_ai.response.model": request.model,
            "gen_ai.usage.input_tokens": summary.usage.prompt_tokens,
            "gen_ai.usage.output_tokens": summary.usage.completion_tokens,
            "infermux.retries": sum(max(0, n - 1) for n in state.num_attempts.values()),
            "infermux.status": summary.status,
        }
        finish_reasons = [c.finish_reason for c in summary.choices if c.finish_reason]
        if finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = finish_reasons
        if summary.usage.cached_tokens is not None:
            attributes["gen_ai.usage.cache_read.input_tokens"] = summary.usage.cached_tokens
        for tier, count in (summary.usage.cached_tokens_by_tier or {}).items():
            attributes[f"infermux.kv_cache.cached_tokens.{tier}"] = count
        if served:
            attributes["infermux.backend.name"] = ",".join(served)
            info = self._backends.get(served[0])
            attributes["gen_ai.provider.name"] = provider_name(info.kind if info else None)
        if summary.ttft_s is not None:
            attributes["infermux.ttft_s"] = summary.ttft_s
        if summary.tpot_s is not None:
            attributes["infermux.tpot_s"] = summary.tpot_s
        if request.tenant is not None:
            attributes["infermux.tenant"] = request.tenant
        if request.api_key_id is not None:
            attributes["infermux.api_key_id"] = request.api_key_id
        for key, value in summary.attributes.items():
            if isinstance(key, str) and isinstance(value, str | bool | int | float):
                attributes[key] = value
        if self._record_content:
            attributes["gen_ai.output.messages"] = _output_messages(summary.choices)
        stats = [c.speculation for c in summary.choices if c.speculation is not None]
        if stats:
            attributes |= _speculation_attributes(
                SpeculationStats(
                    method=next((s.method for s in stats if s.method), None),
                    num_drafts=sum(s.num_drafts for s in stats),
                    num_draft_tokens=sum(s.num_draft_tokens for s in stats),
                    num_accepted_tokens=sum(s.num_accepted_tokens for s in stats),
                )
            )
        return attributes

    def _phase_spans(self, tracer: Tracer, state: _Trace, choice: ChoiceSummary) -> None:
        phases = choice.phases
        if phases is None:
            return
        at = state.answered_at_ns.get(choice.choice_index)
        if at is None:
            at = getattr(state.root, "start_time", None)
        if not isinstance(at, int):
            return
        context = trace.set_span_in_context(state.root)
        for name, seconds in (
            ("queued", phases.queued_s),
            ("prefill", phases.prefill_s),
            ("decode", phases.decode_s),
        ):
            if seconds is None:
                continue
            attributes: dict[str, Any] = {
                "infermux.choice_index": choice.choice_index,
                "infermux.backend.name": choice.backend_name or "",
            }
            if name == "decode" and choice.speculation is not None:
                attributes |= _speculation_attributes(choice.speculation)
            span = tracer.start_span(name, context=context, start_time=at, attributes=attributes)
            at += int(seconds * 1e9)
            span.end(end_time=at)


def _speculation_attributes(stats: SpeculationStats) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "infermux.speculation.num_drafts": stats.num_drafts,
        "infermux.speculation.proposed_tokens": stats.num_draft_tokens,
        "infermux.speculation.accepted_tokens": stats.num_accepted_tokens,
    }
    if stats.method is not None:
        attributes["infermux.speculation.method"] = stats.method
    if stats.acceptance_rate is not None:
        attributes["infermux.speculation.acceptance_rate"] = stats.acceptance_rate
    if stats.mean_accepted_length is not None:
        attributes["infermux.speculation.mean_accepted_length"] = stats.mean_accepted_length
    return attributes


def _error_type(error: Any) -> str:
    code = getattr(error, "code", None)
    return str(code) if code else type(error).__name__


def _set_error(span: Span, error: Any) -> None:
    span.set_attribute("error.type", _error_type(error))
    span.set_status(Status(StatusCode.ERROR, str(getattr(error, "message", error))))


def _input_messages(requests: Sequence[GenerationRequest]) -> str:
    first = requests[0]
    if first.messages is not None:
        messages = [
            {"role": m.role, "parts": [{"type": "text", "content": m.content}]}
            for m in first.messages
        ]
    else:
        # Completions: one message per distinct prompt (choices of a prompt share it).
        messages = [
            {"role": "user", "parts": [{"type": "text", "content": str(p)}]}
            for p in dict.fromkeys(r.prompt for r in requests)
        ]
    return json.dumps(messages, ensure_ascii=False)


def _output_messages(choices: Sequence[ChoiceSummary]) -> str:
    return json.dumps(
        [
            {
                "role": "assistant",
                "parts": [{"type": "text", "content": c.output_text or ""}],
                "finish_reason": c.finish_reason or "error",
            }
            for c in choices
        ],
        ensure_ascii=False,
    )


def _version() -> str:
    try:
        return version("infermux")
    except PackageNotFoundError:
        return "0.0.0"


def create_plugin() -> TracingPlugin:
    """A fresh plugin for one plugin manager (one app)."""
    return TracingPlugin()

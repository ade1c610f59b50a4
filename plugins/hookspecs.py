"""Every hook infermux calls, in one module, each with its contract.

Hooks are called with keyword arguments through :class:`plugins.manager.PluginHooks`; a
hookimpl may accept any subset of a hook's arguments. Hooks marked *async-capable* may be
written as ``async def``: the facade awaits them. Registration hooks receive a ``register``
callback (the first registration of a name wins, and built-ins are ``trylast``, so a plugin
can replace any built-in kind or strategy by registering the same name).

A minimal plugin::

    from plugins.hookspecs import hookimpl

    @hookimpl
    async def infermux_on_response(request, backend_name, usage, finish_reason):
        print(request.request_id, backend_name, usage)

published under the entry-point group ``infermux`` (``[project.entry-points.infermux]``).
The plugin author's guide, with an example per hook and the rules for async
implementations, is docs/plugins.md (tests/plugins/test_hook_docs.py fails when a hook
added here is missing from it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from backends.base import Backend, BackendConfig, GenerationChunk, GenerationRequest, Usage
    from backends.errors import InfermuxError
    from core_engine.policy import (
        KVOffloadContext,
        KVOffloadDecision,
        QuantizationContext,
        QuantizationDecision,
        SpeculationContext,
        SpeculationDecision,
    )
    from gateway.config.types import InfermuxConfig
    from plugins.request_summary import RequestSummary
    from plugins.usage_report import UsageQuery, UsageReport

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]

PROJECT_NAME = "infermux"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def infermux_register_backend_kinds(
    register: Callable[[str, Callable[[BackendConfig], Backend]], None],
) -> None:
    """Register backend kinds (the ``kind`` of a ``[[backends]]`` table).

    Called once when the app is created. Call ``register(kind, factory)`` for each kind;
    ``factory(config: BackendConfig) -> Backend`` must construct cheaply (loading happens in
    ``Backend.start``) and raise ``ValueError`` naming ``backends.<name>.options.<key>`` for
    bad options. The first registration of a kind wins. Return value ignored.
    """


@hookspec
def infermux_register_routing_strategies(
    register: Callable[[str, Callable[[], Any]], None],
) -> None:
    """Register routing strategies (the ``strategy`` of a ``[[models]]`` table).

    Called once when the router is built. Call ``register(name, factory)``; ``factory()``
    returns an object with ``order(candidates: list[str], request: GenerationRequest,
    outstanding: Mapping[str, int]) -> list[str]`` giving the order in which backends are
    tried. The first registration of a name wins. Return value ignored.
    """


@hookspec(firstresult=True)
def infermux_select_backend(request: GenerationRequest, candidates: Sequence[str]) -> str | None:
    """Pick the backend for one request, before the model's strategy (synchronous).

    Called by the router for every choice, with the names of the backends that serve the
    requested alias (circuit-open ones removed). Return one of ``candidates`` to force it
    (the router still falls back to the others on a retryable failure), or ``None`` to
    let the next plugin, then the strategy, decide. The first non-``None`` answer wins.
    """


@hookspec
def infermux_transform_request(request: GenerationRequest) -> GenerationRequest | None:
    """Rewrite or reject a request before routing (async-capable).

    Called once per choice, after the wire request was converted and before the router
    sees it. Return a new ``GenerationRequest`` (``msgspec.structs.replace``) to change it,
    or ``None`` to leave it. Implementations are chained: each one receives the previous
    one's result (tryfirst ones first, then in registration order, trylast ones last).
    Raise an :class:`~backends.errors.InfermuxError` to reject the request with that error;
    any other exception fails the request with a 500 (a broken policy must not be bypassed).
    """


@hookspec
def infermux_on_response(
    request: GenerationRequest, backend_name: str, usage: Usage | None, finish_reason: str | None
) -> None:
    """A choice finished normally (async-capable).

    Called exactly once per choice that reached a backend and completed (``finish_reason``
    "stop", "length", ...), with the backend's own usage. Exceptions and timeouts are
    logged and never affect the response. Return value ignored.
    """


@hookspec
def infermux_on_error(
    request: GenerationRequest,
    backend_name: str | None,
    error: InfermuxError,
    usage: Usage | None,
) -> None:
    """A choice that reached a backend failed or was abandoned (async-capable).

    Called exactly once per such choice instead of ``infermux_on_response``: routing gave up
    (``backend_name`` is the last backend tried, or ``None`` if unknown), the stream broke,
    or the client disconnected (``GenerationAbortedError``). ``usage`` is what was produced
    so far when known. Exceptions and timeouts are logged and ignored. Return value ignored.
    """


@hookspec
def infermux_startup(config: InfermuxConfig) -> None:
    """The gateway is starting, before backends load (async-capable).

    ``config.plugins.settings[<plugin name>]`` holds a plugin's own settings table.
    Exceptions are logged; the gateway starts anyway. Return value ignored.
    """


@hookspec
def infermux_shutdown() -> None:
    """The gateway is stopping, after backends were closed (async-capable).

    Flush buffers, close clients. Exceptions and timeouts are logged. Return value ignored.
    """


# -- request lifecycle (telemetry, accounting) --------------------------------------------


@hookspec
def infermux_on_request_start(requests: Sequence[GenerationRequest]) -> None:
    """An HTTP generation request starts (async-capable).

    Called once per ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``
    (one request of kind ``embedding`` carrying every input) or ``/v1/responses`` (a chat
    request) that passed wire validation, before ``infermux_transform_request``, with one ``GenerationRequest`` per
    choice as converted from the wire (``choice_index`` and the seed differ; with several
    choices each has its own ``request_id`` and they share ``parent_request_id``). Every
    call is matched by exactly one ``infermux_on_request_end`` whatever happens next
    (rejection, routing failure, disconnect); key per-request state on
    ``plugins.request_summary.http_request_id(request)``, which is also what the attempt
    hooks' requests and ``summary.request_id`` give. Exceptions and timeouts are logged and
    never affect the request. Return value ignored.
    """


@hookspec
def infermux_on_attempt_start(
    request: GenerationRequest, backend_name: str, attempt: int
) -> str | None:
    """The router is about to call ``backend.generate`` for one try (synchronous).

    Called for every attempt of every choice, including retries on other backends:
    ``attempt`` counts the tries of this choice from 0, ``request`` is the choice after
    ``transform_request``. Return a W3C ``traceparent`` header value to send to this backend
    instead of ``request.traceparent`` (the built-in tracing plugin returns the context of
    its attempt span, so a remote backend's spans nest under it), or ``None``. The first
    non-``None`` string wins. Must be fast and must not block: it runs on the request path.
    An ``async`` implementation, or one that raises, is logged and ignored.
    """


@hookspec
def infermux_on_attempt_end(
    request: GenerationRequest,
    backend_name: str,
    attempt: int,
    error: InfermuxError | None,
) -> None:
    """One try of a backend ended (synchronous).

    Called once for each ``infermux_on_attempt_start``, by the router: ``error`` is
    ``None`` when the backend produced its first chunk (the choice is now committed to this
    backend and streams from it: a time-to-first-token moment), else the error of the try
    (the router may go on to the next backend; a ``GenerationAbortedError`` when the client
    went away meanwhile). The end of the committed stream is reported later through
    ``infermux_on_response`` / ``infermux_on_error``. Must be fast and must not block; an
    ``async`` implementation or one that raises is logged and ignored. Return value ignored.
    """


@hookspec
def infermux_on_request_end(summary: RequestSummary) -> None:
    """An HTTP generation request ended; its final bytes are about to be sent (async-capable).

    Called exactly once per ``infermux_on_request_start``, once the upstream work of every
    choice has stopped, with a :class:`~plugins.request_summary.RequestSummary` (status,
    per-choice outcomes and usage, timings, engine phases): it is self-contained, and the
    per-choice ``infermux_on_response`` / ``infermux_on_error`` of streamed choices come
    after it (they are sent once the response is out). The gateway awaits every implementation *before* it sends
    ``data: [DONE]``, the JSON body or the SSE error frame, so a plugin that must make a
    record durable before the client sees the end (the built-in cost ledger) awaits its
    commit here; keep it short, it is bounded by ``[plugins] hook_timeout_s``. Requests
    rejected before the router (``transform_request`` raised) or refused by it also end
    here (with no attempt before). Plugins may put facts into ``summary.attributes`` for
    the plugins called after them (``tryfirst`` runs first). Exceptions and timeouts are
    logged and never affect the response. Return value ignored.
    """


# -- observability and accounting endpoints ----------------------------------------------


@hookspec
def infermux_register_metrics(registry: CollectorRegistry, backends: Mapping[str, Backend]) -> None:
    """Add Prometheus metrics to the app's registry (``GET /metrics``).

    Called once when the app is created, with the app's own
    ``prometheus_client.CollectorRegistry`` (never the process-global one: several apps may
    live in one process) and the live ``backend name -> Backend`` mapping, which a custom
    collector may read at scrape time (the built-in metrics plugin calls a backend's optional
    ``stats() -> dict`` there). Create instruments with ``registry=registry`` or call
    ``registry.register(collector)``; a name registered twice raises and the plugin is
    reported. Return value ignored.
    """


@hookspec(firstresult=True)
def infermux_query_usage(query: UsageQuery) -> UsageReport | None:
    """Answer ``GET /v1/usage`` from a plugin's usage records (async-capable).

    Called for every usage query with a :class:`~plugins.usage_report.UsageQuery` (filters:
    API key id, tenant, model, time window). Return a
    :class:`~plugins.usage_report.UsageReport` (totals and per-day rows), or ``None`` to let
    the next plugin answer; the built-in cost ledger answers last (``trylast``), so an
    accounting plugin of your own can take over. With no answer at all the endpoint says
    404 (accounting disabled). An ``InfermuxError`` raised here reaches the client.
    """


# -- the backend call ---------------------------------------------------------------------


@hookspec
def infermux_wrap_generate(
    request: GenerationRequest,
    backend_name: str,
    call_next: Callable[[GenerationRequest], AsyncIterator[GenerationChunk]],
) -> AsyncIterator[GenerationChunk] | None:
    """Wrap one backend call: time it, cache it, rewrite its chunks (async-capable).

    Called by the router for every attempt, after ``infermux_on_attempt_start``, with the
    request the backend will get and ``call_next(request)``, which opens the next wrapper's
    stream, the last one the backend's own ``generate``. Return an async iterator of
    ``GenerationChunk`` (usually: write the hookimpl as an async generator that iterates
    ``call_next(request)`` and yields), or ``None`` to leave the call unwrapped. A
    coroutine function may also ``return`` such an iterator (or ``None``) after awaiting
    something (a cache lookup); it is awaited inside the first-byte timeout. Wrappers nest
    in pluggy's call order: the first (``tryfirst``) is outermost. The router's rules stay
    around the whole chain: first-byte timeout, retries before the first chunk, closing
    the stream aborts every layer and the backend. An exception other than an
    ``InfermuxError`` raised by a wrapper fails the request with a 500 naming the plugin,
    and is never counted against the backend's circuit.
    """


# -- engine policies (consulted by the core engine; see core_engine/policy.py) ------------


@hookspec(firstresult=True)
def infermux_choose_quantization(context: QuantizationContext) -> QuantizationDecision | None:
    """Choose the weight and KV cache dtypes of a model the core engine loads (synchronous).

    Called once per model load, before the weights are read, with a
    :class:`~core_engine.policy.QuantizationContext` (model name and path, device, file
    type, free device memory). Return a :class:`~core_engine.policy.QuantizationDecision`
    or ``None`` to let the next plugin decide; the built-in policy answers last
    (``trylast``): ``context.requested`` (the backend's options ``weight_format`` and
    ``kv_cache_dtype``), or the per-model override from its settings. The engine fails the
    load with a message if it cannot honour the answer. An exception is logged and the
    built-in default is used.
    """


@hookspec(firstresult=True)
def infermux_plan_kv_offload(context: KVOffloadContext) -> KVOffloadDecision | None:
    """Decide which requests' KV blocks leave device memory and which come back (synchronous).

    Called by the core engine once per scheduler step while it has a host (or disk) KV
    tier, with a :class:`~core_engine.policy.KVOffloadContext` (free blocks per tier, and
    where each request's blocks are). Return a :class:`~core_engine.policy.KVOffloadDecision`
    (offload, prefetch) or ``None`` for the next plugin; the built-in watermark policy answers
    last. Runs on the engine's step path: it must be fast and do no I/O. An exception is
    logged and the built-in default is used for that step.
    """


@hookspec(firstresult=True)
def infermux_choose_speculation(context: SpeculationContext) -> SpeculationDecision | None:
    """Choose the speculative decoding method and proposal length for a request (synchronous).

    Called by the core engine per request and step while speculation is available, with a
    :class:`~core_engine.policy.SpeculationContext` (available methods, batch size, tokens
    proposed and accepted so far, the request's labels). Return a
    :class:`~core_engine.policy.SpeculationDecision` (``method`` None: decode normally) or
    ``None`` for the next plugin; the built-in adaptive policy answers last. Runs on the
    step path: fast, no I/O. An exception is logged and the built-in default is used.
    """

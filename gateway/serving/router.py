"""The model router: picks a backend for each request, falls back, retries, breaks circuits.

For one request (one choice) the router

1. resolves the alias (``ModelNotFoundError``) or the pinned backend (``x-infermux-backend``;
   a name that does not serve the alias is a 400 ``unknown_backend``),
2. orders the candidates: the ``infermux_select_backend`` hook's answer first, then the
   alias's strategy (``priority``, ``round_robin``, ``least_outstanding``, or a plugin's),
3. skips backends whose circuit is open (a half-open circuit lets one probe through) and
   backends whose capabilities rule out a parameter of the request (none left: 400
   ``unsupported_parameter``, see :mod:`gateway.serving.capability_check`),
4. opens ``backend.generate(request)`` and waits for the FIRST chunk, bounded by the
   backend's ``first_byte_timeout``. A retryable :class:`BackendError` there (connection
   refused, 5xx, 429, timeout) counts against the backend's circuit and the next candidate
   is tried, up to ``max_retries`` extra attempts; any other error propagates at once.
   Plugins hear about every try (``infermux_on_attempt_start`` / ``_end``: tracing spans,
   the per-hour cost share); a ``traceparent`` answered by the first becomes the one sent
   to that backend.

Once the first chunk exists the request is committed to that backend: the gateway may
already be sending bytes to the client, so no retry ever happens after it, unless the
alias has ``resume_on_failure`` (then :meth:`ModelRouter.open_resumed` opens the next
backend on the answer so far: gateway/serving/stream_resume.py). A failure later in the stream
still counts against the circuit.

An upstream 429 with ``Retry-After`` is honoured: no request goes to that backend until the
time has passed (they fall back to the others; with none left the client gets 429 with the
remaining wait as its ``Retry-After``).

Circuit breaker per backend (passive health)::

    closed --N consecutive failures--> open --cool-down--> half_open --probe ok--> closed
                                         ^                     |
                                         +----probe failed-----+

A backend that can tell it recovered (``add_recovery_listener``: a worker process started
again after a crash) closes its circuit at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import msgspec

from backends.base import Backend, BackendConfig, GenerationChunk, GenerationRequest, Usage
from backends.deadline import Deadline, earliest
from backends.errors import (
    BackendError,
    BackendUnavailableError,
    GenerationAbortedError,
    InfermuxError,
    InvalidRequestError,
    ModelNotFoundError,
    StreamIdleTimeoutError,
    UpstreamRateLimitError,
    UpstreamTimeoutError,
)
from gateway.serving.capability_check import unsupported_parameter
from plugins.builtin.slo_cost import DECISION_LABEL
from plugins.builtin.strategies import RoutingContext

if TYPE_CHECKING:
    from gateway.config.types import ModelConfig
    from plugins.manager import PluginHooks

__all__ = ["Attempt", "CircuitBreaker", "ModelRouter", "RoutedStream"]

logger = logging.getLogger("gateway.router")

CircuitState = Literal["closed", "open", "half_open"]

#: The longest an upstream's ``Retry-After`` keeps requests away from it.
_MAX_BLOCK_S = 600.0


class Attempt(msgspec.Struct, frozen=True, kw_only=True):
    """One try of one backend while opening a request."""

    backend_name: str
    #: Why it failed, or None for the attempt that served the request.
    error: Any = None  # InfermuxError | None (exceptions are not msgspec-typed values)
    #: From calling ``generate`` to the first chunk or the error.
    duration_s: float


class CircuitBreaker:
    """Consecutive-failure circuit of one backend (see the module docstring)."""

    def __init__(
        self,
        *,
        failure_threshold: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._state: CircuitState = "closed"
        self.num_consecutive_failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False
        #: An upstream 429's ``Retry-After``: no request goes there before this time.
        self._blocked_until = 0.0

    @property
    def state(self) -> CircuitState:
        if self._state == "open" and self._clock() - self._opened_at >= self.cooldown_s:
            self._state = "half_open"
            self._probe_in_flight = False
        return self._state

    def seconds_until_half_open(self) -> float:
        """How long an open circuit stays open (0 when it is not open)."""
        if self.state != "open":
            return 0.0
        return max(0.0, self._opened_at + self.cooldown_s - self._clock())

    def block_for(self, seconds: float) -> None:
        """Honour an upstream ``Retry-After``: skip this backend for ``seconds``."""
        self._blocked_until = max(self._blocked_until, self._clock() + min(seconds, _MAX_BLOCK_S))

    def seconds_blocked(self) -> float:
        """How long the backend still asked to be left alone (0 when it did not)."""
        return max(0.0, self._blocked_until - self._clock())

    def try_acquire(self) -> bool:
        """May a request go to this backend now? In half-open, only one probe at a time."""
        if self.seconds_blocked() > 0:
            return False
        state = self.state
        if state == "closed":
            return True
        if state == "open" or self._probe_in_flight:
            return False
        self._probe_in_flight = True
        return True

    def record_success(self) -> None:
        if self._state != "closed":
            logger.info("circuit closed again after a successful probe")
        self._state = "closed"
        self.num_consecutive_failures = 0
        self._probe_in_flight = False

    def record_failure(self) -> bool:
        """Count a failure; returns True when this failure opened the circuit."""
        self.num_consecutive_failures += 1
        state = self.state
        if state == "half_open" or (
            state == "closed" and self.num_consecutive_failures >= self.failure_threshold
        ):
            self._state = "open"
            self._opened_at = self._clock()
            self._probe_in_flight = False
            return True
        return False

    def release(self) -> None:
        """An attempt ended without a verdict (the client left): free the probe slot."""
        self._probe_in_flight = False

    def open_for(self, seconds: float) -> bool:
        """Open a closed circuit so that it half-opens in ``seconds`` (another replica saw
        the failures: gateway/serving/shared_circuit.py); True when it was closed."""
        if self.state != "closed":
            return False
        self._state = "open"
        self._opened_at = self._clock() - max(0.0, self.cooldown_s - seconds)
        self._probe_in_flight = False
        return True


class _Route:
    """One alias: its candidates, strategy and retry budget."""

    __slots__ = ("alias", "backend_names", "strategy", "max_retries", "resume_on_failure")

    def __init__(
        self,
        alias: str,
        backend_names: list[str],
        strategy: Any,
        max_retries: int,
        resume_on_failure: bool = False,
    ):
        self.alias = alias
        self.backend_names = backend_names
        self.strategy = strategy
        self.max_retries = max_retries
        self.resume_on_failure = resume_on_failure


class ModelRouter:
    """Routes requests for model aliases to backends (see the module docstring)."""

    def __init__(
        self,
        *,
        models: Sequence[ModelConfig],
        backends: Mapping[str, Backend],
        backend_configs: Mapping[str, BackendConfig],
        hooks: PluginHooks,
        clock: Callable[[], float] = time.monotonic,
        price_of: Callable[[str, str], tuple[float, float] | None] | None = None,
    ) -> None:
        """``price_of(alias, backend)``: the (input, output) price per million tokens, for
        strategies that weigh cost (``slo_cost``)."""
        self._backends = backends
        self._configs = backend_configs
        self._hooks = hooks
        self._clock = clock
        strategies = hooks.register_routing_strategies()
        self._routes: dict[str, _Route] = {}
        for i, model in enumerate(models):
            for name in model.backends:
                if name not in backends:
                    raise ValueError(f"models[{i}].backends: unknown backend {name!r}")
            factory = strategies.get(model.strategy)
            if factory is None:
                known = ", ".join(sorted(strategies)) or "(none registered)"
                raise ValueError(
                    f"models[{i}].strategy: unknown routing strategy {model.strategy!r} "
                    f"(known: {known})"
                )
            strategy = factory()
            configure = getattr(strategy, "configure", None)
            if callable(configure):
                prices = {}
                for name in model.backends:
                    price = price_of(model.alias, name) if price_of is not None else None
                    if price is not None:
                        prices[name] = price
                configure(RoutingContext(
                    alias=model.alias, backends=tuple(model.backends), prices=prices,
                    ttft_slo_ms=model.ttft_slo_ms, tpot_slo_ms=model.tpot_slo_ms,
                    load_factor=model.cache_load_factor,
                    replicas={name: backends[name] for name in model.backends},
                ))
            self._routes[model.alias] = _Route(
                model.alias, list(model.backends), strategy, model.max_retries,
                model.resume_on_failure,
            )
        self._circuits: dict[str, CircuitBreaker] = {}
        for name, backend in backends.items():
            config = backend_configs.get(name)
            circuit = self._circuits[name] = CircuitBreaker(
                failure_threshold=config.circuit_failure_threshold if config else 5,
                cooldown_s=config.circuit_cooldown_s if config else 10.0,
                clock=clock,
            )
            # A backend that knows it is healthy again (a worker process restarted after a
            # crash) closes its circuit at once instead of waiting out the cool-down.
            add_listener = getattr(backend, "add_recovery_listener", None)
            if callable(add_listener):
                add_listener(circuit.record_success)
        self._outstanding: dict[str, int] = dict.fromkeys(backends, 0)
        #: Called with (backend name, cool-down in seconds) when a circuit opens here
        #: (``[state] backend = "redis"`` shares it with the other replicas).
        self.on_circuit_open: Callable[[str, float], None] | None = None

    def open_circuit(self, name: str, seconds: float) -> bool:
        """Open ``name``'s circuit for ``seconds`` if it is closed (opened elsewhere)."""
        circuit = self._circuits.get(name)
        return circuit is not None and circuit.open_for(seconds)

    def _circuit_opened(self, name: str) -> None:
        if self.on_circuit_open is not None:
            self.on_circuit_open(name, self._circuits[name].cooldown_s)

    def aliases(self) -> list[str]:
        """Every model alias, in config order."""
        return list(self._routes)

    def backend_names(self, alias: str) -> list[str]:
        """The backends serving ``alias`` in priority order; ``ModelNotFoundError`` if unknown."""
        route = self._routes.get(alias)
        if route is None:
            raise ModelNotFoundError(f"the model {alias!r} does not exist", param="model")
        return list(route.backend_names)

    def circuit_states(self) -> dict[str, str]:
        """``closed`` | ``open`` | ``half_open`` per backend."""
        return {name: circuit.state for name, circuit in self._circuits.items()}

    def outstanding(self) -> dict[str, int]:
        """Open streams per backend (opening or streaming)."""
        return dict(self._outstanding)

    async def open(
        self, request: GenerationRequest, *, pinned_backend: str | None = None
    ) -> RoutedStream:
        """Start ``request`` on a backend and return its stream with the first chunk fetched."""
        route = self._routes.get(request.model)
        if route is None:
            raise ModelNotFoundError(f"the model {request.model!r} does not exist", param="model")
        if pinned_backend is not None:
            if pinned_backend not in route.backend_names:
                raise InvalidRequestError(
                    f"the backend {pinned_backend!r} (x-infermux-backend) does not serve the "
                    f"model {route.alias!r}; it is served by: {', '.join(route.backend_names)}",
                    param=None,
                    code="unknown_backend",
                )
            ordered = [pinned_backend]
        else:
            ordered, request = await self._order(route, request)
        return await self._open_first(route, ordered, request)

    def resumes_on_failure(self, alias: str) -> bool:
        """Does the alias continue an answer on its next backend after a mid-stream
        failure (``resume_on_failure``: gateway/serving/stream_resume.py)?"""
        route = self._routes.get(alias)
        return route is not None and route.resume_on_failure

    async def open_resumed(
        self,
        request: GenerationRequest,
        *,
        exclude: Sequence[str],
        adapt: Callable[[str, bool], GenerationRequest | None],
        attempts: Sequence[Attempt] = (),
    ) -> RoutedStream:
        """Open the continuation of an answer whose backend failed mid-stream
        (gateway/serving/stream_resume.py) on another backend of the alias than ``exclude``.

        ``adapt(name, honours_resume)`` gives the request for that backend, or None to skip
        it. ``attempts``: the request's tries so far; they count against ``max_retries`` and
        number the next ones. Raises as :meth:`open` does when no backend takes it.
        """
        route = self._routes[request.model]
        ordered, request = await self._order(route, request)
        ordered = [name for name in ordered if name not in exclude]
        return await self._open_first(route, ordered, request, adapt, list(attempts))

    def model_id(self, name: str) -> str | None:
        """The id of the model ``name`` serves (None when it cannot say yet)."""
        try:
            return self._backends[name].model_info().id
        except Exception:  # not started, or a remote that has not answered
            return None

    async def _open_first(
        self,
        route: _Route,
        ordered: list[str],
        request: GenerationRequest,
        adapt: Callable[[str, bool], GenerationRequest | None] | None = None,
        attempts: list[Attempt] | None = None,
    ) -> RoutedStream:
        """The stream of the first of ``ordered`` that sends a first chunk (retries, circuits)."""
        max_attempts = 1 + route.max_retries
        attempts = attempts if attempts is not None else []
        last_error: InfermuxError | None = None
        refusal: InfermuxError | None = None
        for name in ordered:
            if len(attempts) >= max_attempts:
                break
            candidate = request
            if adapt is not None:
                adapted = adapt(name, self._backends[name].capabilities.resume)
                if adapted is None:
                    continue
                candidate = adapted
            # A backend that cannot honour a parameter is skipped, not failed.
            unsupported = unsupported_parameter(self._backends[name].capabilities, candidate, name)
            if unsupported is not None:
                refusal = refusal or unsupported
                continue
            circuit = self._circuits[name]
            if not circuit.try_acquire():
                continue
            try:
                stream = await self._attempt(name, circuit, candidate, attempts, route)
            except InfermuxError as exc:  # not retryable: the client gets it now
                if getattr(exc, "backend_name", None) is None:
                    exc.backend_name = name  # type: ignore[attr-defined]
                raise
            if stream is not None:
                return stream
            last_error = attempts[-1].error
        if last_error is None and refusal is not None:
            raise refusal  # no candidate can honour the request
        if last_error is None and not ordered:
            raise BackendUnavailableError(f"no other backend of the model {route.alias!r} is left")
        if last_error is None:
            blocked = [self._circuits[n].seconds_blocked() for n in ordered]
            if blocked and all(wait > 0 for wait in blocked):
                raise UpstreamRateLimitError(
                    f"every backend of the model {route.alias!r} asked to be left alone "
                    f"(HTTP 429); retry in {min(blocked):.0f} s",
                    retry_after=max(1.0, min(blocked)),
                )
        if last_error is None:
            # Nothing was tried: every candidate's circuit is open.
            wait = min(self._circuits[n].seconds_until_half_open() for n in ordered)
            raise BackendUnavailableError(
                f"no backend of the model {route.alias!r} is available "
                f"(circuit open for {', '.join(ordered)})",
                retry_after=max(1.0, round(wait, 1)),
            )
        if last_error.retry_after is None and isinstance(last_error, BackendUnavailableError):
            last_error.retry_after = 1.0
        if getattr(last_error, "backend_name", None) is None:
            # on_error and the usage ledger name the last backend tried.
            last_error.backend_name = attempts[-1].backend_name  # type: ignore[attr-defined]
        raise last_error

    async def _order(self, route: _Route, request: GenerationRequest) -> tuple[list[str], GenerationRequest]:
        """The backends in the order to try, and the request (with the strategy's decision
        in its labels when the strategy explains itself: the routing span shows it)."""
        candidates = list(route.backend_names)
        adecide = getattr(route.strategy, "adecide", None)
        decide = getattr(route.strategy, "decide", None)
        decision: dict[str, object] | None = None
        if callable(adecide):  # it may ask the backends first (cache_aware: token ids)
            ordered, decision = await adecide(candidates, request, self._outstanding)
        elif callable(decide):
            ordered, decision = decide(candidates, request, self._outstanding)
        if decision is not None:
            labels = {**request.labels, DECISION_LABEL: json.dumps(decision, separators=(",", ":"))}
            request = msgspec.structs.replace(request, labels=labels)
        else:
            ordered = route.strategy.order(candidates, request, self._outstanding)
        chosen = self._hooks.select_backend(request=request, candidates=candidates)
        if chosen is not None:
            ordered = [chosen] + [name for name in ordered if name != chosen]
        return ordered, request

    async def _attempt(
        self,
        name: str,
        circuit: CircuitBreaker,
        request: GenerationRequest,
        attempts: list[Attempt],
        route: _Route | None = None,
    ) -> RoutedStream | None:
        """Open ``name`` and wait for its first chunk; None after a retryable failure."""
        config = self._configs.get(name)
        timeout = config.first_byte_timeout if config is not None else None
        attempt = len(attempts)
        # Plugins (tracing) may give this try its own trace context for the backend.
        traceparent = self._hooks.on_attempt_start(
            request=request, backend_name=name, attempt=attempt
        )
        if traceparent is not None:
            backend_request = msgspec.structs.replace(request, traceparent=traceparent)
        else:
            backend_request = request
        started = time.monotonic()
        deadline = earliest(
            started + config.total_timeout
            if config is not None and config.total_timeout is not None
            else None,
            request.deadline,
        )
        if deadline != backend_request.deadline:
            # In-process backends check the deadline between tokens and prompt batches.
            backend_request = msgspec.structs.replace(backend_request, deadline=deadline)
        first_deadline = earliest(started + timeout if timeout is not None else None, deadline)
        self._outstanding[name] += 1
        # Plugins may wrap the call (timing, caching); the chain is lazy, so everything
        # below (first-byte timeout, retries, closing) applies to the wrapped stream.
        stream = self._hooks.wrap_generate(
            request=backend_request,
            backend_name=name,
            generate=self._backends[name].generate,
        )
        try:
            with Deadline(first_deadline):
                first = await anext(stream)
        except BaseException as exc:
            self._outstanding[name] -= 1
            await _close(stream)
            error = _as_error(name, exc, timeout)
            self._hooks.on_attempt_end(
                request=request,
                backend_name=name,
                attempt=attempt,
                error=error if error is not None else GenerationAbortedError("cancelled"),
            )
            if error is None:  # cancelled: the client left before an answer
                circuit.release()
                raise
            attempts.append(Attempt(backend_name=name, error=error, duration_s=_since(started)))
            if isinstance(error, UpstreamRateLimitError) and error.retry_after:
                circuit.block_for(error.retry_after)
            if isinstance(error, BackendError) and not isinstance(error, GenerationAbortedError):
                if circuit.record_failure():
                    logger.warning(
                        "backend %r: circuit opened after %d consecutive failures (last: %s)",
                        name,
                        circuit.num_consecutive_failures,
                        error.message,
                    )
                    self._circuit_opened(name)
            else:
                circuit.release()  # the backend answered; the request was at fault
            if error.retryable:
                logger.info("backend %r failed before the first chunk (%s); next", name, error)
                return None
            if error is exc:
                raise
            raise error from exc
        circuit.record_success()
        first_at = time.monotonic()
        attempts.append(Attempt(backend_name=name, error=None, duration_s=first_at - started))
        self._hooks.on_attempt_end(request=request, backend_name=name, attempt=attempt, error=None)
        on_done: Callable[[str, InfermuxError | None, Usage | None], None] = self._on_stream_done
        observe = getattr(route.strategy, "observe", None) if route is not None else None
        if callable(observe):  # the strategy learns each backend's TTFT and TPOT

            def observed(name: str, error: InfermuxError | None, usage: Usage | None) -> None:
                self._on_stream_done(name, error, usage)
                if error is None:
                    tokens = usage.completion_tokens if usage is not None else 0
                    tpot = (time.monotonic() - first_at) / (tokens - 1) if tokens > 1 else None
                    observe(name, ttft_s=first_at - started, tpot_s=tpot)

            on_done = observed
        return RoutedStream(
            backend_name=name,
            request_sent=request,
            attempts=attempts,
            first=first,
            stream=stream,
            on_done=on_done,
            idle_timeout=config.idle_timeout if config is not None else None,
            deadline=deadline,
        )

    def _on_stream_done(self, name: str, error: InfermuxError | None, usage: Usage | None = None) -> None:
        self._outstanding[name] -= 1
        if isinstance(error, BackendError) and not isinstance(error, GenerationAbortedError):
            circuit = self._circuits[name]
            if circuit.record_failure():
                logger.warning("backend %r: circuit opened after a mid-stream failure", name)
                self._circuit_opened(name)


class RoutedStream:
    """The chunks of one routed request; the first one was already fetched by the router.

    Iterate it once. ``aclose()`` aborts the upstream work (HTTP stream closed, generation
    stopped). Errors after the first chunk are never retried. The backend's idle timeout
    (silence between chunks: ``StreamIdleTimeoutError``) and total deadline
    (``UpstreamTimeoutError``) are enforced here for every kind of backend; the upstream
    work is aborted when one passes.

    The deadlines are watched by one loop timer per stream rather than an
    ``asyncio.timeout`` per chunk, which arms and disarms a timer each time (more CPU than
    the rest of a chunk's way through the gateway). The timer is re-armed only when it
    fires before the deadline of the wait in progress (the idle deadline moved on); when a
    wait's deadline has passed it cancels the waiting task at once, as ``asyncio.timeout``
    would, even while another cancellation (the backend's own deadline for the same total
    timeout, a client's disconnect) is unwinding it: backends keep the clean-up that must
    finish out of the waiting task's reach (the ``openai`` backend closes its upstream
    exchange in a task of its own, ``backends._upstream_exchange``).
    """

    def __init__(
        self,
        *,
        backend_name: str,
        attempts: list[Attempt],
        first: GenerationChunk,
        request_sent: GenerationRequest | None = None,
        stream: AsyncIterator[GenerationChunk],
        on_done: Callable[[str, InfermuxError | None, Usage | None], None],
        idle_timeout: float | None = None,
        deadline: float | None = None,
    ) -> None:
        self.backend_name = backend_name
        #: The request as this backend got it (a resumed answer's continuation).
        self.request_sent = request_sent
        self.attempts = attempts
        self._first: GenerationChunk | None = first
        self._stream = stream
        self._on_done: Callable[[str, InfermuxError | None, Usage | None], None] | None = on_done
        #: The usage of the stream's last chunk that had one (the strategy's TPOT).
        self._usage: Usage | None = first.usage
        self._idle_timeout = idle_timeout
        #: ``time.monotonic()`` deadline of the whole stream (total timeout), or None.
        self._deadline = deadline
        #: The loop the stream lives in: asking for the running loop makes a system call
        #: (Python 3.11 checks the process id), once per chunk otherwise.
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        #: The deadline the timer was armed for (monotonic).
        self._timer_at = 0.0
        #: The task waiting for the next chunk, its deadline, its cancel count at the start.
        self._waiter: asyncio.Task[Any] | None = None
        self._wait_deadline = 0.0
        self._cancelling = 0
        #: The waiter the timer cancelled (until it has seen the cancellation).
        self._expired: asyncio.Task[Any] | None = None

    def __aiter__(self) -> RoutedStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        first = self._first
        if first is not None:
            self._first = None
            return first
        if self._on_done is None:
            raise StopAsyncIteration
        idle_deadline = self._watch(asyncio.current_task(self._loop))
        waiter = self._waiter
        try:
            try:
                chunk = await anext(self._stream)
                if chunk.usage is not None:
                    self._usage = chunk.usage
                return chunk
            finally:
                timed_out = self._wait_ended(waiter)
        except (Exception, asyncio.CancelledError) as exc:
            await self._end_with(exc, timed_out, idle_deadline)

    async def feed(self, take: Callable[[GenerationChunk], None]) -> None:
        """Hand every chunk not taken yet to ``take``, in order, under the same deadlines;
        return at the end of the stream, raise as iterating would.

        For a consumer that does nothing but take chunks (an answer sent in one body): one
        loop over the backend's stream instead of a step of this iterator per chunk. The
        watch stays on while ``take`` runs, which must neither wait (no timer fires
        meanwhile) nor raise; each chunk moves the idle deadline on.
        """
        first = self._first
        if first is not None:
            self._first = None
            take(first)
        if self._on_done is None:
            return
        waiter = asyncio.current_task(self._loop)
        idle_deadline = self._watch(waiter)
        try:
            try:
                async for chunk in self._stream:
                    take(chunk)
                    if chunk.usage is not None:
                        self._usage = chunk.usage
                    idle_deadline = self._watch(waiter)
            finally:
                timed_out = self._wait_ended(waiter)
        except (Exception, asyncio.CancelledError) as exc:
            await self._end_with(exc, timed_out, idle_deadline)
        self._finish(None)

    def _watch(self, task: asyncio.Task[Any] | None) -> float | None:
        """Watch ``task``'s wait for the next chunk, from now; its idle deadline (or None)."""
        deadline = self._deadline
        idle_deadline = None
        if self._idle_timeout is not None:
            idle_deadline = time.monotonic() + self._idle_timeout
            if deadline is None or idle_deadline < deadline:
                deadline = idle_deadline
        if deadline is not None and task is not None:
            self._waiter = task
            self._wait_deadline = deadline
            self._cancelling = task.cancelling()
            if self._timer is None or deadline < self._timer_at:
                self._arm(deadline)
        return idle_deadline

    async def _end_with(
        self, exc: Exception | asyncio.CancelledError, timed_out: bool, idle_deadline: float | None
    ) -> NoReturn:
        """The stream ended with ``exc`` (from the backend, or the timer's cancellation when
        ``timed_out``): finish it and raise what the consumer gets."""
        if timed_out or isinstance(exc, TimeoutError):
            error = self._timeout_error(idle_deadline)
            self._finish(error)
            await _close(self._stream)
            raise error from None
        if isinstance(exc, InfermuxError):
            self._finish(exc)
            raise exc
        if isinstance(exc, StopAsyncIteration | asyncio.CancelledError):
            self._finish(None)
            raise exc
        # A backend broke its contract: still a typed error out.
        error = BackendError(f"backend {self.backend_name!r} failed: {exc}")
        self._finish(error)
        raise error from exc

    def _wait_ended(self, task: asyncio.Task[Any] | None) -> bool:
        """The wait of ``task`` ended (a chunk, the end, an error): stop watching it; True
        when it ended because the timer cancelled it."""
        self._waiter = None
        return self._expired is not None and self._timed_out(task)

    def _timed_out(self, task: asyncio.Task[Any] | None) -> bool:
        """After the timer cancelled a wait: True when the wait of ``task`` just ended
        because of it (as asyncio.timeout: unless someone else also cancelled the task)."""
        if task is None or self._expired is not task:
            return False
        self._expired = None
        return task.uncancel() <= self._cancelling

    def _arm(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        loop = self._loop
        self._timer = loop.call_at(loop.time() + (deadline - time.monotonic()), self._on_timer)
        self._timer_at = deadline

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None:
            return  # between chunks: the next wait arms the timer again
        if self._wait_deadline > self._timer_at:
            self._arm(self._wait_deadline)  # armed for an earlier wait's deadline
            return
        self._expired = waiter
        waiter.cancel()

    async def aclose(self) -> None:
        """Abort the upstream work. Idempotent."""
        self._first = None
        if self._on_done is not None:
            self._finish(None)
            await _close(self._stream)

    def _timeout_error(self, idle_deadline: float | None) -> InfermuxError:
        # Which deadline was binding, not a re-read of the clock: the loop may fire a timer
        # up to its clock resolution early, which made a total timeout look like an idle one.
        if self._deadline is not None and (
            idle_deadline is None or self._deadline <= idle_deadline
        ):
            return UpstreamTimeoutError(
                f"backend {self.backend_name!r} did not finish within its total timeout"
            )
        return StreamIdleTimeoutError(
            f"backend {self.backend_name!r} sent nothing for longer than its idle timeout "
            f"({self._idle_timeout:g} s)"
        )

    def _finish(self, error: InfermuxError | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done(self.backend_name, error, self._usage)


def _as_error(name: str, exc: BaseException, timeout: float | None) -> InfermuxError | None:
    """The typed error for a failed first chunk; None when the caller was cancelled."""
    if isinstance(exc, InfermuxError):
        return exc
    if isinstance(exc, TimeoutError):
        return UpstreamTimeoutError(
            f"backend {name!r} sent nothing within its first-byte timeout ({timeout} s)"
        )
    if isinstance(exc, StopAsyncIteration):
        return BackendError(f"backend {name!r} ended the stream without any output")
    if isinstance(exc, asyncio.CancelledError) or not isinstance(exc, Exception):
        return None
    return BackendError(f"backend {name!r} failed: {type(exc).__name__}: {exc}")


async def _close(stream: AsyncIterator[GenerationChunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:  # closing must not mask the error being handled
        logger.debug("closing a backend stream raised", exc_info=True)


def _since(started: float) -> float:
    return time.monotonic() - started

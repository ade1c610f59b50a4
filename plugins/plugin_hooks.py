"""The typed facade the gateway and the router call hooks through.

Why a facade: callers get typed methods with keyword arguments instead of ``pm.hook.*``;
async hookimpls are awaited; notification hooks are isolated per plugin (one plugin raising
or hanging neither stops the others nor reaches the client); chained hooks
(``transform_request``) pass each result to the next implementation.

pluggy's own call (``pm.hook.name(**kwargs)``) stops at the first implementation that
raises and returns coroutines unawaited, so notifications cannot go through it. They follow
pluggy's order instead, read from pluggy (``get_hookimpls()`` reversed: tryfirst first, later
registrations first), and its wrappers: a ``wrapper=True`` (or old-style ``hookwrapper=True``)
implementation runs around the plain ones, outermost first, and receives their answers as
pluggy would give them (a list; ``pluggy.Result`` for old-style wrappers). A wrapper that
raises is logged and the notification goes on without it.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import pluggy

from backends.base import GenerationChunk, GenerationRequest
from backends.deadline import Deadline
from backends.errors import InfermuxError
from plugins.wrap_generate import chain_generate

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from backends.base import Backend, BackendConfig, Usage
    from gateway.config.types import InfermuxConfig
    from plugins.request_summary import RequestSummary
    from plugins.usage_report import UsageQuery, UsageReport

__all__ = ["PluginHooks"]

logger = logging.getLogger("plugins")


class PluginHooks:
    """Typed, async-aware access to the hooks of one plugin manager."""

    def __init__(self, pm: pluggy.PluginManager, *, hook_timeout_s: float = 5.0) -> None:
        self.pm = pm
        self.hook_timeout_s = hook_timeout_s
        #: hook name -> (its implementations as last seen, their call order without wrappers)
        self._orders: dict[str, tuple[list[pluggy.HookImpl], list[pluggy.HookImpl]]] = {}

    # -- registration hooks -------------------------------------------------------------

    def register_backend_kinds(self) -> dict[str, Callable[[BackendConfig], Backend]]:
        """Collect ``kind -> factory`` from every plugin (first registration wins)."""
        return self._collect_registrations("infermux_register_backend_kinds")

    def register_routing_strategies(self) -> dict[str, Callable[[], Any]]:
        """Collect ``strategy name -> factory`` from every plugin (first registration wins)."""
        return self._collect_registrations("infermux_register_routing_strategies")

    def _collect_registrations(self, hook_name: str) -> dict[str, Any]:
        registered: dict[str, Any] = {}

        def register(name: str, factory: Any) -> None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"{hook_name}: register() needs a non-empty name, got {name!r}")
            if not callable(factory):
                raise ValueError(f"{hook_name}: the factory for {name!r} is not callable")
            # pluggy calls built-ins (trylast) last, so a plugin's registration wins.
            registered.setdefault(name, factory)

        getattr(self.pm.hook, hook_name)(register=register)
        return registered

    # -- selection ----------------------------------------------------------------------

    def select_backend(
        self, *, request: GenerationRequest, candidates: Sequence[str]
    ) -> str | None:
        """The first plugin answer naming one of ``candidates``, else ``None``.

        A plugin that raises, answers a name that is not a candidate, or is ``async`` is
        reported and ignored (the strategy decides).
        """
        caller = self.pm.hook.infermux_select_backend
        if not caller.get_hookimpls():
            return None
        try:
            choice = caller(request=request, candidates=list(candidates))
        except Exception:
            logger.exception("infermux_select_backend raised; falling back to the strategy")
            return None
        if inspect.iscoroutine(choice):
            choice.close()
            logger.warning("infermux_select_backend must be synchronous; answer ignored")
            return None
        if choice is not None and choice not in candidates:
            logger.warning(
                "infermux_select_backend answered %r, not one of %s; ignored",
                choice,
                list(candidates),
            )
            return None
        return choice

    def wrap_generate(
        self,
        *,
        request: GenerationRequest,
        backend_name: str,
        generate: Callable[[GenerationRequest], AsyncIterator[GenerationChunk]],
    ) -> AsyncIterator[GenerationChunk]:
        """``generate(request)`` wrapped by every ``infermux_wrap_generate`` (outermost first).

        Without implementations this is ``generate(request)`` itself. Never raises: a
        wrapper's failure surfaces from the stream (see :mod:`plugins.wrap_generate`).
        """
        impls = self._call_order("infermux_wrap_generate")
        if not impls:
            return generate(request)
        return chain_generate(impls, request=request, backend_name=backend_name, generate=generate)

    # -- request path -------------------------------------------------------------------

    async def transform_request(self, *, request: GenerationRequest) -> GenerationRequest:
        """Chain every ``infermux_transform_request``; an ``InfermuxError`` rejects.

        Any other exception, or an async implementation running past ``hook_timeout_s``,
        fails the request (a 500 quoting the request id): a broken policy is never skipped.
        """
        impls = self.pm.hook.infermux_transform_request.get_hookimpls()
        if not impls:
            return request
        for impl in _registration_order(impls):
            result = impl.function(*_arguments(impl, {"request": request}))
            if inspect.isawaitable(result):
                try:
                    with Deadline(time.monotonic() + self.hook_timeout_s):
                        result = await result
                except TimeoutError:
                    raise RuntimeError(
                        f"plugin {impl.plugin_name!r}: infermux_transform_request did not "
                        f"finish within {self.hook_timeout_s:g} s"
                    ) from None
            if result is None:
                continue
            if not isinstance(result, GenerationRequest):
                raise TypeError(
                    f"plugin {impl.plugin_name!r}: infermux_transform_request returned "
                    f"{type(result).__name__}, not a GenerationRequest"
                )
            request = result
        return request

    async def on_response(
        self,
        *,
        request: GenerationRequest,
        backend_name: str,
        usage: Usage | None,
        finish_reason: str | None,
    ) -> None:
        """Notify every plugin that a choice finished (exceptions and timeouts logged)."""
        await self._notify(
            "infermux_on_response",
            {
                "request": request,
                "backend_name": backend_name,
                "usage": usage,
                "finish_reason": finish_reason,
            },
        )

    async def on_error(
        self,
        *,
        request: GenerationRequest,
        backend_name: str | None,
        error: InfermuxError,
        usage: Usage | None = None,
    ) -> None:
        """Notify every plugin that a choice failed or was abandoned."""
        await self._notify(
            "infermux_on_error",
            {"request": request, "backend_name": backend_name, "error": error, "usage": usage},
        )

    # -- request lifecycle (telemetry, accounting) ---------------------------------------

    async def on_request_start(self, *, requests: Sequence[GenerationRequest]) -> None:
        """Tell plugins an HTTP generation request starts (before ``transform_request``)."""
        await self._notify("infermux_on_request_start", {"requests": list(requests)})

    def on_attempt_start(
        self, *, request: GenerationRequest, backend_name: str, attempt: int
    ) -> str | None:
        """Tell plugins a backend is tried; the first ``traceparent`` answered, or None."""
        answers = self._notify_sync(
            "infermux_on_attempt_start",
            {"request": request, "backend_name": backend_name, "attempt": attempt},
        )
        return next((a for a in answers if isinstance(a, str) and a), None)

    def on_attempt_end(
        self,
        *,
        request: GenerationRequest,
        backend_name: str,
        attempt: int,
        error: InfermuxError | None,
    ) -> None:
        """Tell plugins a try ended: first chunk (``error`` None) or failure."""
        self._notify_sync(
            "infermux_on_attempt_end",
            {"request": request, "backend_name": backend_name, "attempt": attempt, "error": error},
        )

    async def on_request_end(self, *, summary: RequestSummary) -> None:
        """Tell plugins the request ended; awaited before the response's final bytes."""
        await self._notify("infermux_on_request_end", {"summary": summary})

    # -- observability and accounting endpoints -----------------------------------------

    def register_metrics(
        self, *, registry: CollectorRegistry, backends: Mapping[str, Backend]
    ) -> None:
        """Let every plugin add its metrics to the app's Prometheus registry."""
        self._notify_sync("infermux_register_metrics", {"registry": registry, "backends": backends})

    async def query_usage(self, *, query: UsageQuery) -> UsageReport | None:
        """The first plugin answer to a usage query, or None (no accounting plugin)."""
        for impl in self._call_order("infermux_query_usage"):
            result = impl.function(*_arguments(impl, {"query": query}))
            if inspect.isawaitable(result):
                result = await result
            if result is not None:
                return cast("UsageReport", result)
        return None

    # -- lifecycle ----------------------------------------------------------------------

    async def startup(self, *, config: InfermuxConfig) -> None:
        """Tell plugins the gateway starts (before backends load)."""
        await self._notify("infermux_startup", {"config": config})

    async def shutdown(self) -> None:
        """Tell plugins the gateway stopped (after backends closed)."""
        await self._notify("infermux_shutdown", {})

    def has_implementations(self, hook_name: str) -> bool:
        """Whether any plugin implements ``hook_name`` (lets callers skip work)."""
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())

    def _call_order(self, hook_name: str) -> list[pluggy.HookImpl]:
        """The hook's implementations in pluggy's call order (tryfirst first, later
        registrations first), wrappers left out.

        Worked out again only when the implementations changed (plugins may be registered
        while the app runs): a request makes a dozen hook calls, so the check is one list
        comparison."""
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        known = self._orders.get(hook_name)
        if known is not None and known[0] == impls:
            return known[1]
        order = [impl for impl in reversed(impls) if not (impl.wrapper or impl.hookwrapper)]
        self._orders[hook_name] = (impls, order)
        return order

    def _wrappers(self, hook_name: str) -> list[pluggy.HookImpl]:
        """The hook's wrapper implementations, outermost first (pluggy's order)."""
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        return [impl for impl in reversed(impls) if impl.wrapper or impl.hookwrapper]

    async def _notify(self, hook_name: str, kwargs: Mapping[str, Any]) -> None:
        wrappers = self._wrappers(hook_name)
        if not wrappers:
            await self._notify_plain(hook_name, kwargs)
            return
        entered = _enter_wrappers(hook_name, wrappers, kwargs)
        answers = await self._notify_plain(hook_name, kwargs)
        _exit_wrappers(hook_name, entered, answers)

    async def _notify_plain(self, hook_name: str, kwargs: Mapping[str, Any]) -> list[Any]:
        answers: list[Any] = []
        for impl in self._call_order(hook_name):
            try:
                result = impl.function(*_arguments(impl, kwargs))
                if result is not None and inspect.isawaitable(result):
                    # Awaited in this task (no task per call, as wait_for would make).
                    with Deadline(time.monotonic() + self.hook_timeout_s):
                        result = await result
                if result is not None:
                    answers.append(result)
            except TimeoutError:
                logger.warning(
                    "plugin %r: %s took longer than %.1f s; abandoned",
                    impl.plugin_name,
                    hook_name,
                    self.hook_timeout_s,
                )
            except Exception:
                logger.exception("plugin %r: %s raised; ignored", impl.plugin_name, hook_name)
        return answers

    def _notify_sync(self, hook_name: str, kwargs: Mapping[str, Any]) -> list[Any]:
        """Call a synchronous hook's implementations in pluggy's order, each isolated, inside
        its wrappers."""
        wrappers = self._wrappers(hook_name)
        entered = _enter_wrappers(hook_name, wrappers, kwargs) if wrappers else []
        answers = self._notify_sync_plain(hook_name, kwargs)
        if entered:
            _exit_wrappers(hook_name, entered, answers)
        return answers

    def _notify_sync_plain(self, hook_name: str, kwargs: Mapping[str, Any]) -> list[Any]:
        answers: list[Any] = []
        for impl in self._call_order(hook_name):
            try:
                result = impl.function(*_arguments(impl, kwargs))
            except Exception:
                logger.exception("plugin %r: %s raised; ignored", impl.plugin_name, hook_name)
                continue
            if inspect.iscoroutine(result):
                result.close()
                logger.warning(
                    "plugin %r: %s must be synchronous; ignored", impl.plugin_name, hook_name
                )
                continue
            if result is not None:
                answers.append(result)
        return answers


def _enter_wrappers(
    hook_name: str, wrappers: list[pluggy.HookImpl], kwargs: Mapping[str, Any]
) -> list[tuple[pluggy.HookImpl, Any]]:
    """Run each wrapper to its ``yield``, outermost first; those that got there, in order."""
    entered: list[tuple[pluggy.HookImpl, Any]] = []
    for impl in wrappers:
        try:
            generator: Any = impl.function(*_arguments(impl, kwargs))
            next(generator)
        except Exception:
            logger.exception("plugin %r: %s wrapper raised before its yield; ignored", impl.plugin_name, hook_name)
            continue
        entered.append((impl, generator))
    return entered


def _exit_wrappers(hook_name: str, entered: list[tuple[pluggy.HookImpl, Any]], answers: list[Any]) -> None:
    """Resume the wrappers innermost first with the plain implementations' answers."""
    result: Any = answers
    for impl, generator in reversed(entered):
        try:
            generator.send(pluggy.Result(result, None) if impl.hookwrapper else result)
        except StopIteration as stop:
            if impl.wrapper and stop.value is not None:
                result = stop.value
            continue
        except Exception:
            logger.exception("plugin %r: %s wrapper raised after its yield; ignored", impl.plugin_name, hook_name)
            continue
        generator.close()
        logger.warning("plugin %r: %s wrapper yielded twice; closed", impl.plugin_name, hook_name)


def _arguments(impl: pluggy.HookImpl, kwargs: Mapping[str, Any]) -> list[Any]:
    # A hookimpl may declare any subset of the spec's arguments, in any order.
    return [kwargs[name] for name in impl.argnames]


def _registration_order(impls: list[pluggy.HookImpl]) -> list[pluggy.HookImpl]:
    # pluggy keeps [trylast (newest first), normal (oldest first), tryfirst (oldest first)].
    plain = [i for i in impls if not (i.wrapper or i.hookwrapper)]
    first = [i for i in plain if i.tryfirst]
    normal = [i for i in plain if not i.tryfirst and not i.trylast]
    last = [i for i in plain if i.trylast][::-1]
    return first + normal + last

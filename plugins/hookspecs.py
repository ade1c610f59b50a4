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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from backends.base import Backend, BackendConfig, GenerationRequest, Usage
    from backends.errors import InfermuxError
    from gateway.config import InfermuxConfig

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

"""``create_app``: the Litestar application, with no import-time side effects.

Creating the app validates everything that can be validated without loading a model
(backend kinds and routing strategies registered by plugins, each backend's options) and
raises :class:`~gateway.config.types.ConfigError` naming the key. The lifespan then tells plugins
the gateway starts, loads the backends in the background (``/ready`` is 503 until they
are), and on shutdown closes them and tells plugins.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

import pluggy
from litestar import Litestar
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from backends.base import Backend, BackendConfig
from backends.errors import InfermuxError
from gateway.config.types import ConfigError, InfermuxConfig
from gateway.config.validate import check_registered_names
from gateway.controllers import CONTROLLERS, GENERATION_ENDPOINTS, responses_endpoint
from gateway.http.content_type import json_body_hook
from gateway.http.endpoint import generation_handlers
from gateway.http.errors import handle_exception
from gateway.http.header_limit import header_limit_middleware
from gateway.http.local_origin import local_origin_middleware
from gateway.http.openapi import complete_openapi
from gateway.state import GatewayState
from plugins.manager import InfermuxPluginManager, PluginHooks, create_plugin_manager
from plugins.policy import offer_engine_policies

__all__ = ["create_app"]

logger = logging.getLogger("gateway")


def create_app(
    config: InfermuxConfig,
    *,
    plugin_manager: pluggy.PluginManager | None = None,
    backends: Mapping[str, Backend] | None = None,
) -> Litestar:
    """Build the gateway for ``config``.

    ``plugin_manager`` (a ``pluggy.PluginManager`` from ``create_plugin_manager``) defaults
    to one with the built-ins and the installed entry-point plugins. ``backends`` replaces
    the named ``[[backends]]`` with ready-made objects (tests); the app still starts and
    closes them.
    """
    pm = (
        plugin_manager
        if plugin_manager is not None
        else create_plugin_manager(config=config.plugins)
    )
    if not isinstance(pm, pluggy.PluginManager):
        raise TypeError("plugin_manager must be a pluggy.PluginManager")
    if isinstance(pm, InfermuxPluginManager):
        pm.drop_invalid_plugins()  # plugins registered after creation are checked too
    else:
        pm.check_pending()
    hooks = PluginHooks(pm, hook_timeout_s=config.plugins.hook_timeout_s)
    check_registered_names(
        config,
        backend_kinds=hooks.register_backend_kinds(),
        routing_strategies=hooks.register_routing_strategies(),
    )
    state = GatewayState(
        config=config,
        hooks=hooks,
        backends=_build_backends(config, hooks, backends or {}),
        backend_configs={b.name: b for b in config.backends},
    )
    # Engines (core_engine, llama.cpp) get the plugin-backed quantization/offload/speculation
    # policies: this manager's, or in a worker process its own over the same [plugins].
    offer_engine_policies(state.backends, pm, config.plugins)
    hooks.register_metrics(registry=state.metrics_registry, backends=state.backends)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await hooks.startup(config=config)
        state.start_loading()
        try:
            yield
        finally:
            await state.shutdown()

    # The Responses endpoint is built per app: it reads and writes this app's stored responses.
    endpoints = (*GENERATION_ENDPOINTS, responses_endpoint(state.response_store))
    middleware = [header_limit_middleware(config.limits.max_header_bytes)]
    if state.key_store.is_open:  # no keys: only local programs, never a web page (403)
        middleware.append(local_origin_middleware())
    app = Litestar(
        route_handlers=[*generation_handlers(endpoints, state), *CONTROLLERS],
        dependencies={"gateway": Provide(lambda: state, use_cache=True, sync_to_thread=False)},
        exception_handlers={Exception: handle_exception},
        # Header size first (431), in open mode Host and Origin (403), then the API key
        # (401/403: the /v1/ controllers' guard, the generation endpoints' own check), then
        # a POST's Content-Type (415: this hook, the generation endpoints' own check), then
        # the handler.
        middleware=middleware,
        before_request=json_body_hook,
        lifespan=[lifespan],
        state=State({"gateway": state}),
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=OpenAPIConfig(title="infermux", version=_version()),
        # Logging is configured by the CLI (or the embedding program), not by the app.
        logging_config=None,
        debug=False,
    )
    complete_openapi(app, endpoints)
    return app


def _build_backends(
    config: InfermuxConfig, hooks: PluginHooks, given: Mapping[str, Backend]
) -> dict[str, Backend]:
    """Construct (cheaply, nothing loads yet) every configured backend."""
    configured = {b.name for b in config.backends}
    for name in given:
        if name not in configured:
            raise ConfigError(
                f"backends: a backend object was given for {name!r}, which has no "
                "[[backends]] entry",
                key="backends",
            )
    kinds = hooks.register_backend_kinds()
    built: dict[str, Backend] = {}
    for i, backend_config in enumerate(config.backends):
        if backend_config.name in given:
            built[backend_config.name] = given[backend_config.name]
            continue
        built[backend_config.name] = _construct(i, backend_config, kinds[backend_config.kind])
    for i, backend_config in enumerate(config.backends):
        bind = getattr(built[backend_config.name], "bind_backends", None)
        if callable(bind):  # a backend over others (kind "disaggregated"): give it them
            try:
                bind(built)
            except ValueError as exc:
                raise ConfigError(str(exc), key=f"backends[{i}].options") from exc
    return built


def _construct(index: int, backend_config: BackendConfig, factory: object) -> Backend:
    try:
        backend: Backend = factory(backend_config)  # type: ignore[operator]
    except InfermuxError as exc:  # the kind's library is missing: message has the hint
        raise ConfigError(
            f"backends[{index}].kind: {exc.message}", key=f"backends[{index}].kind"
        ) from exc
    except ValueError as exc:  # bad options: the message names backends.<name>.options.<key>
        message = str(exc)
        if not message.startswith("backends"):
            message = f"backends[{index}].options: {message}"
        raise ConfigError(message, key=f"backends[{index}].options") from exc
    resolve = getattr(factory, "resolve", None)  # a lazily imported kind: its real factory
    if callable(resolve):
        factory = resolve()
    in_worker = backend_config.worker_process
    if in_worker is None:  # the backend's own option (core_engine: engine_process), or its kind's
        in_worker = bool(getattr(backend, "worker_process_default", getattr(factory, "worker_process_default", False)))
    if not in_worker:
        return backend
    from backends.worker import WorkerBackend

    try:
        return WorkerBackend(backend_config, factory, backend)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(
            f"backends[{index}].worker_process: {exc}", key=f"backends[{index}].worker_process"
        ) from exc


def _version() -> str:
    try:
        return version("infermux")
    except PackageNotFoundError:
        return "0.0.0"

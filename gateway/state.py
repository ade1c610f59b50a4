"""What the running gateway holds: config, hooks, backends, the router, readiness.

One :class:`GatewayState` per app, created by ``create_app`` and injected into handlers
(Litestar ``Provide``). Backends load in the background after start-up so that ``/health``
answers and ``/ready`` says "loading" meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from backends.base import (
    Backend,
    BackendConfig,
    Capabilities,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
    ModelInfo,
)
from backends.errors import BackendConfigError, BackendUnavailableError, ServerOverloadedError
from backends.worker import WorkerBackend
from gateway.config.types import ConfigError, InfermuxConfig
from gateway.http.auth import KeyStore
from gateway.openai.response_store import open_response_store
from gateway.serving.admission import Admission, KeyRateLimiter
from gateway.serving.shared_limits import SharedKeyRateLimiter
from plugins.builtin.cost.plugin import resolve_ledger_path
from plugins.shared_state import StateConfigError, open_state

if TYPE_CHECKING:
    from gateway.serving.router import ModelRouter
    from plugins.manager import PluginHooks

__all__ = ["FailedBackend", "GatewayState"]

logger = logging.getLogger("gateway")


class FailedBackend:
    """Stands in for a backend whose ``start()`` failed: every request gets a retryable 503.

    The router then falls back to the alias's other backends and opens this one's circuit,
    exactly as for a backend that went down later.
    """

    def __init__(self, name: str, kind: str, reason: str) -> None:
        self.name = name
        self.kind = kind
        self.reason = reason
        # Claims everything, so that requests reach it and fail over as "unavailable" rather
        # than being refused as "unsupported".
        self.capabilities = Capabilities(
            logprobs=True, echo=True, structured_outputs=True, tools=True, max_top_logprobs=20
        )

    async def start(self) -> None:
        """Nothing to start."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Fails before the first chunk."""
        return self._fail()

    async def _fail(self) -> AsyncIterator[GenerationChunk]:
        raise BackendUnavailableError(f"backend {self.name!r} failed to start: {self.reason}")
        yield  # pragma: no cover - makes this an async generator

    def model_info(self) -> ModelInfo:
        """Only the name is known."""
        return ModelInfo(id=self.name)

    async def health(self) -> HealthStatus:
        """Always unhealthy."""
        return HealthStatus(ok=False, detail=self.reason)

    async def aclose(self) -> None:
        """Nothing to free."""


class GatewayState:
    """The gateway's runtime state (one per app)."""

    def __init__(
        self,
        *,
        config: InfermuxConfig,
        hooks: PluginHooks,
        backends: Mapping[str, Backend],
        backend_configs: Mapping[str, BackendConfig],
    ) -> None:
        self.config = config
        self.hooks = hooks
        self.backends: dict[str, Backend] = dict(backends)
        self.backend_configs = dict(backend_configs)
        #: Backend name -> "loading" | "ready" | "failed: <why>".
        self.backend_status: dict[str, str] = {name: "loading" for name in backends}
        self.router: ModelRouter | None = None
        #: Set when loading ended with no router (the reason is logged and shown by /ready).
        self.load_error: str | None = None
        #: Set when a backend that is not ``optional`` cannot start as configured
        #: (``BackendConfigError``): ``infermux serve`` exits non-zero on it.
        self.startup_error: str | None = None
        #: Set on SIGTERM: /ready turns 503 and new generation requests are refused.
        self.draining = False
        #: API keys (gateway/http/auth.py) and admission: per-key limits, global concurrency.
        self.key_store = KeyStore(config.auth.keys)
        #: The Responses API's stored responses, where the ledger is: Postgres with ``[cost]
        #: database`` (shared by replicas), else its SQLite file; opened on first use, called
        #: on worker threads.
        self.response_store = open_response_store(config, resolve_ledger_path(config.cost))
        #: ``[state] backend = "redis"``: the per-key limits every replica shares.
        try:
            self.shared_state = open_state(config.state)
        except StateConfigError as exc:
            raise ConfigError(str(exc), key=exc.key) from exc
        self.admission = Admission(
            config.limits,
            KeyRateLimiter(config.auth.keys) if self.shared_state is None
            else SharedKeyRateLimiter(config.auth.keys, self.shared_state),
        )
        self.started_at = int(time.time())
        #: This app's Prometheus registry (``GET /metrics``); plugins add to it through
        #: ``infermux_register_metrics``. Never the global one: apps may share a process.
        self.metrics_registry = CollectorRegistry(auto_describe=True)
        self._load_task: asyncio.Task[None] | None = None
        #: With shared state: the loop that opens circuits other replicas opened.
        self._circuit_sync_task: asyncio.Task[None] | None = None

    @property
    def is_ready(self) -> bool:
        """Routing works, every model has a started backend, and the process is not shutting down."""
        return self.router is not None and not self.draining and not self.models_without_backend()

    def backend_state(self, name: str) -> str:
        """"ready", "loading", "failed: <why>", or why a started worker is not up now."""
        status = self.backend_status.get(name, "loading")
        backend = self.backends.get(name)
        if status == "ready" and isinstance(backend, WorkerBackend) and backend.state != "up":
            return f"{backend.state}: {backend.health_detail}"
        return status

    def models_without_backend(self) -> dict[str, str]:
        """Alias -> why none of its backends can serve now, for each alias in that state."""
        missing: dict[str, str] = {}
        for model in self.config.models:
            states = {name: self.backend_state(name) for name in model.backends}
            if not any(state == "ready" for state in states.values()):
                missing[model.alias] = "no started backend: " + "; ".join(
                    f"{name} {state}" for name, state in states.items()
                )
        return missing

    def require_router(self) -> ModelRouter:
        """The router, or a 503 while loading / draining."""
        if self.draining:
            raise ServerOverloadedError("infermux is shutting down", retry_after=1)
        if self.router is None:
            if self.load_error is not None:
                raise BackendUnavailableError(f"infermux failed to start: {self.load_error}")
            raise BackendUnavailableError("infermux is still loading its backends", retry_after=1)
        return self.router

    def model_backends(self) -> dict[str, list[str]]:
        """Alias -> backend names, from the config (known before loading ends)."""
        return {model.alias: list(model.backends) for model in self.config.models}

    # -- lifecycle ----------------------------------------------------------------------

    def start_loading(self) -> None:
        """Start every backend in the background, then build the router."""
        self._load_task = asyncio.create_task(self._load(), name="infermux-load-backends")

    async def wait_loaded(self) -> None:
        """Wait until loading ended (successfully or not)."""
        if self._load_task is not None:
            await asyncio.shield(self._load_task)

    async def _load(self) -> None:
        total = len(self.backends)
        for number, (name, backend) in enumerate(list(self.backends.items()), start=1):
            logger.info("backend %d/%d %r (%s): starting", number, total, name, backend.kind)
            began = time.monotonic()
            try:
                await backend.start()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                logger.error("backend %r failed to start: %s", name, reason)
                self.backend_status[name] = f"failed: {reason}"
                config = self.backend_configs.get(name)
                if isinstance(exc, BackendConfigError) and not (config and config.optional):
                    self.startup_error = self.startup_error or (
                        f"backend {name!r} cannot start as configured: {exc} (mark it "
                        f"`optional = true` to serve without it)"
                    )
                self.backends[name] = FailedBackend(name, backend.kind, reason)
                await _close_quietly(backend)
                continue
            self.backend_status[name] = "ready"
            logger.info(
                "backend %d/%d %r ready in %.1f s", number, total, name, time.monotonic() - began
            )
        try:
            from gateway.serving.router import ModelRouter
            from plugins.builtin.cost.pricing import PriceBook

            prices = PriceBook(self.config.cost.prices)

            def price_of(alias: str, backend: str) -> tuple[float, float] | None:
                rule = prices.rule_for(alias, backend)
                return None if rule is None else (rule.input_per_mtok, rule.output_per_mtok)

            self.router = ModelRouter(
                models=self.config.models,
                backends=self.backends,
                backend_configs=self.backend_configs,
                hooks=self.hooks,
                price_of=price_of,
            )
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            logger.exception("building the router failed")
            return
        if self.shared_state is not None:
            from gateway.serving.shared_circuit import CircuitSync

            sync = CircuitSync(self.shared_state, self.router, list(self.backends))
            self._circuit_sync_task = asyncio.create_task(
                sync.run(), name="infermux-circuit-sync"
            )
        if self.startup_error is not None:
            logger.error("infermux cannot start: %s", self.startup_error)
            return
        for alias, why in self.models_without_backend().items():
            logger.error("model %r cannot be served: %s", alias, why)
        if self.is_ready:
            aliases = ", ".join(m.alias for m in self.config.models) or "(none)"
            logger.info("infermux ready: models %s", aliases)

    async def shutdown(self) -> None:
        """Stop loading, close every backend, tell plugins."""
        self.draining = True
        if self._circuit_sync_task is not None:
            self._circuit_sync_task.cancel()
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
            try:
                await self._load_task
            except asyncio.CancelledError:
                pass
        for backend in self.backends.values():
            await _close_quietly(backend)
        await self.hooks.shutdown()
        await self.response_store.aclose()
        if self.shared_state is not None:
            await self.shared_state.aclose()


async def _close_quietly(backend: Backend) -> None:
    try:
        await backend.aclose()
    except Exception:
        logger.exception("closing backend %r failed", backend.name)

"""The routing config: one TOML file decoded into frozen msgspec Structs, validated at start-up.

Every error is a :class:`ConfigError` whose message starts with the key path at fault
(``backends[1].kind: unknown backend kind 'foo'``), so a person can find the line to change.

Resolution order (later wins): the embedded default or the file (``--config FILE``, else
``INFERMUX_CONFIG``), then the environment (``INFERMUX_HOST``, ``INFERMUX_PORT``), then the
command line (``--host``, ``--port``, applied by the CLI). A file without ``[[backends]]``
and ``[[models]]`` tables keeps the embedded default model, so a file may tune only
``[server]``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from backends import mlx as mlx_backend
from backends.base import BackendConfig
from backends.default_model import DEFAULT_MODEL_ALIAS, default_model_path
from gateway.observability_config import TelemetryConfig
from gateway.validation_message import split_validation_message
from plugins.builtin.cost.config import CostConfig

__all__ = [
    "ApiKeyConfig",
    "AuthConfig",
    "ConfigError",
    "InfermuxConfig",
    "LimitsConfig",
    "ModelConfig",
    "PluginsConfig",
    "ReasoningConfig",
    "ServerConfig",
    "StateConfig",
    "check_registered_names",
    "config_from_dict",
    "default_config",
    "load_config",
]

#: Environment variables that override the config (documented in the README).
ENV_CONFIG = "INFERMUX_CONFIG"
ENV_HOST = "INFERMUX_HOST"
ENV_PORT = "INFERMUX_PORT"

# Backend names travel in the ``x-infermux-backend`` header and in metric labels.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
_BACKEND_KEYS = frozenset(BackendConfig.__struct_fields__)
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
_TIMEOUT_KEYS = ("connect_timeout", "first_byte_timeout", "idle_timeout", "total_timeout")


class ConfigError(Exception):
    """The config is invalid; the message starts with the key path (``models[0].backends``)."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[server]``: where the gateway listens and how much it accepts."""

    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    #: Larger request bodies are answered 413.
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1)] = 4 * 1024 * 1024
    #: On SIGTERM: readiness turns 503 and in-flight requests get this long to finish.
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[[models]]``: an alias clients send as ``model`` and the backends that serve it."""

    alias: str
    #: Backend names (from ``[[backends]]``) in priority order.
    backends: list[str]
    #: "priority" (fallback in order) | "round_robin" | "least_outstanding" | "slo_cost" |
    #: "cache_aware" | a plugin's.
    strategy: str = "priority"
    #: Extra attempts on other backends, only before the first byte reached the client.
    max_retries: Annotated[int, msgspec.Meta(ge=0)] = 2
    #: The alias's latency SLO (``slo_cost`` routes to the cheapest backend predicted to
    #: meet it; the headers ``x-infermux-ttft-slo-ms`` / ``x-infermux-tpot-slo-ms`` override).
    ttft_slo_ms: Annotated[float, msgspec.Meta(gt=0)] | None = None
    tpot_slo_ms: Annotated[float, msgspec.Meta(gt=0)] | None = None
    #: ``cache_aware``: a replica more than this factor above the least-loaded one (open
    #: streams, each counting the new request) loses its prefix affinity.
    cache_load_factor: Annotated[float, msgspec.Meta(ge=1)] = 1.5
    #: A backend failing mid-stream (after the first byte) hands the answer to the next
    #: backend of the alias, which continues it: from the same token ids when it serves
    #: the same model, else from the partial text (gateway/stream_resume.py). Off: the
    #: client gets an error frame, as before.
    resume_on_failure: bool = False


class PluginsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[plugins]``: which plugins load, their settings, and what they may see (docs/plugins.md)."""

    #: Plugin names (entry-point names, ``builtin.<module>``, config modules) not registered.
    disable: list[str] = []
    #: When set, only these entry-point plugins are loaded (built-ins and ``modules`` are
    #: always loaded unless disabled); None: every installed one.
    enable: list[str] | None = None
    #: Plugins loaded by import path, ``"pkg.module"`` or ``"pkg.module:attribute"``
    #: (source "config"), for plugins that are not packaged with an entry point.
    modules: list[str] = []
    #: ``[plugins.settings.<plugin name>]`` tables: given to a plugin's
    #: ``create_plugin(settings)`` and, as part of the config, to ``infermux_startup``.
    settings: dict[str, dict[str, Any]] = {}
    #: A plugin that fails to load stops start-up instead of being skipped.
    strict: bool = False
    #: Request headers copied into ``GenerationRequest.labels`` (lower-cased name -> value)
    #: for plugins to read, e.g. ``["x-tenant-id"]``. Credential headers are refused.
    request_headers: list[str] = []
    #: An async hook (on_response, on_error, startup, shutdown) taking longer is abandoned.
    hook_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0


class LimitsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[limits]``: caps on requests (over a parameter cap: 400 naming the parameter) and on
    the load the gateway admits (docs/security.md lists every default)."""

    max_n: Annotated[int, msgspec.Meta(ge=1)] = 16
    #: Choices per request: ``n`` times the number of prompts of a completions request.
    max_choices: Annotated[int, msgspec.Meta(ge=1)] = 64
    max_stop_sequences: Annotated[int, msgspec.Meta(ge=0)] = 16
    max_stop_chars: Annotated[int, msgspec.Meta(ge=1)] = 1000
    max_top_logprobs: Annotated[int, msgspec.Meta(ge=0)] = 20
    #: Request line plus headers, in bytes; more is answered 431.
    max_header_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 16 * 1024
    #: Chat messages per request.
    max_messages: Annotated[int, msgspec.Meta(ge=1)] = 2048
    #: The largest ``max_tokens`` / ``max_completion_tokens`` a request may ask for (the
    #: model's context window still applies on top).
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] = 32768
    #: ``response_format`` as JSON, in bytes, and its deepest nesting.
    max_response_format_bytes: Annotated[int, msgspec.Meta(ge=64)] = 64 * 1024
    max_response_format_depth: Annotated[int, msgspec.Meta(ge=2)] = 32
    #: Tools offered per chat request (each one's ``parameters`` is held to the two
    #: ``response_format`` caps above).
    max_tools: Annotated[int, msgspec.Meta(ge=1)] = 128
    #: Generation requests served at once; more wait in a queue ...
    max_concurrent_requests: Annotated[int, msgspec.Meta(ge=1)] = 256
    #: ... of this length (full: 503 server_is_overloaded) ...
    max_queued_requests: Annotated[int, msgspec.Meta(ge=0)] = 1024
    #: ... for at most this long (then 503 server_is_overloaded).
    queue_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0


class ApiKeyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One ``[[auth.keys]]`` table: a client key, stored as its SHA-256 (never the key).

    ``infermux key new`` makes a key and prints this table; ``infermux key hash`` hashes an
    existing one.
    """

    #: Names the key in logs, usage records and metrics (never secret).
    id: str
    #: Lower-case hex SHA-256 of the key's UTF-8 bytes.
    key_sha256: str
    #: Who pays: budgets and usage are kept per tenant.
    tenant: str = "default"
    #: Requests per minute and tokens (prompt + completion) per minute; None: unlimited.
    rpm: Annotated[int, msgspec.Meta(ge=1)] | None = None
    tpm: Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: Generation requests of this key in flight at once (across replicas with
    #: ``[state] backend = "redis"``); one more is refused with 429. None: no cap.
    max_concurrent: Annotated[int, msgspec.Meta(ge=1)] | None = None


class AuthConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[auth]``: API keys. Without keys the gateway is open, and then serves loopback only."""

    keys: list[ApiKeyConfig] = []


ReasoningEffort = Literal["minimal", "low", "medium", "high"]


class ReasoningConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[reasoning]``: thinking budgets (reasoning tokens) a chat's ``reasoning_effort``
    stands for on native backends; ``max_reasoning_tokens`` in a request overrides it."""

    effort_budgets: dict[ReasoningEffort, Annotated[int, msgspec.Meta(ge=0)]] = msgspec.field(
        default_factory=lambda: {"minimal": 0, "low": 256, "medium": 1024, "high": 4096}
    )


class StateConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[state]``: where per-key rate limits and budget totals live (docs/scale-out.md).

    "memory" keeps them in this process: right for one gateway. "redis" keeps them in one
    Redis that every replica shares, so two replicas behind a load balancer grant a key its
    limit once, not twice.
    """

    backend: Literal["memory", "redis"] = "memory"
    #: The environment variable holding the ``redis://`` (or ``rediss://``) URL: the URL may
    #: carry a password, so it never sits in the config file (as ``api_key_env``).
    url_env: str | None = None
    #: Redis unreachable: "closed" refuses generation requests (503
    #: ``state_store_unavailable``); "open" admits them on this replica's own limits.
    on_unavailable: Literal["closed", "open"] = "closed"
    #: Prefix of every key infermux writes (several deployments may share one Redis).
    key_prefix: str = "infermux:"
    #: Connect and command timeout of one Redis call.
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 0.5
    #: After a failed call, Redis is not tried again for this long (the configured
    #: behaviour applies meanwhile); then the next request tries it.
    retry_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0


class InfermuxConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole routing config."""

    server: ServerConfig = ServerConfig()
    backends: list[BackendConfig] = []
    models: list[ModelConfig] = []
    plugins: PluginsConfig = PluginsConfig()
    limits: LimitsConfig = LimitsConfig()
    reasoning: ReasoningConfig = ReasoningConfig()
    auth: AuthConfig = AuthConfig()
    #: Traces, metrics export and SLOs (gateway/observability_config.py).
    telemetry: TelemetryConfig = TelemetryConfig()
    #: Prices, the usage ledger and budgets (gateway/observability_config.py).
    cost: CostConfig = CostConfig()
    #: Shared state of replicas: rate limits and budgets in memory or in Redis.
    state: StateConfig = StateConfig()


def default_backends() -> list[BackendConfig]:
    """The embedded default backends, in priority order (later issues append here)."""
    try:
        model_path = default_model_path()
    except FileNotFoundError as exc:
        raise ConfigError(f"backends[0].options.model_path: {exc}") from exc
    backends = [
        # Under load, requests wait for one of its slots, as on llama-server -np 16: no
        # first-byte timeout, so a queued request does not spill onto the other engines on
        # the same cores (measured at 64 streams: 0.80x llama-server with the spill-over,
        # docs/benchmarks.md). total_timeout still bounds a request.
        BackendConfig(
            name="llamacpp",
            kind="llamacpp",
            options={"model_path": str(model_path), "n_ctx": 2048, "n_threads": 2},
            first_byte_timeout=None,
        ),
    ]
    # The native engine serves the same file (pin it with `x-infermux-backend: core_engine`).
    backends.append(
        BackendConfig(
            name="core_engine",
            kind="core_engine",
            options={"model_path": str(model_path), "num_threads": 2},
        )
    )
    # MLX serves the same file when the `mlx` extra is installed (a cheap check: nothing
    # of MLX is imported here); without it the alias is served by the others.
    if mlx_backend.is_installed():
        backends.append(mlx_backend.default_backend_config(model_path))
    return backends


def default_config() -> InfermuxConfig:
    """No config file: the default model (alias ``smollm2``) on the default backends."""
    backends = default_backends()
    return InfermuxConfig(
        backends=backends,
        models=[ModelConfig(alias=DEFAULT_MODEL_ALIAS, backends=[b.name for b in backends])],
    )


def load_config(
    path: Path | None,
    *,
    env: Mapping[str, str] = os.environ,
    backend_kinds: Collection[str] | None = None,
    routing_strategies: Collection[str] | None = None,
) -> InfermuxConfig:
    """Load ``path`` (else ``$INFERMUX_CONFIG``, else the default) and apply env overrides.

    ``backend_kinds`` / ``routing_strategies``, when given (the names plugins registered),
    are checked too; ``create_app`` checks them anyway.
    """
    if path is None and env.get(ENV_CONFIG):
        path = Path(env[ENV_CONFIG])
    if path is None:
        config = default_config()
    else:
        try:
            text = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
        try:
            raw = msgspec.toml.decode(text)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
        config = config_from_dict(raw)
    config = _apply_env(config, env)
    if backend_kinds is not None or routing_strategies is not None:
        check_registered_names(
            config, backend_kinds=backend_kinds, routing_strategies=routing_strategies
        )
    return config


def config_from_dict(raw: Mapping[str, Any]) -> InfermuxConfig:
    """Validate a decoded TOML document (or a dict built by a test) into the config."""
    raw = dict(raw)
    if "backends" not in raw and "models" not in raw:
        defaults = default_config()
        raw["backends"] = [msgspec.to_builtins(b) for b in defaults.backends]
        raw["models"] = [msgspec.to_builtins(m) for m in defaults.models]
    _check_backend_keys(raw.get("backends"))
    try:
        config = msgspec.convert(raw, InfermuxConfig)
    except msgspec.ValidationError as exc:
        key, reason = split_validation_message(str(exc))
        raise ConfigError(f"{key}: {reason}" if key else reason, key=key) from exc
    _validate(config)
    _validate_cost(config)
    return config


def check_registered_names(
    config: InfermuxConfig,
    *,
    backend_kinds: Collection[str] | None = None,
    routing_strategies: Collection[str] | None = None,
) -> None:
    """Every backend kind and routing strategy the config names must be registered."""
    if backend_kinds is not None:
        for i, backend in enumerate(config.backends):
            if backend.kind not in backend_kinds:
                known = ", ".join(sorted(backend_kinds))
                raise ConfigError(
                    f"backends[{i}].kind: unknown backend kind {backend.kind!r} (known: {known})",
                    key=f"backends[{i}].kind",
                )
    if routing_strategies is not None:
        for i, model in enumerate(config.models):
            if model.strategy not in routing_strategies:
                known = ", ".join(sorted(routing_strategies))
                raise ConfigError(
                    f"models[{i}].strategy: unknown routing strategy {model.strategy!r} "
                    f"(known: {known})",
                    key=f"models[{i}].strategy",
                )


def _check_backend_keys(backends: Any) -> None:
    # BackendConfig (backends/base.py) ignores unknown keys; a typo such as
    # ``frist_byte_timeout`` must not silently fall back to the default.
    if not isinstance(backends, list):
        return
    for i, table in enumerate(backends):
        if isinstance(table, dict):
            for key in table:
                if key not in _BACKEND_KEYS:
                    raise ConfigError(
                        f"backends[{i}].{key}: unknown key", key=f"backends[{i}].{key}"
                    )


def _fail(key: str, reason: str) -> ConfigError:
    return ConfigError(f"{key}: {reason}", key=key)


def _validate(config: InfermuxConfig) -> None:
    seen_backends: dict[str, int] = {}
    for i, backend in enumerate(config.backends):
        if not _NAME.fullmatch(backend.name):
            raise _fail(
                f"backends[{i}].name",
                f"{backend.name!r} is not a valid name (letters, digits, '_', '.', '-'; "
                "at most 64)",
            )
        if backend.name in seen_backends:
            raise _fail(
                f"backends[{i}].name",
                f"duplicate backend name {backend.name!r} (also backends[{seen_backends[backend.name]}])",
            )
        seen_backends[backend.name] = i
        if not backend.kind:
            raise _fail(f"backends[{i}].kind", "must not be empty")
        for key in _TIMEOUT_KEYS:
            value = getattr(backend, key)
            if value is not None and value <= 0:
                raise _fail(f"backends[{i}].{key}", f"must be > 0 seconds (or absent), got {value}")
        if backend.circuit_failure_threshold < 1:
            raise _fail(f"backends[{i}].circuit_failure_threshold", "must be >= 1")
        if backend.circuit_cooldown_s < 0:
            raise _fail(f"backends[{i}].circuit_cooldown_s", "must be >= 0")
        if backend.max_concurrency is not None and backend.max_concurrency < 1:
            raise _fail(f"backends[{i}].max_concurrency", "must be >= 1 (or absent)")

    _validate_auth(config.auth)
    _validate_plugins(config.plugins)
    if config.state.backend == "redis" and not config.state.url_env:
        raise _fail(
            "state.url_env",
            'backend = "redis" needs the name of the environment variable holding the '
            "redis:// URL",
        )

    seen_aliases: dict[str, int] = {}
    for i, model in enumerate(config.models):
        if not model.alias.strip():
            raise _fail(f"models[{i}].alias", "must not be empty")
        if model.alias in seen_aliases:
            raise _fail(
                f"models[{i}].alias",
                f"duplicate model alias {model.alias!r} (also models[{seen_aliases[model.alias]}])",
            )
        seen_aliases[model.alias] = i
        if not model.backends:
            raise _fail(f"models[{i}].backends", "must name at least one backend")
        listed: set[str] = set()
        for name in model.backends:
            if name not in seen_backends:
                raise _fail(f"models[{i}].backends", f"unknown backend {name!r}")
            if name in listed:
                raise _fail(f"models[{i}].backends", f"backend {name!r} is listed twice")
            listed.add(name)
        if model.resume_on_failure and (len(model.backends) < 2 or model.max_retries < 1):
            raise _fail(
                f"models[{i}].resume_on_failure",
                "needs a backend to resume on: at least two backends and max_retries >= 1",
            )


#: Headers that carry credentials or session state: never handed to plugins as labels.
_SECRET_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key"}
)
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


def _validate_plugins(plugins: PluginsConfig) -> None:
    for i, module in enumerate(plugins.modules):
        path, _, attribute = module.partition(":")
        if not all(part.isidentifier() for part in path.split(".")) or (
            attribute and not all(part.isidentifier() for part in attribute.split("."))
        ):
            raise _fail(
                f"plugins.modules[{i}]",
                f"{module!r} is not an import path ('pkg.module' or 'pkg.module:attribute')",
            )
    for i, header in enumerate(plugins.request_headers):
        if not _HEADER_NAME.fullmatch(header):
            raise _fail(f"plugins.request_headers[{i}]", f"{header!r} is not a header name")
        if header.lower() in _SECRET_HEADERS:
            raise _fail(
                f"plugins.request_headers[{i}]",
                f"{header!r} carries credentials and is never copied into request labels",
            )


def _validate_auth(auth: AuthConfig) -> None:
    seen_ids: dict[str, int] = {}
    seen_hashes: dict[str, int] = {}
    for i, key in enumerate(auth.keys):
        if not _NAME.fullmatch(key.id):
            raise _fail(
                f"auth.keys[{i}].id",
                f"{key.id!r} is not a valid id (letters, digits, '_', '.', '-'; at most 64)",
            )
        if key.id in seen_ids:
            raise _fail(f"auth.keys[{i}].id", f"duplicate key id {key.id!r}")
        seen_ids[key.id] = i
        if not _SHA256_HEX.fullmatch(key.key_sha256):
            raise _fail(
                f"auth.keys[{i}].key_sha256",
                "expected the 64 hex digits of a SHA-256 (`infermux key hash` prints it); "
                "never put the key itself in the config",
            )
        digest = key.key_sha256.lower()
        if digest in seen_hashes:
            raise _fail(
                f"auth.keys[{i}].key_sha256",
                f"the same key is also auth.keys[{seen_hashes[digest]}]",
            )
        seen_hashes[digest] = i
        if not _NAME.fullmatch(key.tenant):
            raise _fail(f"auth.keys[{i}].tenant", f"{key.tenant!r} is not a valid tenant name")


def _apply_env(config: InfermuxConfig, env: Mapping[str, str]) -> InfermuxConfig:
    server = config.server
    if env.get(ENV_HOST):
        server = msgspec.structs.replace(server, host=env[ENV_HOST])
    if env.get(ENV_PORT):
        raw_port = env[ENV_PORT]
        try:
            port = int(raw_port)
        except ValueError:
            port = None
        if port is None or not 0 <= port <= 65535:
            raise ConfigError(
                f"{ENV_PORT}: expected a port number 0-65535, got {raw_port!r}", key=ENV_PORT
            )
        server = msgspec.structs.replace(server, port=port)
    if server is config.server:
        return config
    return msgspec.structs.replace(config, server=server)


def _validate_cost(config: InfermuxConfig) -> None:
    """``[cost]``'s cross-checks against the backends, aliases and keys."""
    backends = {b.name for b in config.backends}
    aliases = {m.alias for m in config.models}
    seen: dict[tuple[str | None, str | None], int] = {}
    for i, price in enumerate(config.cost.prices):
        key = f"cost.prices[{i}]"
        if price.model is None and price.backend is None:
            raise _fail(key, "name a model, a backend or both")
        if price.model is not None and price.model not in aliases:
            raise _fail(f"{key}.model", f"unknown model alias {price.model!r}")
        if price.backend is not None and price.backend not in backends:
            raise _fail(f"{key}.backend", f"unknown backend {price.backend!r}")
        if price.per_hour is not None and price.backend is None:
            raise _fail(f"{key}.per_hour", "a price per hour needs a backend")
        pair = (price.model, price.backend)
        if pair in seen:
            raise _fail(key, f"the same model/backend as cost.prices[{seen[pair]}]")
        seen[pair] = i
    database = config.cost.database
    if database is not None and not database.startswith(("postgresql://", "postgres://")):
        raise _fail("cost.database", "expected a postgresql:// URL (SQLite: ledger_path)")
    key_ids = {k.id for k in getattr(getattr(config, "auth", None), "keys", [])}
    for i, budget in enumerate(config.cost.budgets):
        key = f"cost.budgets[{i}]"
        if (budget.api_key is None) == (budget.tenant is None):
            raise _fail(key, "name exactly one of api_key or tenant")
        if budget.api_key is not None and key_ids and budget.api_key not in key_ids:
            raise _fail(f"{key}.api_key", f"no [[auth.keys]] has the id {budget.api_key!r}")
    if not config.cost.currency.strip():
        raise _fail("cost.currency", "must not be empty")

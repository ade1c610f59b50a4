"""The config's types: the TOML file's tables as frozen msgspec Structs.

:mod:`gateway.config.load` reads the file (or the embedded default) and the environment into
an :class:`InfermuxConfig`; :mod:`gateway.config.validate` checks it at start-up. Every error
is a :class:`ConfigError` whose message starts with the key path at fault
(``backends[1].kind: unknown backend kind 'foo'``), so a person can find the line to change.
``[telemetry]``'s tables are in :mod:`gateway.config.telemetry`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from backends.base import BackendConfig
from gateway.config.cache import CacheConfig
from gateway.config.telemetry import TelemetryConfig
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
    "ResponsesConfig",
    "ServerConfig",
    "StateConfig",
]


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
    #: Hex SHA-256 of the bearer token ``GET /metrics`` requires (``infermux key
    #: hash`` hashes one); None: the scrape endpoint is public, as ``/health`` and ``/ready``.
    metrics_token_sha256: str | None = None


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
    #: the same model, else from the partial text (gateway/serving/stream_resume.py). Off: the
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
    #: Requests (running or queued) of one API key in flight at once on this replica, for a
    #: key without its own ``max_concurrent``; one more is refused with 429. None: the
    #: replica's ``max_concurrent_requests``, so one key may fill the slots but never holds
    #: queue places beyond them. No key (open mode): no per-key cap at all, so the one local
    #: user is bounded by the global slots and queue only.
    default_max_concurrent_per_key: Annotated[int, msgspec.Meta(ge=1)] | None = None


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
    #: This key's latency SLO for the ``slo_cost`` strategy: over the alias's, under the
    #: request's own ``x-infermux-ttft-slo-ms`` / ``x-infermux-tpot-slo-ms`` headers.
    ttft_slo_ms: Annotated[float, msgspec.Meta(gt=0)] | None = None
    tpot_slo_ms: Annotated[float, msgspec.Meta(gt=0)] | None = None


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


class ResponsesConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[responses]``: retention of the Responses API's stored responses, per API key and
    per tenant.

    They live where the ledger does: Postgres with ``[cost] database`` (every replica
    reads them), else the ledger's SQLite file (gateway/openai/response_store.py).
    """

    #: Older ones are deleted (OpenAI keeps them 30 days).
    max_age_s: Annotated[float, msgspec.Meta(gt=0)] = 30 * 24 * 3600.0
    #: A key's newest this many are kept; storing one more deletes its oldest.
    max_per_key: Annotated[int, msgspec.Meta(ge=1)] = 10_000
    #: A key's stored responses and conversations in bytes; storing one more deletes the
    #: key's oldest until it fits. One response alone over it is refused (400, ``store``).
    max_bytes_per_key: Annotated[int, msgspec.Meta(ge=1)] = 256 * 1024 * 1024
    #: All the keys of one tenant (``[[auth.keys]] tenant``) together, in bytes; storing one
    #: more deletes the tenant's oldest (of any of its keys) until it fits.
    max_bytes_per_tenant: Annotated[int, msgspec.Meta(ge=1)] = 1024 * 1024 * 1024


class InfermuxConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole routing config."""

    server: ServerConfig = ServerConfig()
    backends: list[BackendConfig] = []
    models: list[ModelConfig] = []
    plugins: PluginsConfig = PluginsConfig()
    limits: LimitsConfig = LimitsConfig()
    reasoning: ReasoningConfig = ReasoningConfig()
    auth: AuthConfig = AuthConfig()
    #: Traces, metrics export and SLOs (gateway/config/telemetry.py).
    telemetry: TelemetryConfig = TelemetryConfig()
    #: Prices, the usage ledger and budgets (plugins/builtin/cost/config.py).
    cost: CostConfig = CostConfig()
    #: Shared state of replicas: rate limits and budgets in memory or in Redis.
    state: StateConfig = StateConfig()
    #: The Responses API's stored responses: their retention and per-key quotas.
    responses: ResponsesConfig = ResponsesConfig()
    #: Which tenants share cached prompt prefixes (gateway/config/cache.py).
    cache: CacheConfig = CacheConfig()

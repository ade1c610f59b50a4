"""The checks a decoded config must pass beyond its types: names, duplicates, references
between tables, auth keys, plugin paths, ``[cache]`` sharing groups and ``[cost]``.

Every error is a :class:`~gateway.config.types.ConfigError` whose message starts with the
key path at fault (``backends[1].kind: unknown backend kind 'foo'``).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from backends.base import BackendConfig
from gateway.config.cache import CacheConfig
from gateway.config.types import AuthConfig, ConfigError, InfermuxConfig, PluginsConfig

__all__ = ["check_backend_keys", "check_registered_names", "validate"]

# Backend names travel in the ``x-infermux-backend`` header and in metric labels.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
_BACKEND_KEYS = frozenset(BackendConfig.__struct_fields__)
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
_TIMEOUT_KEYS = ("connect_timeout", "first_byte_timeout", "idle_timeout", "total_timeout")


def validate(config: InfermuxConfig) -> None:
    """Every check of a config that decoded (its types are right)."""
    _validate(config)
    _validate_cost(config)


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


def check_backend_keys(backends: Any) -> None:
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
    _validate_cache(config.cache)
    token = config.server.metrics_token_sha256
    if token is not None and not _SHA256_HEX.fullmatch(token):
        raise _fail(
            "server.metrics_token_sha256",
            "expected the 64 hex digits of a SHA-256 (`infermux key hash` prints it); never "
            "put the token itself in the config",
        )
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


def _validate_cache(cache: CacheConfig) -> None:
    # A tenant in two groups would share with both, so each group would also share with
    # the other's tenants through it: refused rather than silently widened.
    seen_names: dict[str, int] = {}
    seen_tenants: dict[str, int] = {}
    for i, group in enumerate(cache.sharing_groups):
        key = f"cache.sharing_groups[{i}]"
        if not _NAME.fullmatch(group.name):
            raise _fail(f"{key}.name", f"{group.name!r} is not a valid group name")
        if group.name in seen_names:
            raise _fail(
                f"{key}.name", f"duplicate group name {group.name!r} (also cache.sharing_groups[{seen_names[group.name]}])"
            )
        seen_names[group.name] = i
        for tenant in group.tenants:
            if not _NAME.fullmatch(tenant):
                raise _fail(f"{key}.tenants", f"{tenant!r} is not a valid tenant name")
            if tenant in seen_tenants:
                other = seen_tenants[tenant]
                where = "listed twice" if other == i else f"also in cache.sharing_groups[{other}]"
                raise _fail(f"{key}.tenants", f"tenant {tenant!r} is {where}: a tenant shares with one group at most")
            seen_tenants[tenant] = i


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

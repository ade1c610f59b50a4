"""Loading the config: the file (or the embedded default), then the environment.

Resolution order (later wins): the embedded default or the file (``--config FILE``, else
``INFERMUX_CONFIG``), then the environment (``INFERMUX_HOST``, ``INFERMUX_PORT``), then the
command line (``--host``, ``--port``, applied by the CLI). A file without ``[[backends]]``
and ``[[models]]`` tables keeps the embedded default model, so a file may tune only
``[server]``. The structs are in :mod:`gateway.config.types`, the checks in
:mod:`gateway.config.validate`.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import msgspec

from backends import mlx as mlx_backend
from backends.base import BackendConfig
from backends.default_model import DEFAULT_MODEL_ALIAS, default_model_path
from gateway.config.types import ConfigError, InfermuxConfig, ModelConfig
from gateway.config.validate import check_backend_keys, check_registered_names, validate
from gateway.config.validation_message import split_validation_message

__all__ = [
    "ENV_CONFIG",
    "ENV_HOST",
    "ENV_PORT",
    "config_from_dict",
    "default_backends",
    "default_config",
    "load_config",
]

#: Environment variables that override the config (documented in the README).
ENV_CONFIG = "INFERMUX_CONFIG"
ENV_HOST = "INFERMUX_HOST"
ENV_PORT = "INFERMUX_PORT"


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
    check_backend_keys(raw.get("backends"))
    try:
        config = msgspec.convert(raw, InfermuxConfig)
    except msgspec.ValidationError as exc:
        key, reason = split_validation_message(str(exc))
        raise ConfigError(f"{key}: {reason}" if key else reason, key=key) from exc
    validate(config)
    return config


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

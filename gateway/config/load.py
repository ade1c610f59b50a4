"""Loading the config: the file (or the embedded default), then the environment.

Resolution order (later wins): the embedded default or the file (``--config FILE``, else
``INFERMUX_CONFIG``), then the environment (``INFERMUX_HOST``, ``INFERMUX_PORT``), then the
command line (``--host``, ``--port``, applied by the CLI). A file without ``[[backends]]``
and ``[[models]]`` tables keeps the embedded default model, so a file may tune only
``[server]``. The structs are in :mod:`gateway.config.types`, the checks in
:mod:`gateway.config.validate`.

``infermux serve PATH`` builds the config from a model instead (:func:`model_path_config`):
the GGUF file or Hugging Face checkpoint directory under its name, on the backends the
default model uses that can load it; ``--api-key`` adds one key (:func:`with_api_key`).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from backends import mlx as mlx_backend
from backends.base import BackendConfig
from backends.default_model import DEFAULT_MODEL_ALIAS, default_model_path
from gateway.config.types import ApiKeyConfig, ConfigError, InfermuxConfig, ModelConfig
from gateway.config.validate import check_backend_keys, check_registered_names, validate
from gateway.config.validation_message import split_validation_message

__all__ = [
    "ENV_CONFIG",
    "ENV_HOST",
    "ENV_PORT",
    "CLI_KEY_ID",
    "ModelPathError",
    "config_from_dict",
    "default_backends",
    "default_config",
    "load_config",
    "model_alias",
    "model_path_config",
    "select_backends",
    "with_api_key",
]

#: Environment variables that override the config (documented in the README).
ENV_CONFIG = "INFERMUX_CONFIG"
ENV_HOST = "INFERMUX_HOST"
ENV_PORT = "INFERMUX_PORT"


#: The ``id`` of the key ``infermux serve --api-key`` adds (in logs, usage and metrics).
CLI_KEY_ID = "cli"


class ModelPathError(ConfigError):
    """``infermux serve PATH``: the path is not a model infermux can serve (names the path)."""


def default_backends(model_path: Path | None = None) -> list[BackendConfig]:
    """The default backends of ``model_path`` (else the embedded default model), in priority
    order (later issues append here). A checkpoint directory gets only the backends that load
    directories: the core engine and MLX (llama.cpp reads GGUF files only)."""
    if model_path is None:
        try:
            model_path = default_model_path()
        except FileNotFoundError as exc:
            raise ConfigError(f"backends[0].options.model_path: {exc}") from exc
    backends: list[BackendConfig] = []
    if not model_path.is_dir():  # llama.cpp reads GGUF files, not checkpoint directories
        backends.append(
            # Under load, requests wait for one of its slots, as on llama-server -np 16: no
            # first-byte timeout, so a queued request does not spill onto the other engines on
            # the same cores (measured at 64 streams: 0.80x llama-server with the spill-over,
            # docs/benchmarks.md). total_timeout still bounds a request.
            BackendConfig(
                name="llamacpp",
                kind="llamacpp",
                options={"model_path": str(model_path), "n_ctx": 2048},
                first_byte_timeout=None,
            )
        )
    # The native engine serves the same file (pin it with `x-infermux-backend: core_engine`).
    backends.append(
        BackendConfig(
            name="core_engine",
            kind="core_engine",
            options={"model_path": str(model_path)},
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


def model_path_config(path: Path) -> InfermuxConfig:
    """``infermux serve PATH``: the model at ``path`` (a ``.gguf`` file or a Hugging Face
    checkpoint directory) as alias :func:`model_alias`, on its :func:`default_backends`.
    :class:`ModelPathError` naming the path when it is neither."""
    path = _check_model_path(path)
    backends = default_backends(path)
    return InfermuxConfig(
        backends=backends,
        models=[ModelConfig(alias=model_alias(path), backends=[b.name for b in backends])],
    )


#: The shard suffix of a split GGUF (llama.cpp loads the other shards from the first).
_SHARD_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")


def model_alias(path: Path) -> str:
    """The alias of ``infermux serve PATH``: the file's stem (without a split GGUF's
    ``-00001-of-00003``), or the directory's name (``.`` resolved)."""
    path = Path(path).expanduser()
    if path.is_dir():
        return path.resolve().name if path.name in ("", ".", "..") else path.name
    return _SHARD_SUFFIX.sub("", path.stem) or path.stem


def _check_model_path(path: Path) -> Path:
    path = Path(path).expanduser()
    shown = str(path)
    if not path.exists():
        raise ModelPathError(f"model path {shown!r}: no such file or directory")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelPathError(
                f"model path {shown!r}: a directory without config.json (expected a Hugging "
                "Face checkpoint directory: config.json, *.safetensors, tokenizer files)"
            )
        if not any(path.glob("*.safetensors")):
            raise ModelPathError(
                f"model path {shown!r}: a checkpoint directory without *.safetensors weights "
                "(other weight formats are not read)"
            )
        return path
    if path.suffix.lower() != ".gguf":
        raise ModelPathError(
            f"model path {shown!r}: neither a .gguf file nor a Hugging Face checkpoint "
            "directory (config.json, *.safetensors, tokenizer files)"
        )
    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as exc:
        raise ModelPathError(f"model path {shown!r}: cannot read it: {exc.strerror}") from exc
    if magic != b"GGUF":
        raise ModelPathError(f"model path {shown!r}: not a GGUF file (it lacks the GGUF magic)")
    return path


def select_backends(config: InfermuxConfig, names: Sequence[str]) -> InfermuxConfig:
    """``config`` served by the backends ``names`` only (``infermux serve --backend``), in
    the config's priority order; a :class:`ConfigError` for a name it does not have."""
    known = [b.name for b in config.backends]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError(
            f"--backend {unknown[0]}: not a backend of this model (its backends: "
            f"{', '.join(known)})",
            key="--backend",
        )
    wanted = set(names)
    return msgspec.structs.replace(
        config,
        backends=[b for b in config.backends if b.name in wanted],
        models=[
            msgspec.structs.replace(m, backends=[b for b in m.backends if b in wanted])
            for m in config.models
        ],
    )


def with_api_key(config: InfermuxConfig, key: str) -> InfermuxConfig:
    """``config`` with one more API key (``infermux serve --api-key``), id :data:`CLI_KEY_ID`;
    only its SHA-256 is kept. A key no client could present is a :class:`ConfigError`."""
    if not 0 < len(key) <= 512 or not key.isascii() or not key.isprintable() or key != key.strip():
        raise ConfigError(
            "--api-key: expected 1-512 printable ASCII characters without surrounding blanks",
            key="--api-key",
        )
    if any(k.id == CLI_KEY_ID for k in config.auth.keys):
        raise ConfigError(
            f"--api-key: the config already has a key with id {CLI_KEY_ID!r}", key="--api-key"
        )
    entry = ApiKeyConfig(id=CLI_KEY_ID, key_sha256=hashlib.sha256(key.encode()).hexdigest())
    auth = msgspec.structs.replace(config.auth, keys=[*config.auth.keys, entry])
    return msgspec.structs.replace(config, auth=auth)


def load_config(
    path: Path | None,
    *,
    env: Mapping[str, str] = os.environ,
    backend_kinds: Collection[str] | None = None,
    routing_strategies: Collection[str] | None = None,
    model_path: Path | None = None,
) -> InfermuxConfig:
    """Load ``path`` (else ``$INFERMUX_CONFIG``, else the default) and apply env overrides.

    ``model_path`` (``infermux serve PATH``) replaces the config file, ``$INFERMUX_CONFIG``
    included: :func:`model_path_config`; with ``path`` too it is a :class:`ConfigError`.
    ``backend_kinds`` / ``routing_strategies``, when given (the names plugins registered),
    are checked too; ``create_app`` checks them anyway.
    """
    if model_path is not None and path is not None:
        raise ConfigError(
            f"a model path ({str(model_path)!r}) and --config ({str(path)!r}) exclude each "
            "other: serve a model directly, or name it in the config's [[backends]]"
        )
    if path is None and model_path is None and env.get(ENV_CONFIG):
        path = Path(env[ENV_CONFIG])
    if model_path is not None:
        config = model_path_config(model_path)
    elif path is None:
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

"""``infermux serve [PATH | --config FILE] [--api-key KEY] [--host HOST] [--port PORT]``: run
the gateway.

``PATH`` serves one model as peers do (``vllm serve MODEL``, ``llama-server -m FILE``): a
``.gguf`` file or a Hugging Face checkpoint directory, under its file stem / directory name,
on the default backends that can load it (:func:`gateway.config.load.model_path_config`).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import uvicorn

__all__ = ["add_parser", "run"]

_LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
#: The default of ``--api-key`` (keeps the key off the command line, as ``VLLM_API_KEY``).
ENV_API_KEY = "INFERMUX_API_KEY"


def add_parser(subparsers: Any) -> None:
    """Register ``serve``."""
    parser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible gateway",
        description="Serve the model at PATH (a .gguf file, or a Hugging Face checkpoint "
        "directory with config.json, *.safetensors and tokenizer files) under its name, or the "
        "models of the routing config (default: the embedded SmolLM2-135M-Instruct as alias "
        "'smollm2'), on 127.0.0.1:8000.",
    )
    parser.add_argument(
        "model_path",
        nargs="?",
        type=Path,
        default=None,
        metavar="PATH",
        help="a .gguf file or a Hugging Face checkpoint directory: served as its file stem "
        "(directory name) on the default backends that can load it (llama.cpp, the core "
        "engine, MLX when installed; a directory: the core engine and MLX); replaces the "
        "config ($INFERMUX_CONFIG too)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="routing config (TOML); default: $INFERMUX_CONFIG, else the embedded default "
        "(not with PATH)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require this API key (Authorization: Bearer KEY; without it: 401); adds to "
        "the config's [[auth.keys]] as id 'cli'. Default: $INFERMUX_API_KEY. A key on the "
        "command line is visible to other local users (ps): prefer the variable",
    )
    parser.add_argument(
        "--backend",
        action="append",
        default=None,
        metavar="NAME",
        help="serve PATH (or the default model) on this one of its default backends only "
        "(llamacpp, core_engine, mlx); repeat for several (not with --config)",
    )
    parser.add_argument(
        "--host", default=None, help="listen address (overrides config and $INFERMUX_HOST)"
    )
    parser.add_argument(
        "--port", type=_port, default=None, help="listen port (overrides config and $INFERMUX_PORT)"
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: info)",
    )
    parser.add_argument(
        "--no-access-log", action="store_true", help="do not log one line per request"
    )
    parser.add_argument(
        "--strict-plugins",
        action="store_true",
        help="refuse to start when a plugin fails to load (default: skip it and log why; "
        "also [plugins] strict = true)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load and validate the config, build the app, serve until SIGINT/SIGTERM."""
    import msgspec

    from gateway.app import create_app
    from gateway.config.load import (
        ModelPathError,
        load_config,
        select_backends,
        with_api_key,
    )
    from gateway.config.types import ConfigError
    from gateway.http.auth import check_exposure
    from gateway.http.drain import DrainingServer
    from gateway.http.header_limit import uvicorn_header_limit
    from plugins.manager import PluginLoadError

    logging.basicConfig(level=args.log_level.upper(), format=_LOG_FORMAT)
    if args.model_path is not None and args.config is not None:
        print(
            f"infermux: serve takes a model PATH ({args.model_path}) or --config "
            f"({args.config}), not both: name the model in the config's [[backends]], or "
            "drop --config",
            file=sys.stderr,
        )
        return 2
    if args.backend and args.config is not None:
        print(
            "infermux: --backend picks among the default backends of PATH or of the default "
            "model, not with --config (list the backends in the config instead)",
            file=sys.stderr,
        )
        return 2
    api_key = args.api_key if args.api_key is not None else os.environ.get(ENV_API_KEY) or None
    try:
        config = load_config(args.config, model_path=args.model_path)
        if args.backend:
            config = select_backends(config, args.backend)
        if api_key is not None:
            config = with_api_key(config, api_key)
        server_config = config.server
        if args.host is not None:
            server_config = msgspec.structs.replace(server_config, host=args.host)
        if args.port is not None:
            server_config = msgspec.structs.replace(server_config, port=args.port)
        config = msgspec.structs.replace(config, server=server_config)
        if args.strict_plugins:
            config = msgspec.structs.replace(
                config, plugins=msgspec.structs.replace(config.plugins, strict=True)
            )
        check_exposure(config)
        app = create_app(config)
    except ModelPathError as exc:
        print(f"infermux: cannot serve {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        where = f" in {args.config}" if args.config is not None else ""
        print(f"infermux: config error{where}: {exc}", file=sys.stderr)
        return 2
    except PluginLoadError as exc:
        print(f"infermux: {exc} (--strict-plugins / [plugins] strict)", file=sys.stderr)
        return 2

    cleanup_timeout_s = config.plugins.hook_timeout_s + 1.0
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.server.host,
            port=config.server.port,
            log_level=args.log_level,
            access_log=not args.no_access_log,
            lifespan="on",
            # The drain (gateway/http/drain.py) has already waited for generation requests.
            timeout_graceful_shutdown=math.ceil(cleanup_timeout_s),
            **uvicorn_header_limit(config.limits.max_header_bytes),
        ),
        gateway=app.state.gateway,
        drain_timeout_s=config.server.drain_timeout_s,
        cleanup_timeout_s=cleanup_timeout_s,
    )
    logging.getLogger("gateway").info(
        "infermux on http://%s:%d (models: %s)",
        config.server.host,
        config.server.port,
        ", ".join(m.alias for m in config.models) or "none",
    )
    server.run()
    if server.exit_code:
        print(f"infermux: {app.state.gateway.startup_error}", file=sys.stderr)
        return server.exit_code
    return 0 if server.started else 1


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range 0-65535: {port}")
    return port

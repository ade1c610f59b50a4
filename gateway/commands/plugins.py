"""``infermux plugins``: each plugin, its version and source, and the hooks it implements.

A plugin that failed to load is listed with its error and skipped (exit 0); ``--strict``
(or ``[plugins] strict = true``) makes that fatal (exit 1), as ``serve --strict-plugins``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    """Register ``plugins``."""
    parser = subparsers.add_parser(
        "plugins",
        help="list plugins, their source and the hooks they implement",
        description="Load the plugins as `infermux serve` would (built-ins, the entry-point "
        "group 'infermux', then [plugins] modules) and list them, with failures.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="apply this config's [plugins] table (disable, enable, modules, settings)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a plugin failed to load")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the plugin table; exit 1 when a plugin failed and ``--strict`` is given."""
    import msgspec

    from gateway.config.load import load_config
    from gateway.config.types import ConfigError
    from plugins.manager import PluginHooks, create_plugin_manager

    plugins_config = None
    if args.config is not None:
        try:
            plugins_config = load_config(args.config).plugins
        except ConfigError as exc:
            print(f"infermux: config error in {args.config}: {exc}", file=sys.stderr)
            return 2
    strict = args.strict or (plugins_config is not None and plugins_config.strict)
    # Not strict here: the table is printed either way, the exit status says the rest.
    pm = create_plugin_manager(config=plugins_config, strict=False)
    records = pm.plugin_records()
    hooks = PluginHooks(pm)
    kinds = sorted(hooks.register_backend_kinds())
    strategies = sorted(hooks.register_routing_strategies())
    if args.json:
        print(
            json.dumps(
                {
                    "plugins": msgspec.to_builtins(records),
                    "backend_kinds": kinds,
                    "routing_strategies": strategies,
                },
                indent=2,
            )
        )
    else:
        print(_table(records))
        print()
        print(f"backend kinds:      {', '.join(kinds) or '(none)'}")
        print(f"routing strategies: {', '.join(strategies) or '(none)'}")
    failed = [r.name for r in records if r.status == "failed"]
    if failed and strict:
        print(f"infermux: plugins failed to load (strict): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _table(records: list[Any]) -> str:
    rows = [("PLUGIN", "VERSION", "SOURCE", "STATUS", "HOOKS")]
    for record in records:
        source = record.source
        if record.distribution:
            source = f"{source} ({record.distribution})"
        hooks = ", ".join(h.removeprefix("infermux_") for h in record.hooks)
        if record.status == "failed":
            hooks = record.error or ""
        rows.append((record.name, record.version or "-", source, record.status, hooks or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(f"{cell:<{width}}" for cell, width in zip(row[:4], widths, strict=True))
        + f"  {row[4]}"
        for row in rows
    )

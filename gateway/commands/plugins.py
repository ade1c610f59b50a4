"""``infermux plugins``: each plugin, where it came from, and the hooks it implements."""

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
        description="Load the plugins as `infermux serve` would (built-ins, then the "
        "entry-point group 'infermux') and list them, with failures.",
    )
    parser.add_argument(
        "--config", type=Path, default=None, help="apply this config's [plugins] disable list"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the plugin table; exit 1 when a plugin failed to load."""
    import msgspec

    from gateway.config import ConfigError, load_config
    from plugins.manager import PluginHooks, create_plugin_manager

    plugins_config = None
    if args.config is not None:
        try:
            plugins_config = load_config(args.config).plugins
        except ConfigError as exc:
            print(f"infermux: config error in {args.config}: {exc}", file=sys.stderr)
            return 2
    pm = create_plugin_manager(config=plugins_config)
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
    return 1 if any(r.status == "failed" for r in records) else 0


def _table(records: list[Any]) -> str:
    rows = [("PLUGIN", "SOURCE", "STATUS", "HOOKS")]
    for record in records:
        source = record.source
        if record.distribution:
            source = f"{source} ({record.distribution})"
        hooks = ", ".join(h.removeprefix("infermux_") for h in record.hooks)
        if record.status == "failed":
            hooks = record.error or ""
        rows.append((record.name, source, record.status, hooks or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}"
        for row in rows
    )

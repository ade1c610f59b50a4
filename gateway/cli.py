"""The ``infermux`` command line: one module per subcommand, plugged in by name.

Each module in :data:`SUBCOMMAND_MODULES` exposes ``add_parser(subparsers)``, which adds its
subparser and sets ``func`` (``set_defaults(func=run)``, ``run(args) -> int | None``). Modules
are imported when the CLI starts, not when ``gateway.cli`` is imported, and keep their heavy
imports inside ``run``; a module that does not exist (yet) is skipped silently, one that
fails to import is reported and skipped so the other subcommands keep working.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["SUBCOMMAND_MODULES", "build_parser", "main"]

#: Subcommand modules, in ``--help`` order. Later ones (``usage``, ``plugin new``) go here.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "gateway.commands.serve",
    "gateway.commands.plugins",
    "gateway.commands.plugin_new",
    "gateway.commands.key",
    "gateway.commands.usage",
    "gateway.commands.plan",
    "gateway.commands.conformance",
    "gateway.bench.cli",
)


def build_parser(modules: Sequence[str] = SUBCOMMAND_MODULES) -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="infermux",
        description="A plugin-based, backend-agnostic LLM inference gateway "
        "(OpenAI-compatible API).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in modules:
        module = _import_subcommand(module_name)
        if module is not None:
            module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``infermux`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


def _import_subcommand(module_name: str) -> ModuleType | None:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            return None  # not written yet / not installed: no such subcommand
        print(f"infermux: skipping subcommand module {module_name}: {exc}", file=sys.stderr)
    except Exception as exc:
        print(f"infermux: skipping subcommand module {module_name}: {exc!r}", file=sys.stderr)
    return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("infermux")
    except PackageNotFoundError:
        return "(not installed)"


if __name__ == "__main__":
    sys.exit(main())

"""``infermux plugin new NAME [--dir DIR]``: write a working plugin package skeleton.

The package has a pyproject with the ``infermux`` entry point, one hookimpl (a
``transform_request`` that labels every request, configured from
``[plugins.settings.NAME]``) and tests that pass once the package is installed
(``pip install -e DIR/NAME && pytest DIR/NAME``).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "render_skeleton", "run", "write_skeleton"]

_NAME = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")
#: Top-level packages of infermux itself: a plugin module must not shadow them.
_RESERVED = frozenset({"gateway", "backends", "plugins", "core_engine", "tests", "infermux"})


def add_parser(subparsers: Any) -> None:
    """Register ``plugin`` (with its ``new`` action)."""
    parser = subparsers.add_parser(
        "plugin",
        help="plugin authoring tools (plugin new NAME)",
        description="Tools for writing infermux plugins (docs/plugins.md).",
    )
    actions = parser.add_subparsers(dest="plugin_command", metavar="ACTION", required=True)
    new = actions.add_parser(
        "new",
        help="write a plugin package skeleton",
        description="Write DIR/NAME/: a pyproject with the 'infermux' entry point, one "
        "hookimpl and its tests. Install it with `pip install -e DIR/NAME`, then run "
        "`pytest DIR/NAME`.",
    )
    new.add_argument("name", help="distribution and entry-point name, e.g. my-router")
    new.add_argument(
        "--dir", type=Path, default=Path("."), help="where to create the package (default: .)"
    )
    new.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the skeleton; exit 2 on a bad name or an existing directory."""
    try:
        root = write_skeleton(args.name, args.dir)
    except ValueError as exc:
        print(f"infermux: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the plugin package {root}")
    print(f"  install it:  pip install -e {root}")
    print(f"  test it:     python -m pytest {root}")
    print(f"  configure:   [plugins.settings.{args.name}] in the routing config")
    return 0


def write_skeleton(name: str, directory: Path) -> Path:
    """Create ``directory/name`` with the skeleton; ``ValueError`` naming the problem."""
    files = render_skeleton(name)
    root = directory / name
    if root.exists():
        raise ValueError(f"NAME: {root} already exists; choose another name or --dir")
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def render_skeleton(name: str) -> dict[str, str]:
    """Relative path -> file text of the package for plugin ``name``."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"NAME: {name!r} is not a valid plugin name (lower-case letters, digits and "
            "single '-' or '_' between them, starting with a letter)"
        )
    module = name.replace("-", "_")
    if module in _RESERVED:
        raise ValueError(f"NAME: {name!r} would shadow infermux's own package {module!r}")
    values = {"name": name, "module": module}
    return {
        "pyproject.toml": _PYPROJECT.format(**values),
        "README.md": _README.format(**values),
        f"{module}/__init__.py": _MODULE.format(**values),
        "tests/conftest.py": _CONFTEST,
        f"tests/test_{module}.py": _TEST.format(**values),
    }


_PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1.0"
description = "An infermux plugin"
requires-python = ">=3.11"
dependencies = ["infermux"]

# infermux finds the plugin here: `infermux plugins` lists it once the package is installed.
[project.entry-points.infermux]
{name} = "{module}"

[tool.setuptools]
packages = ["{module}"]

[tool.pytest.ini_options]
testpaths = ["tests"]
"""

_README = """\
# {name}

An infermux plugin. It labels every request with `labels["{name}"]`; replace the
hookimpl in `{module}/__init__.py` with your own (infermux's docs/plugins.md lists every
hook).

    pip install -e .            # infermux finds it through the `infermux` entry point
    infermux plugins            # lists it, with the hooks it implements
    python -m pytest            # its tests, against a live gateway with a mock backend

Settings, in the routing config:

    [plugins.settings.{name}]
    label = "hello"

Disable it without uninstalling: `[plugins] disable = ["{name}"]`.
"""

_MODULE = '''\
"""{name}: an infermux plugin (settings: ``[plugins.settings.{name}]``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from plugins import GenerationRequest, hookimpl

__version__ = "0.1.0"


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[plugins.settings.{name}]``."""

    #: The value of the ``{name}`` request label.
    label: str = "seen"


class Plugin:
    """Labels every request before it is routed."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @hookimpl
    def infermux_transform_request(self, request: GenerationRequest) -> GenerationRequest:
        labels = {{**request.labels, "{name}": self.settings.label}}
        return msgspec.structs.replace(request, labels=labels)


def create_plugin(settings: Mapping[str, Any] | None = None) -> Plugin:
    """infermux calls this once per gateway with the plugin's settings table."""
    return Plugin(msgspec.convert(dict(settings or {{}}), Settings))
'''

_CONFTEST = """\
# The plugin author's fixtures: plugin_manager, hook_recorder, plugin_gateway.
pytest_plugins = ["plugins.testing"]
"""

_TEST = '''\
"""{name}, as a user of the installed package sees it."""

from __future__ import annotations

from plugins.manager import create_plugin_manager
from {module} import create_plugin


def test_the_installed_plugin_is_found_through_its_entry_point() -> None:
    records = {{r.name: r for r in create_plugin_manager().plugin_records()}}
    record = records["{name}"]
    assert record.status == "loaded", record.error
    assert record.source == "entry point"
    assert "infermux_transform_request" in record.hooks


def test_requests_are_labelled_through_a_live_gateway(plugin_gateway, hook_recorder) -> None:
    with plugin_gateway(create_plugin({{"label": "hello"}}), hook_recorder) as gateway:
        reply = gateway.openai_client().chat.completions.create(
            model="echo", messages=[{{"role": "user", "content": "hi"}}]
        )
        assert reply.choices[0].message.content
        call = hook_recorder.wait_for("on_response")
    assert call["request"].labels["{name}"] == "hello"
'''

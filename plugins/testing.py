"""Test helpers for plugin authors: a fresh plugin manager, a live gateway, a hook recorder.

Use them as plain functions, or as pytest fixtures by adding to a test module or to the
top-level ``conftest.py`` of your plugin package::

    pytest_plugins = ["plugins.testing"]

    def test_my_router_picks_the_big_backend(plugin_gateway, hook_recorder):
        config = gateway_config(mock_backend("small"), mock_backend("big"))
        with plugin_gateway(MyRouter(), hook_recorder, config=config) as gw:
            reply = gw.openai_client().completions.create(model="echo", prompt="x" * 5000)
        assert reply  # the gateway answered...
        call = hook_recorder.wait_for("on_response")   # ...and the plugins heard about it
        assert call["backend_name"] == "big"

Fixtures: ``plugin_manager`` (a fresh manager with the built-ins and no installed plugins),
``hook_recorder`` (a :class:`HookRecorder`, not registered yet) and ``plugin_gateway``
(:func:`serve_plugins`: a real gateway on a free 127.0.0.1 port, mock backends by default).
The gateway runs in a background thread; hooks that run after the response was sent
(``on_response``, ``on_request_end``) are awaited with :meth:`HookRecorder.wait_for`.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import plugins.hookspecs as hookspecs
from plugins.hookspecs import hookimpl
from plugins.manager import InfermuxPluginManager, create_plugin_manager

if TYPE_CHECKING:
    from backends.base import Backend
    from gateway.config.types import InfermuxConfig, PluginsConfig
    from gateway.testing import LiveGateway

__all__ = [
    "HookCall",
    "HookRecorder",
    "gateway_config",
    "hook_names",
    "hook_recorder",
    "installed_plugin",
    "make_plugin_manager",
    "mock_backend",
    "plugin_gateway",
    "plugin_manager",
    "serve_plugins",
]

_SPEC_MARKER = f"{hookspecs.PROJECT_NAME}_spec"


def hook_names() -> list[str]:
    """Every hook of :mod:`plugins.hookspecs`, sorted."""
    return sorted(
        name
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, _SPEC_MARKER)
    )


def make_plugin_manager(
    *plugins: object,
    config: PluginsConfig | None = None,
    entry_points: bool = False,
) -> InfermuxPluginManager:
    """A fresh plugin manager: the built-ins, then ``plugins`` registered in order.

    Installed entry-point plugins are left out unless ``entry_points`` (tests stay
    independent of what else is installed). Invalid plugins fail loudly here, not later.
    """
    pm = create_plugin_manager(config=config, load_entry_points=entry_points)
    for plugin in plugins:
        pm.register(plugin)
    pm.check_pending()
    return pm


@contextmanager
def installed_plugin(directory: Path, name: str, source: str) -> Iterator[Path]:
    """Install a plugin as an entry point of the group ``infermux`` for the duration.

    Writes ``source`` as the module ``<name with _>_plugin`` and a ``.dist-info`` naming it
    under entry point ``name`` into ``directory``, which goes on ``sys.path`` and on the
    ``PYTHONPATH`` that worker processes inherit: the plugin is then loaded like an installed
    one by this process's plugin managers and by every engine worker started meanwhile
    (where the engine policy hooks are answered). Yields the module's path.
    """
    module = name.replace("-", "_") + "_plugin"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{module}.py"
    path.write_text(textwrap.dedent(source))
    dist = directory / f"{module}-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[infermux]\n{name} = {module}\n")
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(directory), old_path) if p)
    sys.path.insert(0, str(directory))
    importlib.invalidate_caches()
    try:
        yield path
    finally:
        sys.path.remove(str(directory))
        sys.modules.pop(module, None)
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path
        importlib.invalidate_caches()


@contextmanager
def serve_plugins(
    *plugins: object,
    config: InfermuxConfig | None = None,
    entry_points: bool = False,
    backends: Mapping[str, Backend] | None = None,
) -> Iterator[LiveGateway]:
    """A live gateway with ``plugins`` registered; the base URL is yielded.

    ``config`` defaults to one mock backend "mock" serving the alias "echo"
    (:func:`gateway_config`); its ``[plugins]`` table (disable, settings...) applies.
    """
    from gateway.testing import gateway_config, run_gateway

    config = config if config is not None else gateway_config()
    pm = make_plugin_manager(*plugins, config=config.plugins, entry_points=entry_points)
    with run_gateway(config, plugin_manager=pm, backends=backends) as gateway:
        yield gateway


def gateway_config(*args: Any, **kwargs: Any) -> InfermuxConfig:
    """:func:`gateway.testing.gateway_config`: a validated config in one line."""
    from gateway.testing import gateway_config as build

    return build(*args, **kwargs)


def mock_backend(name: str = "mock", **options: Any) -> Any:
    """:func:`gateway.testing.mock_backend`: a ``kind = "mock"`` (echo) backend config."""
    from gateway.testing import mock_backend as build

    return build(name, **options)


class HookCall:
    """One call of one hook: its name and keyword arguments (``call["request"]``)."""

    def __init__(self, hook: str, kwargs: dict[str, Any]) -> None:
        self.hook = hook
        self.kwargs = kwargs

    def __getitem__(self, argument: str) -> Any:
        return self.kwargs[argument]

    def __repr__(self) -> str:
        return f"HookCall({self.hook!r}, {sorted(self.kwargs)})"


class HookRecorder:
    """A plugin that records every call of the hooks it watches, and changes nothing.

    Register it like any plugin (``make_plugin_manager(recorder)``,
    ``serve_plugins(recorder)``). By default it watches every hook; its answer is always
    ``None``, which every hook reads as "no opinion" (no backend chosen, request unchanged,
    generate call not wrapped, next policy decides). Hook names may be given without the
    ``infermux_`` prefix. Thread-safe: the gateway calls hooks on its own thread.
    """

    def __init__(self, hooks: Iterable[str] | None = None) -> None:
        known = hook_names()
        watched = known if hooks is None else [_full_name(h) for h in hooks]
        for name in watched:
            if name not in known:
                raise ValueError(f"HookRecorder: {name!r} is not a hook (known: {known})")
        self._calls: dict[str, list[HookCall]] = {name: [] for name in watched}
        self._condition = threading.Condition()
        for name in watched:
            setattr(self, name, _recording_impl(name, self._record))

    @property
    def hooks(self) -> list[str]:
        """The hooks watched."""
        return list(self._calls)

    def calls(self, hook: str) -> list[HookCall]:
        """The calls of ``hook`` so far, oldest first."""
        with self._condition:
            return list(self._watched(hook))

    def last(self, hook: str) -> HookCall:
        """The latest call of ``hook``; AssertionError when it was never called."""
        calls = self.calls(hook)
        assert calls, f"{_full_name(hook)} was never called"
        return calls[-1]

    def wait_for(self, hook: str, count: int = 1, timeout_s: float = 10.0) -> HookCall:
        """Block until ``hook`` was called ``count`` times; the ``count``-th call."""
        deadline = time.monotonic() + timeout_s
        with self._condition:
            calls = self._watched(hook)
            while len(calls) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{_full_name(hook)} was called {len(calls)} time(s) within "
                        f"{timeout_s:g} s; expected {count}"
                    )
                self._condition.wait(left)
            return calls[count - 1]

    def clear(self) -> None:
        """Forget every call recorded so far."""
        with self._condition:
            for calls in self._calls.values():
                calls.clear()

    def _watched(self, hook: str) -> list[HookCall]:
        name = _full_name(hook)
        if name not in self._calls:
            raise KeyError(f"HookRecorder does not watch {name!r} (watched: {self.hooks})")
        return self._calls[name]

    def _record(self, hook: str, kwargs: dict[str, Any]) -> None:
        with self._condition:
            self._calls[hook].append(HookCall(hook, kwargs))
            self._condition.notify_all()


def _full_name(hook: str) -> str:
    return hook if hook.startswith("infermux_") else f"infermux_{hook}"


def _recording_impl(hook: str, record: Callable[[str, dict[str, Any]], None]) -> Any:
    """A hookimpl for ``hook`` taking exactly the spec's arguments.

    pluggy reads a hookimpl's argument names from its code object (not from
    ``__signature__``), so the function is compiled with the spec's parameter list. The
    names come from our own hookspecs module, never from user input.
    """
    argnames = list(inspect.signature(getattr(hookspecs, hook)).parameters)
    assert all(name.isidentifier() for name in argnames)
    mapping = ", ".join(f"{name!r}: {name}" for name in argnames)
    source = (
        f"def {hook}({', '.join(argnames)}):\n"
        f"    _record({hook!r}, {{{mapping}}})\n"
        f"    return None\n"
    )
    namespace: dict[str, Any] = {"_record": record}
    exec(compile(source, f"<HookRecorder {hook}>", "exec"), namespace)
    return hookimpl(namespace[hook])


# -- pytest fixtures (``pytest_plugins = ["plugins.testing"]``) -----------------------------


@pytest.fixture()
def plugin_manager() -> InfermuxPluginManager:
    """A fresh plugin manager with the built-ins only; ``plugin_manager.register(mine)``."""
    return make_plugin_manager()


@pytest.fixture()
def hook_recorder() -> HookRecorder:
    """A :class:`HookRecorder` watching every hook (register it where you need it)."""
    return HookRecorder()


@pytest.fixture()
def plugin_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., AbstractContextManager[LiveGateway]]:
    """:func:`serve_plugins`: ``with plugin_gateway(MyPlugin(), config=...) as gw:``."""
    from plugins.builtin.cost.plugin import ENV_LEDGER_PATH

    # The built-in cost plugin keeps its usage ledger under ./var by default; a test's
    # gateway keeps it in the test's own directory.
    monkeypatch.setenv(ENV_LEDGER_PATH, str(tmp_path / "ledger.sqlite3"))
    return serve_plugins

"""Creating the plugin manager: built-ins, entry points, config modules, ``check_pending``.

Nothing is loaded at import time; ``create_app`` (or ``infermux plugins``) calls
:func:`create_plugin_manager`. Plugins come from three sources, in this order: the
built-ins (:data:`BUILTIN_PLUGINS`), the entry-point group ``infermux`` of installed
distributions (``[plugins] enable`` may restrict which), and ``[plugins] modules`` import
paths (source "config"). ``[plugins] disable`` blocks any of them by name.

A loaded object exposing ``create_plugin`` (a module-level function) is not registered
itself: ``create_plugin()`` or, when it takes a ``settings`` parameter,
``create_plugin(settings=<[plugins.settings.<name>] table>)`` makes the plugin object, one
per plugin manager (several apps may live in one process).

A plugin that fails to import, to build from its settings, registers hooks with a wrong
signature or implements an unknown hook is reported (logged, listed by ``infermux plugins``)
and skipped; the gateway starts without it. With ``strict`` (``[plugins] strict = true``,
``infermux serve --strict-plugins``) such a failure raises :class:`PluginLoadError`
instead. The typed facade the gateway calls hooks through is
:class:`plugins.plugin_hooks.PluginHooks`, re-exported here.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import pluggy

from plugins import hookspecs
from plugins.plugin_hooks import PluginHooks

if TYPE_CHECKING:
    from gateway.config.types import PluginsConfig

__all__ = [
    "BUILTIN_PLUGINS",
    "ENTRY_POINT_GROUP",
    "InfermuxPluginManager",
    "PluginHooks",
    "PluginLoadError",
    "PluginRecord",
    "create_plugin_manager",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "infermux"

#: Built-in plugins: (registered name, module). Ordinary hookimpl modules, marked ``trylast``
#: where a plugin should be able to override them. A module that keeps per-app state
#: (telemetry, accounting) exposes ``create_plugin()``: each plugin manager registers a fresh
#: object from it instead of the module, so several apps can live in one process.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("builtin.backend_kinds", "plugins.builtin.backend_kinds"),
    ("builtin.routing", "plugins.builtin.routing"),
    ("builtin.cost", "plugins.builtin.cost"),
    ("builtin.metrics", "plugins.builtin.metrics"),
    ("builtin.tracing", "plugins.builtin.tracing"),
    ("builtin.policy", "plugins.builtin.policy"),
)

PluginStatus = Literal["loaded", "failed", "disabled"]


class PluginRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What happened to one plugin at load time."""

    name: str
    #: "builtin", "entry point", "config" (``[plugins] modules``) or "registered" (by code).
    source: str
    #: ``dist-name version`` for entry-point plugins.
    distribution: str | None = None
    #: The version of the distribution that ships the plugin, when known.
    version: str | None = None
    status: PluginStatus = "loaded"
    #: Why it failed ("ImportError: ..."), for ``failed``.
    error: str | None = None
    #: Hooks it implements (``loaded`` only), sorted.
    hooks: tuple[str, ...] = ()


class InfermuxPluginManager(pluggy.PluginManager):
    """A ``pluggy.PluginManager`` that remembers where each plugin came from."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self._records: dict[str, PluginRecord] = {}

    def record(self, record: PluginRecord) -> None:
        """Remember a plugin's load outcome (later records of a name replace earlier ones)."""
        self._records[record.name] = record

    def drop_invalid_plugins(self) -> None:
        """``check_pending()``, but a plugin implementing an unknown hook (a typo such as
        ``infermux_on_respons``) is reported and unregistered instead of stopping start-up."""
        while True:
            try:
                self.check_pending()
                return
            except pluggy.PluginValidationError as exc:
                name = self.get_name(exc.plugin) or repr(exc.plugin)
                self.unregister(exc.plugin)
                record = self._records.get(name) or PluginRecord(name=name, source="registered")
                _report_failure(self, record, exc)

    def plugin_records(self) -> list[PluginRecord]:
        """Every plugin seen at load time, with the hooks the loaded ones implement now."""
        records: list[PluginRecord] = []
        for name, record in self._records.items():
            plugin = self.get_plugin(name)
            if record.status == "loaded" and plugin is not None:
                callers = self.get_hookcallers(plugin) or []
                record = msgspec.structs.replace(
                    record, hooks=tuple(sorted(caller.name for caller in callers))
                )
            records.append(record)
        # Plugins registered directly (tests, embedding code) have no load record.
        for name, plugin in self.list_name_plugin():
            if name not in self._records and plugin is not None:
                callers = self.get_hookcallers(plugin) or []
                records.append(
                    PluginRecord(
                        name=name,
                        source="registered",
                        hooks=tuple(sorted(caller.name for caller in callers)),
                    )
                )
        return records


class PluginLoadError(Exception):
    """Strict loading: at least one plugin failed (``records`` are the failed ones)."""

    def __init__(self, records: list[PluginRecord]) -> None:
        details = "; ".join(f"{r.name} ({r.source}): {r.error}" for r in records)
        super().__init__(f"{len(records)} plugin(s) failed to load: {details}")
        self.records = records


def create_plugin_manager(
    *,
    config: PluginsConfig | None = None,
    load_entry_points: bool = True,
    strict: bool | None = None,
) -> InfermuxPluginManager:
    """Build the plugin manager: hookspecs, built-ins, entry points, config modules.

    ``config.disable`` names are blocked (``builtin.routing``, an entry point's name, a
    module path); ``config.enable`` restricts the entry points; ``config.settings`` feeds
    ``create_plugin(settings)``. ``strict`` (default: ``config.strict``) raises
    :class:`PluginLoadError` when any plugin failed instead of skipping it.
    """
    disabled = set(config.disable) if config is not None else set()
    enabled = set(config.enable) if config is not None and config.enable is not None else None
    settings: Mapping[str, Mapping[str, Any]] = config.settings if config is not None else {}
    if strict is None:
        strict = config.strict if config is not None else False
    pm = InfermuxPluginManager()
    pm.add_hookspecs(hookspecs)
    for name in disabled:
        pm.set_blocked(name)

    infermux_version = _distribution_version("infermux")
    for name, module_name in BUILTIN_PLUGINS:
        record = PluginRecord(name=name, source="builtin", version=infermux_version)
        if name in disabled:
            pm.record(msgspec.structs.replace(record, status="disabled"))
            continue
        try:
            plugin = _instantiate(importlib.import_module(module_name), settings.get(name))
        except Exception as exc:  # a broken plugin must not take the gateway down
            _report_failure(pm, record, exc)
            continue
        _register(pm, plugin, record)

    if load_entry_points:
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = entry_point.dist
            record = PluginRecord(
                name=entry_point.name,
                source="entry point",
                distribution=f"{dist.name} {dist.version}" if dist is not None else None,
                version=dist.version if dist is not None else None,
            )
            if entry_point.name in disabled or (
                enabled is not None and entry_point.name not in enabled
            ):
                pm.record(msgspec.structs.replace(record, status="disabled"))
                continue
            if pm.get_plugin(entry_point.name) is not None:
                continue  # the same distribution found twice on sys.path
            try:
                plugin = _instantiate(entry_point.load(), settings.get(entry_point.name))
            except Exception as exc:
                _report_failure(pm, record, exc)
                continue
            _register(pm, plugin, record)

    for path in config.modules if config is not None else ():
        record = PluginRecord(name=path, source="config")
        if path in disabled:
            pm.record(msgspec.structs.replace(record, status="disabled"))
            continue
        try:
            target, module = _import_path(path)
            record = msgspec.structs.replace(record, version=_module_version(module))
            plugin = _instantiate(target, settings.get(path))
        except Exception as exc:
            _report_failure(pm, record, exc)
            continue
        _register(pm, plugin, record)

    pm.drop_invalid_plugins()
    if strict:
        failed = [r for r in pm.plugin_records() if r.status == "failed"]
        if failed:
            raise PluginLoadError(failed)
    return pm


def _instantiate(loaded: object, settings: Mapping[str, Any] | None) -> object:
    """The object to register: ``loaded``, or what its ``create_plugin`` makes."""
    factory = getattr(loaded, "create_plugin", None)
    if not isinstance(loaded, ModuleType) or not callable(factory):
        return loaded
    if "settings" in inspect.signature(factory).parameters:
        return factory(settings=dict(settings or {}))
    return factory()


def _import_path(path: str) -> tuple[object, ModuleType]:
    """``pkg.module`` or ``pkg.module:attr.sub`` -> (the object, its module)."""
    module_name, _, attribute = path.partition(":")
    module = importlib.import_module(module_name)
    target: object = module
    for part in attribute.split(".") if attribute else ():
        target = getattr(target, part)
    return target, module


def _module_version(module: ModuleType) -> str | None:
    top_level = module.__name__.partition(".")[0]
    for dist_name in importlib.metadata.packages_distributions().get(top_level, []):
        version = _distribution_version(dist_name)
        if version is not None:
            return version
    version = getattr(module, "__version__", None)
    return version if isinstance(version, str) else None


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _register(pm: InfermuxPluginManager, plugin: object, record: PluginRecord) -> None:
    try:
        pm.register(plugin, name=record.name)
    except Exception as exc:  # PluginValidationError: hookimpl arguments not in the spec
        _report_failure(pm, record, exc)
        return
    pm.record(record)


def _report_failure(pm: InfermuxPluginManager, record: PluginRecord, exc: BaseException) -> None:
    error = f"{type(exc).__name__}: {exc}"
    logger.warning("plugin %r (%s) failed and was skipped: %s", record.name, record.source, error)
    pm.record(msgspec.structs.replace(record, status="failed", error=error))

"""Creating the plugin manager: built-ins, then entry-point plugins, then ``check_pending``.

Nothing is loaded at import time; ``create_app`` (or ``infermux plugins``) calls
:func:`create_plugin_manager`. A plugin that fails to import, registers hooks with a wrong
signature or implements an unknown hook is reported (logged, listed by ``infermux plugins``)
and skipped; the gateway starts without it. The typed facade the gateway calls hooks
through is :class:`plugins.hook_facade.PluginHooks`, re-exported here.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from typing import TYPE_CHECKING, Literal

import msgspec
import pluggy

from plugins import hookspecs
from plugins.hook_facade import PluginHooks

if TYPE_CHECKING:
    from gateway.config import PluginsConfig

__all__ = [
    "BUILTIN_PLUGINS",
    "ENTRY_POINT_GROUP",
    "InfermuxPluginManager",
    "PluginHooks",
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
)

PluginStatus = Literal["loaded", "failed", "disabled"]


class PluginRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What happened to one plugin at load time."""

    name: str
    #: "builtin" or "entry point".
    source: str
    #: ``dist-name version`` for entry-point plugins.
    distribution: str | None = None
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


def create_plugin_manager(
    *,
    config: PluginsConfig | None = None,
    load_entry_points: bool = True,
) -> InfermuxPluginManager:
    """Build the plugin manager: hookspecs, built-ins, entry points (group ``infermux``).

    ``config.disable`` names are blocked (``builtin.routing``, or an entry point's name).
    """
    disabled = set(config.disable) if config is not None else set()
    pm = InfermuxPluginManager()
    pm.add_hookspecs(hookspecs)
    for name in disabled:
        pm.set_blocked(name)

    for name, module_name in BUILTIN_PLUGINS:
        if name in disabled:
            pm.record(PluginRecord(name=name, source="builtin", status="disabled"))
            continue
        try:
            module = importlib.import_module(module_name)
            factory = getattr(module, "create_plugin", None)
            plugin = factory() if callable(factory) else module
        except Exception as exc:  # a broken plugin must not take the gateway down
            _report_failure(pm, PluginRecord(name=name, source="builtin"), exc)
            continue
        _register(pm, plugin, PluginRecord(name=name, source="builtin"))

    if load_entry_points:
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = entry_point.dist
            record = PluginRecord(
                name=entry_point.name,
                source="entry point",
                distribution=f"{dist.name} {dist.version}" if dist is not None else None,
            )
            if entry_point.name in disabled:
                pm.record(msgspec.structs.replace(record, status="disabled"))
                continue
            if pm.get_plugin(entry_point.name) is not None:
                continue  # the same distribution found twice on sys.path
            try:
                plugin = entry_point.load()
            except Exception as exc:
                _report_failure(pm, record, exc)
                continue
            _register(pm, plugin, record)

    pm.drop_invalid_plugins()
    return pm


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

"""The engine policy hooks, adapted to the Protocols of :mod:`core_engine.policy`.

The core engine imports nothing from plugins; it consults an
:class:`~core_engine.policy.EnginePolicies` bundle. :func:`engine_policies` builds one whose
members call the hooks ``infermux_choose_quantization``, ``infermux_plan_kv_offload`` and
``infermux_choose_speculation`` (firstresult; the built-in defaults in
:mod:`plugins.builtin.policy` answer last). A plugin that raises or answers the wrong type
is logged and the engine's own default decides, so a broken policy cannot stop the engine
loop.

``create_app`` calls :func:`offer_engine_policies` before the backends start. A backend
with a ``use_policies(policies)`` method in the gateway's process (``engine_process =
false`` / ``worker_process = false``) gets the bundle of the gateway's plugin manager: the
core engine backend (its engine asks the quantization policy once per load, the KV offload
policy once per step while it has a host or disk tier, and the speculation policy per
request and step) and the llama.cpp backend (its prompt-lookup draft). A backend in a
worker process (:class:`~backends.worker.supervisor.WorkerBackend`) gets a
:class:`~backends.worker.protocol.PolicySource` instead: the ``[plugins]`` table, from
which the worker builds its own plugin manager and calls :func:`worker_policies` — the same
built-ins, entry points, config modules and settings, answering in the engine's process.
Plugins registered by code on the gateway's manager (tests, notebooks) cannot follow; a
warning says so when one implements an engine hook.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec
import pluggy

from core_engine.policy import (
    AdaptiveSpeculationPolicy,
    DefaultQuantizationPolicy,
    EnginePolicies,
    KVOffloadContext,
    KVOffloadDecision,
    QuantizationContext,
    QuantizationDecision,
    SpeculationContext,
    SpeculationDecision,
    WatermarkOffloadPolicy,
)

__all__ = ["HookPolicy", "engine_policies", "offer_engine_policies", "worker_policies"]

logger = logging.getLogger("plugins.policy")

D = TypeVar("D")

#: The hooks an engine consults (answered in the engine's process).
ENGINE_HOOKS = ("infermux_choose_quantization", "infermux_plan_kv_offload", "infermux_choose_speculation")


class HookPolicy:
    """Implements all three policy Protocols by calling the hooks of one plugin manager."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self._fallback_quantization = DefaultQuantizationPolicy()
        self._fallback_kv_offload = WatermarkOffloadPolicy()
        self._fallback_speculation = AdaptiveSpeculationPolicy()
        # One warning per hook, not one per engine step.
        self._warned: set[str] = set()

    def choose_quantization(self, context: QuantizationContext) -> QuantizationDecision:
        return self._ask(
            "infermux_choose_quantization",
            context,
            QuantizationDecision,
            self._fallback_quantization.choose_quantization,
        )

    def plan_kv_offload(self, context: KVOffloadContext) -> KVOffloadDecision:
        return self._ask(
            "infermux_plan_kv_offload",
            context,
            KVOffloadDecision,
            self._fallback_kv_offload.plan_kv_offload,
        )

    def choose_speculation(self, context: SpeculationContext) -> SpeculationDecision:
        return self._ask(
            "infermux_choose_speculation",
            context,
            SpeculationDecision,
            self._fallback_speculation.choose_speculation,
        )

    def _ask(
        self, hook_name: str, context: Any, decision_type: type[D], fallback: Callable[[Any], D]
    ) -> D:
        caller = getattr(self.pm.hook, hook_name)
        try:
            answer = caller(context=context)
        except Exception:
            self._warn_once(hook_name, "raised", exc_info=True)
            return fallback(context)
        if answer is None:
            return fallback(context)  # the built-in policy was disabled and nobody answered
        if not isinstance(answer, decision_type):
            if inspect.iscoroutine(answer):
                answer.close()  # an async hookimpl: policies run on the engine's step path
            self._warn_once(
                hook_name,
                f"answered {type(answer).__name__}, not a {decision_type.__name__} "
                "(policy hooks must be synchronous)",
            )
            return fallback(context)
        return answer

    def _warn_once(self, hook_name: str, what: str, *, exc_info: bool = False) -> None:
        if hook_name in self._warned:
            return
        self._warned.add(hook_name)
        logger.warning(
            "%s %s; the engine's default policy decides instead", hook_name, what, exc_info=exc_info
        )


def engine_policies(pm: pluggy.PluginManager) -> EnginePolicies:
    """The policies an engine should consult, answered by ``pm``'s plugins."""
    policy = HookPolicy(pm)
    return EnginePolicies(quantization=policy, kv_offload=policy, speculation=policy)


class _PluginSelection(msgspec.Struct, frozen=True, kw_only=True):
    """The part of ``[plugins]`` that says which plugins load (unknown keys are ignored)."""

    disable: list[str] = []
    enable: list[str] | None = None
    modules: list[str] = []
    settings: dict[str, dict[str, Any]] = {}
    strict: bool = False


def worker_policies(plugins: Mapping[str, Any]) -> EnginePolicies:
    """The policies of a worker process: its own plugin manager over the ``[plugins]``
    table ``plugins`` (plain data), with the built-ins and the installed entry points."""
    from plugins.manager import create_plugin_manager

    selection = msgspec.convert(dict(plugins), _PluginSelection)
    pm = create_plugin_manager(config=selection)  # type: ignore[arg-type]
    answering = sorted(
        {name for name, plugin in pm.list_name_plugin() if plugin is not None and not name.startswith("builtin.")
         and any(caller.name in ENGINE_HOOKS for caller in pm.get_hookcallers(plugin) or [])}
    )  # fmt: skip
    if answering:
        logger.info("engine policy hooks answered here by: %s", ", ".join(answering))
    return engine_policies(pm)


def offer_engine_policies(
    backends: Mapping[str, object], pm: pluggy.PluginManager, plugins: Any = None
) -> None:
    """Give every backend that consults policies the plugin-backed ones: the bundle of
    ``pm`` in this process, or, for a worker-process backend, the source it rebuilds them
    from in its worker (``plugins``: the ``[plugins]`` config; see the module docstring)."""
    from backends.worker.protocol import PolicySource

    policies: EnginePolicies | None = None
    source = PolicySource(
        factory=f"{__name__}:{worker_policies.__name__}",
        plugins=msgspec.to_builtins(plugins) if plugins is not None else {},
    )
    in_workers: list[str] = []
    for name, backend in backends.items():
        use_policy_source = getattr(backend, "use_policy_source", None)
        if callable(use_policy_source):
            if getattr(backend, "takes_policies", False):
                use_policy_source(source)
                in_workers.append(name)
            continue
        use_policies = getattr(backend, "use_policies", None)
        if callable(use_policies):
            policies = policies or engine_policies(pm)
            use_policies(policies)
    if in_workers:
        _warn_about_code_registered(pm, in_workers)


def _warn_about_code_registered(pm: pluggy.PluginManager, in_workers: list[str]) -> None:
    """Plugins added to ``pm`` by code answer only in-process engines: say so once."""
    from plugins.manager import InfermuxPluginManager

    loaded = set()  # names the worker loads too (built-ins, entry points, config modules)
    if isinstance(pm, InfermuxPluginManager):
        loaded = {r.name for r in pm.plugin_records() if r.source != "registered"}
    for name, plugin in pm.list_name_plugin():
        if plugin is None or name in loaded or name.startswith("builtin."):
            continue
        hooks = {caller.name for caller in pm.get_hookcallers(plugin) or []}
        if hooks & set(ENGINE_HOOKS):
            logger.warning(
                "plugin %r was registered by code: its engine hooks (%s) are not consulted by "
                "backends in worker processes (%s); package it with an entry point or list it in "
                "[plugins] modules, or set engine_process = false",
                name, ", ".join(sorted(hooks & set(ENGINE_HOOKS))), ", ".join(in_workers),
            )  # fmt: skip

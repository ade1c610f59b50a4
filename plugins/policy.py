"""The engine policy hooks, adapted to the Protocols of :mod:`core_engine.policy`.

The core engine imports nothing from plugins; it consults an
:class:`~core_engine.policy.EnginePolicies` bundle. :func:`engine_policies` builds one whose
members call the hooks ``infermux_choose_quantization``, ``infermux_plan_kv_offload`` and
``infermux_choose_speculation`` (firstresult; the built-in defaults in
:mod:`plugins.builtin.policy` answer last). A plugin that raises or answers the wrong type
is logged and the engine's own default decides, so a broken policy cannot stop the engine
loop. ``create_app`` hands the bundle to every backend that has a
``use_policies(policies)`` method, before it starts: the core engine backend (its engine
asks the quantization policy once per load, the KV offload policy once per step while it
has a host or disk tier, and the speculation policy per request and step), the llama.cpp
backend (its
prompt-lookup draft), and a worker-process backend wrapping one of those (the gateway side
asks once per request and relays the answer, see :mod:`backends.worker.supervisor`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

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

__all__ = ["HookPolicy", "engine_policies", "offer_engine_policies"]

logger = logging.getLogger("plugins.policy")

D = TypeVar("D")


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


def offer_engine_policies(backends: Mapping[str, object], pm: pluggy.PluginManager) -> None:
    """Give the plugin-backed policies to every backend with a ``use_policies`` method."""
    policies: EnginePolicies | None = None
    for backend in backends.values():
        use_policies = getattr(backend, "use_policies", None)
        if callable(use_policies):
            policies = policies or engine_policies(pm)
            use_policies(policies)

"""The built-in engine policies, as ``trylast`` hookimpls a plugin can override.

They answer ``infermux_choose_quantization``, ``infermux_plan_kv_offload`` and
``infermux_choose_speculation`` with the defaults of :mod:`core_engine.policy`, tuned by
the ``[plugins.settings."builtin.policy"]`` table of the routing config::

    [plugins.settings."builtin.policy".quantization.core_engine]   # per backend name
    weights = "auto"
    kv_cache = "int8"

    [plugins.settings."builtin.policy".kv_offload]
    low_watermark = 0.05
    high_watermark = 0.2
    prefetch_depth = 2

    [plugins.settings."builtin.policy".speculation]
    max_tokens = 16
    min_acceptance = 0.3
    max_batch = 16
    batch_tokens = 32
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from core_engine.policy import (
    AdaptiveSpeculationPolicy,
    DefaultQuantizationPolicy,
    KVOffloadContext,
    KVOffloadDecision,
    QuantizationContext,
    QuantizationDecision,
    SpeculationContext,
    SpeculationDecision,
    WatermarkOffloadPolicy,
)
from plugins.hookspecs import hookimpl

__all__ = ["PLUGIN_NAME", "BuiltinPolicies", "PolicySettings", "create_plugin"]

PLUGIN_NAME = "builtin.policy"


class KVOffloadSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    low_watermark: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.05
    high_watermark: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.2
    prefetch_depth: Annotated[int, msgspec.Meta(ge=0)] = 2


class SpeculationSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 16
    min_acceptance: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.3
    max_batch: Annotated[int, msgspec.Meta(ge=1)] = 16
    warmup_tokens: Annotated[int, msgspec.Meta(ge=0)] = 16
    batch_tokens: Annotated[int, msgspec.Meta(ge=1)] = 32


class QuantizationSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Same fields as :class:`~core_engine.policy.QuantizationDecision`, unknown keys refused."""

    weights: str = "auto"
    kv_cache: str = "auto"


class PolicySettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[plugins.settings."builtin.policy"]``."""

    #: Backend (model) name -> its dtypes.
    quantization: dict[str, QuantizationSettings] = {}
    kv_offload: KVOffloadSettings = KVOffloadSettings()
    speculation: SpeculationSettings = SpeculationSettings()


class BuiltinPolicies:
    """The defaults of :mod:`core_engine.policy`, configured from the settings table."""

    def __init__(self, settings: PolicySettings | None = None) -> None:
        settings = settings or PolicySettings()
        self.settings = settings
        self.quantization = DefaultQuantizationPolicy(
            {
                name: msgspec.convert(msgspec.to_builtins(q), QuantizationDecision)
                for name, q in settings.quantization.items()
            }
        )
        self.kv_offload = WatermarkOffloadPolicy(**msgspec.structs.asdict(settings.kv_offload))
        self.speculation = AdaptiveSpeculationPolicy(**msgspec.structs.asdict(settings.speculation))

    @hookimpl(trylast=True)
    def infermux_choose_quantization(self, context: QuantizationContext) -> QuantizationDecision:
        return self.quantization.choose_quantization(context)

    @hookimpl(trylast=True)
    def infermux_plan_kv_offload(self, context: KVOffloadContext) -> KVOffloadDecision:
        return self.kv_offload.plan_kv_offload(context)

    @hookimpl(trylast=True)
    def infermux_choose_speculation(self, context: SpeculationContext) -> SpeculationDecision:
        return self.speculation.choose_speculation(context)


def create_plugin(settings: Mapping[str, Any] | None = None) -> BuiltinPolicies:
    """A fresh plugin per plugin manager; bad settings raise ``ValueError`` naming the key."""
    try:
        decoded = msgspec.convert(dict(settings or {}), PolicySettings)
        return BuiltinPolicies(decoded)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f'plugins.settings."{PLUGIN_NAME}": {exc}') from exc

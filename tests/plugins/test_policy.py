"""Engine policies: the built-in defaults, their settings, and plugins that replace them."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from core_engine.policy import (
    AdaptiveSpeculationPolicy,
    EnginePolicies,
    KVOffloadContext,
    KVOffloadDecision,
    KVResidency,
    QuantizationContext,
    QuantizationDecision,
    SpeculationContext,
    SpeculationDecision,
    WatermarkOffloadPolicy,
)
from gateway.config.types import PluginsConfig
from plugins.hookspecs import hookimpl
from plugins.manager import PluginLoadError, create_plugin_manager
from plugins.policy import engine_policies
from plugins.testing import make_plugin_manager

MODEL = QuantizationContext(model_name="core_engine", model_path="/m.gguf", device="cpu")


def residency(req_id: str, status: str, tier: str, num_blocks: int, **kw: Any) -> KVResidency:
    return KVResidency(req_id=req_id, status=status, tier=tier, num_blocks=num_blocks, **kw)  # type: ignore[arg-type]


def speculation(**kw: Any) -> SpeculationContext:
    fields: dict[str, Any] = {
        "req_id": "r",
        "methods": ("ngram",),
        "num_prompt_tokens": 10,
        "num_output_tokens": 0,
    }
    return SpeculationContext(**{**fields, **kw})


# -- the defaults of core_engine.policy ---------------------------------------------------


def test_under_memory_pressure_the_longest_idle_requests_are_offloaded_never_running_ones() -> None:
    context = KVOffloadContext(
        num_device_blocks=100,
        num_free_device_blocks=2,
        num_free_host_blocks=50,
        requests=(
            residency("running", "running", "device", 40),
            residency("recent", "preempted", "device", 10, num_idle_steps=1),
            residency("stale", "preempted", "device", 10, num_idle_steps=50),
            residency("older", "waiting", "device", 10, num_idle_steps=20, queue_position=3),
        ),
    )
    decision = WatermarkOffloadPolicy(low_watermark=0.05, high_watermark=0.2).plan_kv_offload(
        context
    )
    # 2 free + 10 + 10 = 22 >= the high watermark (20): two requests suffice.
    assert decision.offload == ("stale", "older")
    assert decision.prefetch == ()


def test_offload_stops_where_the_host_tier_is_full() -> None:
    context = KVOffloadContext(
        num_device_blocks=100,
        num_free_device_blocks=0,
        num_free_host_blocks=15,
        requests=(
            residency("big", "preempted", "device", 20, num_idle_steps=9),
            residency("small", "preempted", "device", 10, num_idle_steps=1),
        ),
    )
    assert WatermarkOffloadPolicy().plan_kv_offload(context).offload == ("small",)


def test_with_room_the_next_offloaded_waiting_requests_are_prefetched() -> None:
    context = KVOffloadContext(
        num_device_blocks=100,
        num_free_device_blocks=60,
        num_free_host_blocks=0,
        requests=(
            residency("third", "waiting", "host", 10, queue_position=2),
            residency("first", "waiting", "host", 10, queue_position=0),
            residency("second", "waiting", "disk", 10, queue_position=1),
        ),
    )
    decision = WatermarkOffloadPolicy(prefetch_depth=2).plan_kv_offload(context)
    assert decision == KVOffloadDecision(prefetch=("first", "second"))


def test_speculation_follows_the_acceptance_rate_and_the_batch_size() -> None:
    policy = AdaptiveSpeculationPolicy(max_tokens=4, min_acceptance=0.3, max_batch=8)
    assert policy.choose_speculation(speculation()) == SpeculationDecision(
        method="ngram", num_speculative_tokens=2
    )
    good = speculation(num_proposed_tokens=100, num_accepted_tokens=90)
    assert policy.choose_speculation(good).num_speculative_tokens == 4
    poor = speculation(num_proposed_tokens=100, num_accepted_tokens=10)
    assert policy.choose_speculation(poor).method is None
    assert policy.choose_speculation(speculation(num_running=64)).method is None
    assert policy.choose_speculation(speculation(methods=("ngram", "draft"))).method == "draft"
    assert policy.choose_speculation(speculation(methods=())).method is None
    # k shrinks with the batch (batch_tokens // num_running - 1) before switching off.
    wide = AdaptiveSpeculationPolicy(max_tokens=16, max_batch=16, batch_tokens=32)
    assert [
        wide.choose_speculation(speculation(num_running=n)).num_speculative_tokens for n in (1, 4, 8, 15, 16)
    ] == [8, 7, 3, 1, 0]


def test_the_engine_defaults_need_no_plugins() -> None:
    policies = EnginePolicies()
    assert policies.quantization.choose_quantization(MODEL) == QuantizationDecision()


# -- through the hooks --------------------------------------------------------------------


def test_the_builtin_policy_answers_through_the_hooks_with_its_settings() -> None:
    settings = {
        "builtin.policy": {
            "quantization": {"core_engine": {"kv_cache": "int8"}},
            "speculation": {"max_tokens": 8},
        }
    }
    pm = make_plugin_manager(config=PluginsConfig(settings=settings))
    policies = engine_policies(pm)
    assert policies.quantization.choose_quantization(MODEL) == QuantizationDecision(kv_cache="int8")
    other = QuantizationContext(model_name="other", model_path="/o.gguf", device="cpu")
    assert policies.quantization.choose_quantization(other) == QuantizationDecision()
    assert policies.speculation.choose_speculation(speculation()).num_speculative_tokens == 4


def test_bad_builtin_policy_settings_are_reported_naming_the_key() -> None:
    bad = PluginsConfig(settings={"builtin.policy": {"speculation": {"max_tokns": 3}}})
    pm = create_plugin_manager(config=bad, load_entry_points=False)
    records = {r.name: r for r in pm.plugin_records()}
    assert records["builtin.policy"].status == "failed"
    assert 'plugins.settings."builtin.policy"' in (records["builtin.policy"].error or "")
    assert "max_tokns" in (records["builtin.policy"].error or "")
    with pytest.raises(PluginLoadError, match="builtin.policy"):
        create_plugin_manager(config=bad, load_entry_points=False, strict=True)


def test_a_plugin_policy_replaces_the_builtin_one_per_request() -> None:
    class TenantSpeculation:
        """Premium tenants get long proposals; everyone else the built-in policy."""

        @hookimpl
        def infermux_choose_speculation(self, context: SpeculationContext) -> Any:
            if context.labels.get("tenant") == "premium":
                return SpeculationDecision(method="ngram", num_speculative_tokens=7)
            return None

    policies = engine_policies(make_plugin_manager(TenantSpeculation()))
    premium = speculation(labels={"tenant": "premium"})
    assert policies.speculation.choose_speculation(premium).num_speculative_tokens == 7
    assert policies.speculation.choose_speculation(speculation()).num_speculative_tokens == 8


def test_a_broken_or_async_policy_falls_back_to_the_engine_default(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        @hookimpl
        def infermux_plan_kv_offload(self, context: KVOffloadContext) -> Any:
            raise RuntimeError("bug")

    class Async:
        @hookimpl
        async def infermux_choose_quantization(self, context: QuantizationContext) -> Any:
            return QuantizationDecision(weights="int4")

    policies = engine_policies(make_plugin_manager(Broken(), Async()))
    context = KVOffloadContext(num_device_blocks=10, num_free_device_blocks=10)
    with caplog.at_level(logging.WARNING, logger="plugins.policy"):
        for _ in range(3):
            assert policies.kv_offload.plan_kv_offload(context) == KVOffloadDecision()
        assert policies.quantization.choose_quantization(MODEL) == QuantizationDecision()
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("infermux_plan_kv_offload" in w for w in warnings) == 1  # once, not per step
    assert any("must be synchronous" in w for w in warnings)


def test_with_the_builtin_disabled_and_no_plugin_the_engine_default_decides() -> None:
    pm = make_plugin_manager(config=PluginsConfig(disable=["builtin.policy"]))
    policies = engine_policies(pm)
    assert policies.speculation.choose_speculation(speculation()).num_speculative_tokens == 8

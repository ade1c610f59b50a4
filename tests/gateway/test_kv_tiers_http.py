"""KV tiers and KV quantization through the whole stack: HTTP, the official client, policy
plugins, the core engine, ``/metrics`` and the request summary that tracing reads.

One live gateway on loopback serves the default model through two core-engine backends with a
small device KV pool:

* ``tiers``: ``kv_cache_dtype = "int8"`` in its options (the built-in quantization policy
  answers it) and a host tier; a plugin answers ``infermux_plan_kv_offload``.
* ``hooked``: options say nothing about the KV dtype; the plugin's
  ``infermux_choose_quantization`` answers int8 for it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from backends.base import BackendConfig
from core_engine.policy import (
    KVOffloadContext,
    KVOffloadDecision,
    QuantizationContext,
    QuantizationDecision,
)
from gateway.testing import LiveGateway, gateway_config, run_gateway
from plugins.hookspecs import hookimpl
from plugins.testing import HookRecorder, make_plugin_manager

WORDS = "river stone lamp orange quiet market seven window garden silver cloud paper".split()
#: Bytes of one fp32 KV block of SmolLM2-135M (30 layers x K/V x 16 tokens x 3 heads x 64).
FP32_BLOCK = 30 * 2 * 16 * 3 * 64 * 4
POOL_MB = 8


def passage(seed: int, words: int = 160) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


class TierPolicies:
    """The plugin under test: records the offload contexts; int8 KV for backend "hooked"."""

    def __init__(self) -> None:
        self.offload_contexts: list[KVOffloadContext] = []
        self.quantization_asked: list[str] = []

    @hookimpl
    def infermux_plan_kv_offload(self, context: KVOffloadContext) -> KVOffloadDecision:
        self.offload_contexts.append(context)
        return KVOffloadDecision()

    @hookimpl
    def infermux_choose_quantization(self, context: QuantizationContext) -> QuantizationDecision | None:
        self.quantization_asked.append(context.model_name)
        if context.model_name == "hooked":
            return QuantizationDecision(kv_cache="int8")
        return None  # the built-in policy answers: the backend's own options


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[LiveGateway, TierPolicies, HookRecorder]]:
    # Dense fp32 weights: the test compares a host-tier read with the cold run token for token,
    # and the int4 default's 8-bit activations can flip a near-tie between the two attention
    # orders (docs/core-engine-model.md).
    # In the gateway's process: the test reads what the plugin object saw (the hooks in an
    # engine process are driven through an installed plugin in test_speculation_policy.py).
    common = {
        "dtype": "float32", "weight_format": "dense", "num_threads": 1, "kv_cache_memory_mb": POOL_MB,
        "engine_process": False,
    }
    config = gateway_config(
        BackendConfig(
            name="tiers", kind="core_engine",
            options=common | {"kv_cache_dtype": "int8", "kv_host_bytes": 64 * 2**20},
        ),
        BackendConfig(name="hooked", kind="core_engine", options=common),
        models={"tiers": ["tiers"], "hooked": ["hooked"]},
    )
    policies = TierPolicies()
    recorder = HookRecorder(["infermux_on_request_end"])
    with run_gateway(config, plugin_manager=make_plugin_manager(policies, recorder)) as gateway:
        yield gateway, policies, recorder


def _complete(gateway: LiveGateway, recorder: HookRecorder, model: str, prompt: str) -> tuple[Any, Any]:
    recorder.clear()
    client = gateway.openai_client(timeout=300.0)
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    summary = recorder.wait_for("infermux_on_request_end", timeout_s=60)["summary"]
    return reply, summary


def _metric(text: str, prefix: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def test_the_quantization_policy_decides_the_kv_dtype_at_load(
    stack: tuple[LiveGateway, TierPolicies, HookRecorder],
) -> None:
    gateway, policies, _ = stack
    assert {"tiers", "hooked"} <= set(policies.quantization_asked)
    metrics = httpx.get(f"{gateway}/metrics").text
    fp32_tokens = (POOL_MB * 2**20 // FP32_BLOCK) * 16
    for backend in ("tiers", "hooked"):
        capacity = _metric(metrics, f'infermux_backend_kv_cache_capacity_tokens{{backend="{backend}"}}')
        # int8 blocks with their scales: ~3.9x the fp32 tokens in the same memory (>= 1.9x bf16).
        assert capacity >= 3.5 * fp32_tokens, (backend, capacity, fp32_tokens)


def test_an_evicted_prefix_comes_back_from_host_memory_and_the_summary_says_so(
    stack: tuple[LiveGateway, TierPolicies, HookRecorder],
) -> None:
    gateway, policies, recorder = stack
    first, summary = _complete(gateway, recorder, "tiers", passage(0))
    assert summary.usage.cached_tokens == 0
    for seed in range(1, 12):  # other prompts push the first one out of the device pool
        _complete(gateway, recorder, "tiers", passage(seed))
    again, summary = _complete(gateway, recorder, "tiers", passage(0))
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert summary.usage.cached_tokens_by_tier == {"host": again.usage.prompt_tokens_details.cached_tokens}
    # The engine asked the offload plugin each step, showing its running request.
    assert policies.offload_contexts
    assert any(r.status == "running" for c in policies.offload_contexts for r in c.requests)
    metrics = httpx.get(f"{gateway}/metrics").text
    assert _metric(metrics, 'infermux_backend_kv_tier_hit_tokens_total{backend="tiers",tier="host"}') > 0
    assert _metric(metrics, 'infermux_backend_kv_tier_bytes_moved_total{backend="tiers",direction="host_to_device"}') > 0
    assert _metric(metrics, 'infermux_backend_kv_tier_blocks{backend="tiers",tier="host"}') > 0
    assert _metric(metrics, 'infermux_backend_kv_tier_restore_seconds_total{backend="tiers",tier="host"}') > 0

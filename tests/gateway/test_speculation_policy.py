"""Speculation through the whole stack: HTTP, the official client, a policy plugin, the engine.

One live gateway on loopback serves the default model twice through the core engine: alias
``plain`` without speculation and ``spec`` with n-gram lookup. A plugin answers the hook
``infermux_choose_speculation``: off for tenant ``free``, four tokens for everyone else. The
figures come back through the request summary (``infermux_on_request_end``) that tracing and
metrics read, and through ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from backends.base import BackendConfig
from core_engine.policy import SpeculationContext, SpeculationDecision
from gateway.auth import hash_key
from gateway.config import ApiKeyConfig, AuthConfig
from gateway.testing import LiveGateway, gateway_config, run_gateway
from plugins.hookspecs import hookimpl
from plugins.testing import HookRecorder, make_plugin_manager

PAID, FREE = "sk-paid-0123456789", "sk-free-0123456789"

PASSAGE = (
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    total = 0.0\n"
    "    out = []\n"
    "    for i, value in enumerate(values):\n"
    "        total += value\n"
    "    return out\n"
)
MESSAGES = [{"role": "user", "content": f"Repeat this code exactly:\n{PASSAGE}"}]


class OffForFreeTier:
    """The policy plugin under test; records what the engine asked."""

    def __init__(self) -> None:
        self.tenants: set[str | None] = set()

    @hookimpl
    def infermux_choose_speculation(self, context: SpeculationContext) -> SpeculationDecision:
        self.tenants.add(context.tenant)
        if context.tenant == "free":
            return SpeculationDecision()
        return SpeculationDecision(method="ngram", num_speculative_tokens=4)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[LiveGateway, OffForFreeTier, HookRecorder]]:
    # Dense fp32 weights: the test compares speculative and plain output token for token, and
    # the int4 default's 8-bit activations can flip a near-tie between the verify pass's and
    # the decode step's attention (docs/core-engine-model.md).
    common = {"dtype": "float32", "weight_format": "dense", "num_threads": 1, "kv_cache_memory_mb": 64}
    config = gateway_config(
        BackendConfig(name="core-plain", kind="core_engine", options=common),
        BackendConfig(
            name="core-spec", kind="core_engine", options=common | {"speculation": {"methods": ["ngram"]}}
        ),
        models={"plain": ["core-plain"], "spec": ["core-spec"]},
        auth=AuthConfig(
            keys=[
                ApiKeyConfig(id="paid", tenant="paid", key_sha256=hash_key(PAID)),
                ApiKeyConfig(id="free", tenant="free", key_sha256=hash_key(FREE)),
            ]
        ),
    )
    policy = OffForFreeTier()
    recorder = HookRecorder(["infermux_on_request_end"])
    with run_gateway(config, plugin_manager=make_plugin_manager(policy, recorder)) as gateway:
        yield gateway, policy, recorder


def _ask(gateway: LiveGateway, key: str, model: str, recorder: HookRecorder, **params: Any) -> tuple[Any, Any]:
    recorder.clear()
    client = gateway.openai_client(api_key=key, timeout=300.0)
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=48, temperature=0, **params)
    summary = recorder.wait_for("infermux_on_request_end")["summary"]
    return reply, summary.choices[0].speculation


def test_greedy_output_over_http_is_the_plain_output(stack: tuple[LiveGateway, OffForFreeTier, HookRecorder]) -> None:
    gateway, _, recorder = stack
    plain, none = _ask(gateway, PAID, "plain", recorder)
    spec, stats = _ask(gateway, PAID, "spec", recorder)
    assert none is None  # the plain backend has no speculation configured
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    assert stats.method == "ngram" and stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    # Streaming gives the same text.
    client = gateway.openai_client(api_key=PAID, timeout=300.0)
    stream = client.chat.completions.create(model="spec", messages=MESSAGES, max_tokens=48, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == plain.choices[0].message.content


def test_a_policy_plugin_turns_speculation_off_for_one_tenant(
    stack: tuple[LiveGateway, OffForFreeTier, HookRecorder],
) -> None:
    gateway, policy, recorder = stack
    paid, paid_stats = _ask(gateway, PAID, "spec", recorder)
    free, free_stats = _ask(gateway, FREE, "spec", recorder)
    assert {"paid", "free"} <= policy.tenants  # the engine asked the plugin, per tenant
    assert paid_stats.num_draft_tokens > 0
    assert free_stats.num_draft_tokens == 0 and free_stats.num_drafts == 0
    assert free.choices[0].message.content == paid.choices[0].message.content
    metrics = httpx.get(f"{gateway}/metrics", headers={"Authorization": f"Bearer {PAID}"}).text
    line = next(
        ln for ln in metrics.splitlines()
        if ln.startswith('infermux_backend_spec_decode_num_draft_tokens_total{backend="core-spec"}')
    )
    assert float(line.split()[-1]) > 0

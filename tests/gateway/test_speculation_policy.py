"""Speculation through the whole stack: HTTP, the official client, a policy plugin, the engine.

One live gateway on loopback serves the default model twice through the core engine, each in
its own engine process (the default): alias ``plain`` without speculation and ``spec`` with
n-gram lookup. A plugin, installed as an entry point, answers the hook
``infermux_choose_speculation`` in the engine's process: off for tenant ``free``, four tokens
for everyone else; it logs the process and tenant of every question it answers. The
figures come back through the request summary (``infermux_on_request_end``) that tracing and
metrics read, and through ``/metrics``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.base import BackendConfig
from gateway.config.types import ApiKeyConfig, AuthConfig, PluginsConfig
from gateway.http.auth import hash_key
from gateway.testing import LiveGateway, gateway_config, run_gateway
from plugins.testing import HookRecorder, installed_plugin, make_plugin_manager

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

#: The policy plugin under test, as a distribution would ship it.
PLUGIN = """
    import json
    import os

    from core_engine.policy import SpeculationDecision
    from plugins.hookspecs import hookimpl


    class OffForFreeTier:
        def __init__(self, log):
            self.log = log

        @hookimpl
        def infermux_choose_speculation(self, context):
            with open(self.log, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "tenant": context.tenant}) + "\\n")
            if context.tenant == "free":
                return SpeculationDecision()
            return SpeculationDecision(method="ngram", num_speculative_tokens=4)


    def create_plugin(settings):
        return OffForFreeTier(settings["log"])
"""


class Stack:
    def __init__(self, gateway: LiveGateway, recorder: HookRecorder, log: Path) -> None:
        self.gateway, self.recorder, self.log = gateway, recorder, log

    def answered(self) -> list[dict[str, Any]]:
        """What the plugin answered so far: one record per question, in the engine process."""
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Dense fp32 weights: the test compares speculative and plain output token for token, and
    # the int4 default's 8-bit activations can flip a near-tie between the verify pass's and
    # the decode step's attention (docs/core-engine-model.md).
    common = {"dtype": "float32", "weight_format": "dense", "num_threads": 1, "kv_cache_memory_mb": 64}
    root = tmp_path_factory.mktemp("spec-policy")
    log = root / "answers.jsonl"
    plugins = PluginsConfig(settings={"spec-policy": {"log": str(log)}})
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
        plugins=plugins,
    )
    recorder = HookRecorder(["infermux_on_request_end"])
    with installed_plugin(root / "site", "spec-policy", PLUGIN):
        pm = make_plugin_manager(recorder, config=plugins, entry_points=True)
        with run_gateway(config, plugin_manager=pm) as gateway:
            yield Stack(gateway, recorder, log)


def _ask(stack: Stack, key: str, model: str, **params: Any) -> tuple[Any, Any]:
    gateway, recorder = stack.gateway, stack.recorder
    recorder.clear()
    client = gateway.openai_client(api_key=key, timeout=300.0)
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=48, temperature=0, **params)
    summary = recorder.wait_for("infermux_on_request_end")["summary"]
    return reply, summary.choices[0].speculation


def test_greedy_output_over_http_is_the_plain_output(stack: Stack) -> None:
    gateway = stack.gateway
    plain, none = _ask(stack, PAID, "plain")
    spec, stats = _ask(stack, PAID, "spec")
    assert none is None  # the plain backend has no speculation configured
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    assert stats.method == "ngram" and stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    # Streaming gives the same text.
    client = gateway.openai_client(api_key=PAID, timeout=300.0)
    stream = client.chat.completions.create(model="spec", messages=MESSAGES, max_tokens=48, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == plain.choices[0].message.content


def test_a_policy_plugin_turns_speculation_off_for_one_tenant(stack: Stack) -> None:
    gateway = stack.gateway
    paid, paid_stats = _ask(stack, PAID, "spec")
    free, free_stats = _ask(stack, FREE, "spec")
    answered = stack.answered()
    # The engine asked the plugin, per tenant, in its own process (not the gateway's).
    assert {"paid", "free"} <= {a["tenant"] for a in answered}
    assert {a["pid"] for a in answered} == {gateway.backend("core-spec").pid}
    assert os.getpid() not in {a["pid"] for a in answered}
    assert paid_stats.num_draft_tokens > 0
    assert free_stats.num_draft_tokens == 0 and free_stats.num_drafts == 0
    assert free.choices[0].message.content == paid.choices[0].message.content
    metrics = httpx.get(f"{gateway}/metrics", headers={"Authorization": f"Bearer {PAID}"}).text
    line = next(
        ln for ln in metrics.splitlines()
        if ln.startswith('infermux_backend_spec_decode_num_draft_tokens_total{backend="core-spec"}')
    )
    assert float(line.split()[-1]) > 0

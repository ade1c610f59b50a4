"""Issue 44: the prefix caches are partitioned by tenant, so ``cached_tokens`` never tells one
API key how another key's prompt began.

Through a live gateway with API keys on the core engine and the default model: another
tenant's identical prompt is cold while the same tenant's hits; a request's own ``cache_salt``
narrows its tenant's partition; tenants of one ``[[cache.sharing_groups]]`` share a long
system prompt and a tenant outside it does not; the ``cache_aware`` router neither counts nor
follows another tenant's prefix. The engine's host and disk tiers and its prefix pins are
checked on the tiny engine with two salts (what the gateway derives per tenant).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from backends.base import BackendConfig, ChatMessage, GenerationRequest
from core_engine.kv_offload.block_copy import tier_block_nbytes
from core_engine.llm_engine import LLMEngine
from core_engine.output import RequestOutput
from core_engine.sampling_params import SamplingParams
from gateway.config.load import config_from_dict
from gateway.config.types import ApiKeyConfig, AuthConfig, ConfigError, InfermuxConfig, LimitsConfig
from gateway.http.auth import hash_key
from gateway.openai.request_conversion import RequestContext
from gateway.testing import LiveGateway, gateway_config
from plugins.builtin.cache_aware import CacheAwareStrategy
from plugins.builtin.strategies import RoutingContext
from tests.core_engine.engine_util import engine_like, make_engine
from tests.core_engine.gguf_factory import TinyLlamaSpec, write_llama_gguf
from tests.routing.test_cache_aware import _replica  # the same two small replicas

MODEL = "smol"
GROUP = [f"app{i}" for i in range(8)]
TENANTS = ["alpha", "beta", "outsider", *GROUP]
#: One key per tenant: its secret is "key-<tenant>".
AUTH = AuthConfig(keys=[ApiKeyConfig(id=t, tenant=t, key_sha256=hash_key(f"key-{t}")) for t in TENANTS])
SHARING = {"sharing_groups": [{"name": "acme-apps", "tenants": GROUP}]}


def keyed_config(*backends: BackendConfig, **kwargs: Any) -> InfermuxConfig:
    """``gateway_config`` with the keys above and the sharing group, validated as a file is."""
    raw = msgspec.to_builtins(gateway_config(*backends, auth=AUTH, **kwargs))
    return config_from_dict({**raw, "cache": SHARING})


def headers(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer key-{tenant}"}


def text(seed: int, words: int) -> str:
    vocabulary = "river stone lamp orange quiet market seven window garden silver cloud paper".split()
    rng = random.Random(seed)
    return " ".join(rng.choice(vocabulary) for _ in range(words))


# -- through the gateway, one engine --------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(live_gateway: Any) -> Iterator[LiveGateway]:
    engine = BackendConfig(
        name="engine", kind="core_engine", options={"num_threads": 1, "kv_cache_memory_mb": 128}
    )
    with live_gateway(keyed_config(engine, models={MODEL: ["engine"]})) as gw:
        yield gw


def chat(gw: LiveGateway, tenant: str, system: str, question: str, **extra: Any) -> httpx.Response:
    body = {
        "model": MODEL, "max_tokens": 1, "temperature": 0, **extra,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }  # fmt: skip
    return httpx.post(f"{gw}/v1/chat/completions", json=body, headers=headers(tenant), timeout=300)


def cached_tokens(gw: LiveGateway, tenant: str, system: str, question: str, **extra: Any) -> int:
    response = chat(gw, tenant, system, question, **extra)
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_another_tenants_identical_prompt_is_cold_and_the_same_tenants_hits(gateway: LiveGateway) -> None:
    system = text(1, 700)  # ~700 tokens
    assert cached_tokens(gateway, "alpha", system, "Summarise.") == 0
    assert cached_tokens(gateway, "beta", system, "Summarise.") == 0
    assert cached_tokens(gateway, "alpha", system, "Summarise.") >= 640
    # The completions endpoint is partitioned alike.
    prompt = text(2, 700)
    answers = [
        httpx.post(
            f"{gateway}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
            headers=headers(tenant),
            timeout=300,
        ).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        for tenant in ("beta", "alpha", "beta")
    ]
    assert answers[:2] == [0, 0] and answers[2] >= 640


def test_a_client_cache_salt_narrows_within_its_tenant(gateway: LiveGateway) -> None:
    system = text(3, 700)
    assert cached_tokens(gateway, "alpha", system, "Go.") == 0
    # Alpha's own unsalted prefix is not the salted partition's ...
    assert cached_tokens(gateway, "alpha", system, "Go.", cache_salt="x") == 0
    assert cached_tokens(gateway, "alpha", system, "Go.", cache_salt="x") >= 640
    # ... and the same salt from another tenant names another partition.
    assert cached_tokens(gateway, "beta", system, "Go.", cache_salt="x") == 0


@pytest.mark.parametrize("salt", ["", "s" * 257, 7, ["x"]])
def test_a_bad_cache_salt_is_a_400_naming_it(gateway: LiveGateway, salt: object) -> None:
    response = chat(gateway, "alpha", "Hi.", "Hi.", cache_salt=salt)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "cache_salt"


def test_a_sharing_group_shares_one_long_prefix_and_an_outsider_does_not(gateway: LiveGateway) -> None:
    system = text(4, 1900)  # ~2k tokens, within SmolLM2's 8192
    tokenized = [
        httpx.post(
            f"{gateway}/tokenize",
            json={"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]},
            headers=headers("app0"),
            timeout=60,
        ).json()["tokens"]
        for q in ("Question 0?", "Question 1?")
    ]
    shared = next(i for i, (a, b) in enumerate(zip(*tokenized, strict=False)) if a != b)
    full_blocks = shared // 16 * 16
    assert full_blocks >= 1800
    hits = [cached_tokens(gateway, tenant, system, f"Question {i}?") for i, tenant in enumerate(GROUP)]
    assert hits[0] == 0
    assert all(hit >= full_blocks for hit in hits[1:]), (hits, full_blocks)
    assert cached_tokens(gateway, "outsider", system, "Question 8?") == 0


def test_a_tenant_in_two_sharing_groups_is_a_config_error() -> None:
    raw = msgspec.to_builtins(gateway_config(auth=AUTH))
    groups = [{"name": "one", "tenants": ["alpha", "beta"]}, {"name": "two", "tenants": ["beta"]}]
    with pytest.raises(ConfigError) as caught:
        config_from_dict({**raw, "cache": {"sharing_groups": groups}})
    assert caught.value.key == "cache.sharing_groups[1].tenants"
    assert "'beta'" in str(caught.value)


# -- the cache_aware router -----------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(live_gateway: Any) -> Iterator[LiveGateway]:
    config = keyed_config(_replica("r0"), _replica("r1"), models={MODEL: ["r0", "r1"]}, strategy="cache_aware")
    with live_gateway(config) as gw:
        yield gw


def tenant_salt(config: InfermuxConfig, tenant: str) -> str | None:
    """The ``cache_salt`` the gateway gives a request of ``tenant`` that sends none."""
    partition = config.cache.partition_of(tenant)
    return RequestContext(request_id="probe", limits=LimitsConfig(), cache_partition=partition).cache_salt(None)


def probe(system: str, question: str, salt: str | None) -> GenerationRequest:
    return GenerationRequest(
        request_id="probe", model=MODEL, kind="chat", cache_salt=salt,
        messages=(ChatMessage(role="system", content=system), ChatMessage(role="user", content=question)),
    )  # fmt: skip


def cached_by_replica(gw: LiveGateway, request: GenerationRequest) -> dict[str, int]:
    """The router's matched tokens per replica for ``request``, decided on the gateway's loop
    (it tokenizes through the worker channel, which lives there)."""
    strategy = gw.state.require_router()._routes[MODEL].strategy
    assert isinstance(strategy, CacheAwareStrategy)
    loop = gw.backend("r0")._worker.reader.get_loop()
    decide = strategy.adecide(["r0", "r1"], request, {"r0": 0, "r1": 0})
    _, decision = asyncio.run_coroutine_threadsafe(decide, loop).result(timeout=60)
    return matched_tokens(decision)


def matched_tokens(decision: dict[str, Any]) -> dict[str, int]:
    """The matched (cached) tokens per backend of a routing decision."""
    return {row["backend"]: row["cached_tokens"] for row in decision["backends"]}


def test_the_cache_aware_router_neither_counts_nor_follows_another_tenants_prefix(replicas: LiveGateway) -> None:
    config = replicas.state.config
    system = text(5, 200)
    response = chat(replicas, "alpha", system, "Hello?")
    assert response.status_code == 200, response.text
    owner = response.headers["x-infermux-backend"]
    # Alpha's next request would be drawn to the owner by its cached prefix ...
    alpha = cached_by_replica(replicas, probe(system, "Again?", tenant_salt(config, "alpha")))
    assert alpha[owner] >= 128, alpha
    # ... beta's is matched nowhere: no replica holds its partition's prefix.
    assert cached_by_replica(replicas, probe(system, "Again?", tenant_salt(config, "beta"))) == {"r0": 0, "r1": 0}
    # Wherever beta's request lands, it computes the prefix itself.
    assert cached_tokens(replicas, "beta", system, "Again?") == 0


def test_the_approximate_prefix_map_is_keyed_by_salt_too() -> None:
    """Backends that do not report their cache: what the router sent where, per salt."""
    strategy = CacheAwareStrategy()
    strategy.configure(RoutingContext(alias=MODEL, backends=("a", "b", "c")))
    system = text(6, 200)
    first = strategy.order(["a", "b", "c"], probe(system, "one", "salt-alpha"), {})[0]

    def matched(salt: str) -> dict[str, int]:
        _, decision = asyncio.run(strategy.adecide(["a", "b", "c"], probe(system, "two", salt), {}))
        return matched_tokens(decision)

    assert matched("salt-alpha")[first] > 0
    assert matched("salt-beta") == {"a": 0, "b": 0, "c": 0}


# -- the engine's host and disk tiers and its pins, two salts ---------------------------------

BS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    path = write_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", spec=TinyLlamaSpec(context_length=2048))
    return make_engine(path, kv_cache_memory_bytes=2**20)


def generate(engine: LLMEngine, req_id: str, prompt: list[int], salt: str | None, **params: Any) -> RequestOutput:
    sampling = SamplingParams(max_tokens=2, temperature=0.0, **params)
    engine.add_request(req_id, engine.make_request(req_id, prompt, sampling, cache_salt=salt))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None
    return final


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(4 * BS)] for _ in range(n)]


def test_blocks_restored_from_disk_after_a_restart_hit_only_their_own_salt(tiny: LLMEngine, tmp_path: Path) -> None:
    first = engine_like(tiny, kv_disk_dir=str(tmp_path))
    written = prompts(3, seed=7)
    for i, prompt in enumerate(written):
        assert generate(first, f"w{i}", prompt + [1], "alpha").num_cached_tokens == 0
    first.close()  # queued writes reach the disk
    second = engine_like(tiny, kv_disk_dir=str(tmp_path))
    for i, prompt in enumerate(written):
        out = generate(second, f"b{i}", prompt + [2], "beta")
        assert out.num_cached_tokens == 0 and not out.cached_tokens_by_tier, out.cached_tokens_by_tier
        out = generate(second, f"n{i}", prompt + [2], None)  # nor the unsalted partition
        assert out.num_cached_tokens == 0
    for i, prompt in enumerate(written):
        out = generate(second, f"a{i}", prompt + [2], "alpha")
        assert out.cached_tokens_by_tier == {"disk": 4 * BS}
    second.close()


def test_blocks_offloaded_to_host_memory_hit_only_their_own_salt(tiny: LLMEngine) -> None:
    block = tier_block_nbytes(tiny.model_runner.kv_cache)
    engine = engine_like(tiny, kv_cache_memory_bytes=10 * block, kv_host_memory_bytes=64 * block)
    written = prompts(4, seed=8)  # 4 x 4 blocks through a 10-block pool: the first go to host
    for i, prompt in enumerate(written):
        generate(engine, f"w{i}", prompt + [1], "alpha")
    assert generate(engine, "b", written[0] + [2], "beta").num_cached_tokens == 0
    assert generate(engine, "a", written[1] + [2], "alpha").cached_tokens_by_tier == {"host": 4 * BS}


def test_a_pinned_prefix_is_pinned_for_its_salt_only(tiny: LLMEngine) -> None:
    engine = engine_like(tiny)
    (system,) = prompts(1, seed=9)
    generate(engine, "pin", system + [7], "alpha", pin_prefix=((4 * BS, 600.0),))
    assert engine.kv_cache_manager.num_pinned_blocks == 4
    assert generate(engine, "beta", system + [8], "beta").num_cached_tokens == 0
    assert generate(engine, "alpha", system + [9], "alpha").num_cached_tokens == 4 * BS

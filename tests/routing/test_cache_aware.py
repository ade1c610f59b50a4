"""The ``cache_aware`` strategy on the real path: two core-engine replicas in their worker
processes publish their prefix-cache events over the worker channel; the router sends a
request sharing a prefix to the replica that cached it, the load bound overrides that
affinity, and evicted blocks (removed events) take a replica's claim away. Then the pieces
alone: the engine's bounded event log, and the approximate prefix map (TTL, size cap) with
an injected clock."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from backends.base import BackendConfig, ChatMessage, GenerationRequest
from backends.prefix_cache import CacheEvents, PrefixCacheIndex
from core_engine.block_pool import BlockPool
from core_engine.kv_cache_manager import KVCacheManager, prompt_block_hashes
from core_engine.request import Request
from core_engine.sampling_params import SamplingParams
from gateway.testing import gateway_config
from plugins.builtin.cache_aware import CacheAwareStrategy
from plugins.builtin.prefix_map import PrefixMap, prompt_text_hashes
from plugins.builtin.strategies import RoutingContext

ALIAS = "smol"


def wait_until(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def _system(topic: str) -> str:
    # About 150 tokens: several full 16-token blocks shared by every request of the "tenant".
    return f"You are the assistant of the {topic} team. " + " ".join(
        f"Rule {i}: answer questions about {topic} briefly and politely." for i in range(12)
    )


def _replica(name: str) -> BackendConfig:
    return BackendConfig(
        name=name, kind="core_engine",
        options={"num_threads": 1, "kv_cache_memory_mb": 24, "max_num_seqs": 4, "max_model_len": 1024},
    )  # fmt: skip


@pytest.fixture(scope="module")
def replicas(live_gateway: Any) -> Iterator[Any]:
    config = gateway_config(_replica("r0"), _replica("r1"), models={ALIAS: ["r0", "r1"]}, strategy="cache_aware")
    with live_gateway(config) as gw:
        yield gw


def _chat(gw: str, system: str, question: str, *, pin: str | None = None) -> str:
    body = {
        "model": ALIAS, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }  # fmt: skip
    headers = {"x-infermux-backend": pin} if pin else {}
    response = httpx.post(f"{gw}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.headers["x-infermux-backend"]


def _strategy(gw: Any) -> CacheAwareStrategy:
    strategy = gw.state.router._routes[ALIAS].strategy
    assert isinstance(strategy, CacheAwareStrategy)
    return strategy


def _request(system: str, question: str) -> GenerationRequest:
    return GenerationRequest(
        request_id="probe", model=ALIAS, kind="chat",
        messages=(ChatMessage(role="system", content=system), ChatMessage(role="user", content=question)),
    )  # fmt: skip


def _decide(gw: Any, request: GenerationRequest, outstanding: dict[str, int]) -> tuple[list[str], dict[str, Any]]:
    """The strategy's answer for ``request`` under made-up open-stream counts (the one
    input a test cannot hold steady with real streams), on the gateway's loop: it tokenizes
    through the worker channel, which lives there."""
    loop = gw.backend("r0")._worker.reader.get_loop()
    future = asyncio.run_coroutine_threadsafe(_strategy(gw).adecide(["r0", "r1"], request, outstanding), loop)
    return future.result(timeout=60)


@pytest.mark.slow
def test_a_shared_prefix_goes_back_to_the_replica_that_cached_it(replicas: Any) -> None:
    topics = ["billing", "shipping", "returns", "warranty"]
    first = {topic: _chat(replicas, _system(topic), "Hello?") for topic in topics}
    # New prefixes spread (least loaded, rotating): both replicas got some.
    assert set(first.values()) == {"r0", "r1"}
    for topic in topics:
        for question in ("Where is my order?", "Can I pay by card?"):
            assert _chat(replicas, _system(topic), question) == first[topic], topic
    # What the engine reported is what the router matched: each replica's index holds the
    # prefix blocks of its own topics only.
    index = {name: replicas.backend(name).prefix_cache() for name in ("r0", "r1")}
    assert all(isinstance(i, PrefixCacheIndex) and i.block_size == 16 for i in index.values())
    for topic, owner in first.items():
        other = "r1" if owner == "r0" else "r0"
        _, decision = _decide(replicas, _request(_system(topic), "Anything else?"), {"r0": 0, "r1": 0})
        cached = {row["backend"]: row["cached_tokens"] for row in decision["backends"]}
        assert cached[owner] >= 128 and cached[other] == 0, (topic, cached)


@pytest.mark.slow
def test_the_load_bound_overrides_affinity(replicas: Any) -> None:
    system = _system("load")
    owner = _chat(replicas, system, "Hello?")
    other = "r1" if owner == "r0" else "r0"
    request = _request(system, "Next question?")
    order, _ = _decide(replicas, request, {owner: 0, other: 0})
    assert order[0] == owner
    # Default factor 1.5: next to an idle replica, one open stream is already too many
    # (1 + 1 > 1.5 * (0 + 1)) ...
    order, _ = _decide(replicas, request, {owner: 1, other: 0})
    assert order[0] == other
    # ... while with both busy the cached one still wins (2 + 1 <= 1.5 * (1 + 1) holds).
    order, _ = _decide(replicas, request, {owner: 2, other: 1})
    assert order[0] == owner
    # Far above the least loaded: the other replica, although it holds nothing.
    order, decision = _decide(replicas, request, {owner: 6, other: 1})
    assert order == [other, owner]
    rows = {row["backend"]: row for row in decision["backends"]}
    assert rows[owner]["cached_tokens"] > 0 and not rows[owner]["eligible"]


@pytest.mark.slow
def test_evicted_blocks_take_the_replica_out(replicas: Any) -> None:
    system = _system("eviction")
    owner = _chat(replicas, system, "Hello?")
    request = _request(system, "Again?")
    _, decision = _decide(replicas, request, {"r0": 0, "r1": 0})
    assert {r["backend"]: r["cached_tokens"] for r in decision["backends"]}[owner] > 0
    index = replicas.backend(owner).prefix_cache()
    num_blocks = int(replicas.backend(owner).stats()["kv_cache_num_blocks"])
    # Other long prompts pinned to the owner push its cached blocks out (LRU).
    for i in range(num_blocks // 8 + 2):
        _chat(replicas, _system(f"filler {i}") * 2, "Hi", pin=owner)
    wait_until(lambda: index.num_batches > 0)
    _, decision = _decide(replicas, request, {"r0": 0, "r1": 0})
    assert {r["backend"]: r["cached_tokens"] for r in decision["backends"]}[owner] == 0


# -- the pieces alone ---------------------------------------------------------------------------


def _cached_request(kv: KVCacheManager, req_id: str, token_ids: list[int]) -> Request:
    request = Request(req_id, token_ids, SamplingParams(max_tokens=1), max_tokens=1)
    hits, _ = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, len(token_ids) - len(hits) * kv.block_size, hits) is not None
    return request


def test_engine_events_track_stored_and_evicted_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    index = PrefixCacheIndex()
    prompt = list(range(100, 109))  # two full blocks and one token
    first = _cached_request(kv, "a", prompt)
    index.apply(_events(kv))
    assert index.num_leading_blocks(prompt_block_hashes(prompt, 4)) == 2
    kv.free(first)
    # Another prompt needs every block: the cached ones are handed out again.
    _cached_request(kv, "b", list(range(200, 216)))
    index.apply(_events(kv))
    assert index.num_leading_blocks(prompt_block_hashes(prompt, 4)) == 0
    assert index.num_leading_blocks(prompt_block_hashes(list(range(200, 216)), 4)) == 4


def _events(kv: KVCacheManager) -> CacheEvents:
    batch = kv.block_pool.take_kv_events()
    return CacheEvents(block_size=kv.block_size, stored=batch.stored, removed=batch.removed, reset=batch.reset)


def test_the_event_log_is_bounded_and_resyncs_with_a_snapshot() -> None:
    pool = BlockPool(8)
    pool.events.max_pending = 3
    blocks = pool.get_new_blocks(8)
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, bytes([i]) * 16)
    batch = pool.take_kv_events()
    assert batch.reset and sorted(batch.stored) == sorted(bytes([i]) * 16 for i in range(8))
    assert pool.events.num_resets == 1
    assert pool.take_kv_events().is_empty  # nothing since the snapshot


def test_the_prefix_map_expires_after_its_ttl() -> None:
    now = [0.0]
    prefix_map = PrefixMap(ttl_s=10.0, clock=lambda: now[0])
    hashes = prompt_text_hashes(_request(_system("ttl"), "q"))
    prefix_map.record("a", hashes)
    assert prefix_map.num_leading_blocks("a", hashes) == len(hashes) > 0
    assert prefix_map.num_leading_blocks("b", hashes) == 0
    now[0] = 9.9
    assert prefix_map.num_leading_blocks("a", hashes) == len(hashes)
    now[0] = 10.0
    assert prefix_map.num_leading_blocks("a", hashes) == 0
    assert prefix_map.num_entries("a") == 0


def test_the_prefix_map_keeps_at_most_max_entries() -> None:
    old = prompt_text_hashes(_request(_system("old"), "q"))
    new = prompt_text_hashes(_request(_system("new"), "q"))
    prefix_map = PrefixMap(max_entries=len(new))
    prefix_map.record("a", old)
    assert prefix_map.num_leading_blocks("a", old) == len(old)
    prefix_map.record("a", new)
    assert prefix_map.num_entries("a") == len(new)
    assert prefix_map.num_leading_blocks("a", new) == len(new)
    assert prefix_map.num_leading_blocks("a", old) == 0  # the least recently routed went


def test_approximate_affinity_without_reported_caches() -> None:
    """Backends without ``prefix_cache()`` (llama.cpp, remote): the strategy remembers what
    it routed where."""
    strategy = CacheAwareStrategy()
    strategy.configure(RoutingContext(alias=ALIAS, backends=("a", "b", "c")))
    shared = _system("approx")
    first = strategy.order(["a", "b", "c"], _request(shared, "one"), {})[0]
    for question in ("two", "three", "four"):
        assert strategy.order(["a", "b", "c"], _request(shared, question), {})[0] == first
    # A different prefix goes elsewhere when the first replica is busier.
    assert strategy.order(["a", "b", "c"], _request(_system("other"), "one"), {first: 1})[0] != first

"""Pinned prompt prefixes (``SamplingParams.pin_prefix``, Anthropic's ``cache_control``):
kept in the prefix cache through traffic that evicts everything else, released at the TTL."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from core_engine.kv_cache_manager import KVCacheManager
from core_engine.request import Request
from core_engine.sampling_params import SamplingParams
from tests.core_engine.engine_util import make_engine, run_all
from tests.core_engine.gguf_factory import write_llama_gguf

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # the tiny model's KV bytes per 16-token block


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def _cached_tokens(engine, req_id: str, prompt: list[int]) -> int:
    out = run_all(engine, {req_id: prompt}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    return out[req_id]["outputs"][-1].num_cached_tokens


def _flood(engine, rng: random.Random, vocab: int) -> None:
    # 12 distinct 60-token prompts through a 16-block pool: every unpinned prefix is evicted.
    for i in range(12):
        _cached_tokens(engine, f"flood-{rng.random()}-{i}", [rng.randrange(3, vocab) for _ in range(60)])


@pytest.mark.parametrize(("ttl_s", "pinned"), [(600.0, True), (None, False), (0.0, False)])
def test_a_pinned_prefix_survives_traffic_until_its_ttl(tiny_path: Path, ttl_s: float | None, pinned: bool) -> None:
    engine = make_engine(tiny_path, kv_cache_memory_bytes=16 * BLOCK_BYTES)
    vocab = engine.model_config.vocab_size
    rng = random.Random(5)
    system = [rng.randrange(3, vocab) for _ in range(64)]  # 4 blocks
    pin = ((64, ttl_s),) if ttl_s is not None else ()
    engine.add_request("first", system + [7, 8], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True,
                                                                  pin_prefix=pin))
    while engine.has_unfinished_requests():
        engine.step()
    _flood(engine, rng, vocab)
    hit = _cached_tokens(engine, "again", system + [9, 10])
    assert hit == (64 if pinned else 0)
    assert engine.kv_cache_manager.num_pinned_blocks == (4 if pinned else 0)


def test_pins_hold_at_most_a_quarter_of_the_pool() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = Request("r", list(range(32)), SamplingParams(), max_tokens=1)
    kv.allocate_slots(request, 32)
    assert kv.pin_prefix(request, 32, 60.0, now=0.0) == 8  # 2 blocks of 4 tokens
    kv.free(request)
    assert kv.num_pinned_blocks == 2 and kv.num_free_blocks == 6
    assert kv.expire_pins(now=59.0) == 0
    assert kv.expire_pins(now=60.0) == 2 and kv.num_free_blocks == 8


def test_one_tenant_pins_at_most_its_share_of_the_pins() -> None:
    # 64 blocks: pins hold 16 at most, one tenant a quarter of them (4 blocks of 4 tokens).
    kv = KVCacheManager(num_blocks=64, block_size=4, pin_tenant_share=0.25)
    assert kv.max_pinned_blocks == 16 and kv.max_pinned_blocks_per_tenant == 4

    def pin(req_id: str, tenant: str | None, first: int) -> int:
        request = Request(req_id, list(range(first, first + 40)), SamplingParams(), max_tokens=1, tenant=tenant)
        kv.allocate_slots(request, 40)
        pinned = kv.pin_prefix(request, 40, 60.0, now=0.0)
        kv.free(request)
        return pinned

    assert pin("a1", "acme", 0) == 16  # 10 blocks asked, the tenant's 4 pinned
    assert pin("a2", "acme", 1000) == 0  # at its share: nothing more
    assert pin("b1", "globex", 2000) == 16  # another tenant has its own share
    assert pin("open", None, 3000) == 32  # no tenant (open mode): the pool-wide cap only (8 left)
    assert kv.num_pinned_blocks == 16
    assert kv.expire_pins(now=60.0) == 16
    assert pin("a3", "acme", 4000) == 16  # expired pins give the share back

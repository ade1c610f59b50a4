from __future__ import annotations

from core_engine.kv_cache_manager import KVCacheManager
from core_engine.sampling_params import SamplingParams
from tests.core_engine.sim import make_request


def test_block_table_grows_with_the_sequence() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request(6)
    assert len(kv.allocate_slots(req, 6)) == 2
    req.num_computed_tokens = 6
    req.append_output_token(1)
    req.append_output_token(2)
    # Tokens 6 and 7 still fit block 2; token 8 needs a third block.
    assert kv.allocate_slots(req, 2) == []
    req.num_computed_tokens = 8
    req.append_output_token(3)
    assert len(kv.allocate_slots(req, 1)) == 1
    assert len(kv.get_block_ids(req.req_id)) == 3


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_request(8), make_request(8)
    assert kv.allocate_slots(a, 8) is not None
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_block_ids(b.req_id) == []
    assert kv.num_free_blocks == 1


def test_free_returns_every_block_at_once() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request(13)
    kv.allocate_slots(req, 13)
    assert kv.num_free_blocks == 0
    kv.free(req)
    assert kv.num_free_blocks == 4
    assert kv.get_block_ids(req.req_id) == []


def test_prefix_hits_cover_full_blocks_and_leave_one_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request(list(range(12)))
    kv.allocate_slots(first, 12)
    # Same 12 tokens: only 2 blocks may hit so that the last token is computed for logits.
    same = make_request(list(range(12)))
    blocks, num_tokens = kv.get_computed_blocks(same)
    assert num_tokens == 8 and [b.block_id for b in blocks] == kv.get_block_ids(first.req_id)[:2]
    # A prompt that diverges inside block 2 hits block 1 only.
    diverging = make_request([*range(6), 99, 98, 97])
    assert kv.get_computed_blocks(diverging)[1] == 4


def test_prompt_logprob_requests_bypass_the_cache() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.allocate_slots(make_request(list(range(12))), 12)
    echo = make_request(list(range(12)), params=SamplingParams(prompt_logprobs=0))
    assert kv.get_computed_blocks(echo) == ([], 0)


def test_hits_are_shared_not_copied() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request(list(range(9)))
    kv.allocate_slots(a, 9)
    b = make_request([*range(8), 50, 51])
    hits, n = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is not None
    assert kv.get_block_ids(b.req_id)[:2] == kv.get_block_ids(a.req_id)[:2]
    assert kv.num_free_blocks == 6 - 3 - 1
    kv.free(a)
    assert all(blk.ref_cnt == 1 for blk in hits)

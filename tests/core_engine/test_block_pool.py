from __future__ import annotations

import pytest

from core_engine.block_pool import BlockPool


def test_blocks_are_handed_out_once_until_freed() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    assert len({b.block_id for b in a}) == 3
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    pool.free_blocks(a)
    assert pool.num_free_blocks == 4
    assert pool.usage == 0.0


def test_free_queue_is_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    assert [b.block_id for b in pool.get_new_blocks(3)] == [
        blocks[2].block_id, blocks[0].block_id, blocks[1].block_id
    ]


def test_freed_cached_block_can_be_revived_until_reused() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"h1")
    pool.free_blocks([block])
    # Still cached while unreferenced: a later request with the same prefix revives it.
    assert pool.get_cached_block(b"h1") is block
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    # Handing it out to someone else evicts the cached prefix.
    pool.get_new_blocks(2)
    assert pool.get_cached_block(b"h1") is None
    assert pool.num_evictions == 1


def test_shared_block_is_freed_only_by_its_last_user() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([block])
    assert pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, b"x")
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"x") is None

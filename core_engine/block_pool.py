"""The pool of fixed-size KV-cache blocks: allocation, reference counts and the prefix cache.

A block is a bookkeeping handle (``block_id`` indexes the preallocated K/V tensors, see
:mod:`core_engine.paged_attention`). Blocks with ``ref_cnt == 0`` sit in the free queue in
least-recently-freed order; a free block may still hold a cached prefix (its ``block_hash`` is
set) and can be revived by a later request with the same prefix until it is handed out again,
at which point its hash is evicted. So the LRU eviction of unreferenced cached blocks is the
free queue's order itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["BlockPool", "KVCacheBlock"]


class KVCacheBlock:
    """One block: its id in the K/V tensors, how many requests use it, and its prefix hash."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        #: Chained hash of the tokens this full block holds; None while it is partial/uncached.
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """All ``num_blocks`` blocks of one KV cache; O(1) allocate, free, touch and lookup."""

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block for every block with ref_cnt == 0; the first is evicted first.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVCacheBlock] = {}
        #: Counters for metrics and tests.
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (including unreferenced cached ones)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue (evicting their hashes)."""
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                # Only evict the mapping if it still points at this block.
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block holding the prefix ``block_hash``, referenced or not."""
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix-cache hits); revives free cached blocks."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order; unreferenced blocks join
        the tail of the free queue (so pass a request's blocks tail-first: its last blocks,
        the least shareable, are then evicted before its prefix)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block under its chained hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            # Another block already holds this prefix (two identical prompts in flight);
            # this one stays private and is recycled normally.
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is referenced."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

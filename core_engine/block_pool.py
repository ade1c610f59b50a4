"""The pool of fixed-size KV-cache blocks: allocation, reference counts and the prefix cache.

A block is a bookkeeping handle (``block_id`` indexes the preallocated K/V tensors, see
:mod:`core_engine.paged_attention`). A block with ``ref_cnt == 0`` is free. A free block is
either *blank* (it holds nothing anyone can reuse) or *cached*: its ``block_hash`` is set and a
later request with the same prefix can revive it until it is handed out again, at which point
its hash is evicted. New blocks come from the blank blocks first (least recently freed first),
then from the cached ones, least recently freed first: the LRU eviction of the prefix cache.

Eviction is observable: ``on_evict(block)`` is called while the block still holds its data
and hash, just before it is handed out, so that the KV tiers (:mod:`core_engine.kv_offload`)
can copy it down to host memory instead of losing it.

Per-tenant quota (``tenant_quota`` blocks): a tenant (``Request.tenant``; requests without one
share the ``None`` tenant) holds at most ``tenant_quota`` cached blocks: caching one more
evicts its own least recently used unreferenced one (down a tier, through ``on_evict``), and
when it needs a block while at its quota it recycles its own before anyone else's. So one
tenant's traffic cannot push another tenant's cached prefixes out while that tenant stays
within its quota. (Blocks its running requests reference count too and are never evicted.)

Every hash that enters or leaves the cache is recorded in ``events``
(:class:`~core_engine.kv_events.KVEventLog`), for consumers outside the engine that route by
what each engine holds (:meth:`BlockPool.take_kv_events`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from core_engine.kv_events import KVEventBatch, KVEventLog

__all__ = ["BlockPool", "KVCacheBlock"]


class KVCacheBlock:
    """One block: its id in the K/V tensors, how many requests use it, and its prefix hash."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "tenant")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        #: Chained hash of the tokens this full block holds; None while it is partial/uncached.
        self.block_hash: bytes | None = None
        #: The tenant whose request first cached this block (quota accounting).
        self.tenant: str | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """All ``num_blocks`` blocks of one KV cache; O(1) allocate, free, touch and lookup."""

    def __init__(
        self, num_blocks: int, *, enable_caching: bool = True, tenant_quota: int | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if tenant_quota is not None and tenant_quota < 1:
            raise ValueError(f"tenant_quota must be >= 1 block, got {tenant_quota}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.tenant_quota = tenant_quota
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Free blocks by kind, each in least-recently-freed order (the first goes first).
        self._free_blank: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._free_cached: OrderedDict[int, KVCacheBlock] = OrderedDict()
        # Quota bookkeeping: free cached blocks per tenant (LRU), cached blocks per tenant.
        self._tenant_free: dict[str | None, OrderedDict[int, KVCacheBlock]] = {}
        self._tenant_cached: dict[str | None, int] = {}
        self._cached: dict[bytes, KVCacheBlock] = {}
        #: Called with a cached block about to lose its hash (data still intact).
        self.on_evict: Callable[[KVCacheBlock], None] | None = None
        #: Counters for metrics and tests.
        self.num_evictions = 0
        #: Stored/removed block hashes since the last :meth:`take_kv_events` (bounded).
        self.events = KVEventLog()

    def take_kv_events(self) -> KVEventBatch:
        """The block hashes that entered / left the cache since the last call (a full
        snapshot when too many changed to keep; see :mod:`core_engine.kv_events`)."""
        return self.events.take(self._cached_hashes)

    def _cached_hashes(self) -> list[bytes]:
        # Called from another thread than the engine's: a copy made while the engine thread
        # changes the dict raises, and is made again (the dict is small: one key per block).
        while True:
            try:
                return list(self._cached)
            except RuntimeError:
                continue

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (including unreferenced cached ones)."""
        return len(self._free_blank) + len(self._free_cached)

    @property
    def num_blank_blocks(self) -> int:
        """Free blocks that hold no cached prefix (handing them out evicts nothing)."""
        return len(self._free_blank)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def num_tenant_cached_blocks(self, tenant: str | None) -> int:
        return self._tenant_cached.get(tenant, 0)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def cached_free_blocks(self) -> list[KVCacheBlock]:
        """Unreferenced cached blocks, least recently used first."""
        return list(self._free_cached.values())

    def _take_free(self, block: KVCacheBlock) -> None:
        """Remove a free block from whichever free list holds it."""
        if block.block_hash is None:
            del self._free_blank[block.block_id]
            return
        del self._free_cached[block.block_id]
        if self.tenant_quota is not None:
            del self._tenant_free[block.tenant][block.block_id]

    def _pick(self, tenant: str | None) -> KVCacheBlock:
        if self._free_blank:
            return next(iter(self._free_blank.values()))
        if self.tenant_quota is not None and self._tenant_cached.get(tenant, 0) >= self.tenant_quota:
            own = self._tenant_free.get(tenant)
            if own:
                return next(iter(own.values()))
        return next(iter(self._free_cached.values()))

    def get_new_blocks(self, num_blocks: int, *, tenant: str | None = None) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks for ``tenant``: blank ones first, then the least
        recently used cached ones (the tenant's own once it is at its quota), evicting them."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self._pick(tenant)
            self._take_free(block)
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block)
                self._drop_hash(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def _drop_hash(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self.events.record_removed(block.block_hash)
        self._tenant_cached[block.tenant] -= 1
        block.block_hash = None
        block.tenant = None

    def evict_cached_block(self, block: KVCacheBlock) -> None:
        """Forget a free cached block's prefix now (its data was copied to a lower tier): it
        becomes blank. ``on_evict`` is not called."""
        assert block.ref_cnt == 0 and block.block_hash is not None, block
        self._take_free(block)
        self._drop_hash(block)
        self.num_evictions += 1
        self._free_blank[block.block_id] = block

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The block holding the prefix ``block_hash``, referenced or not."""
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix-cache hits); revives free cached blocks."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._take_free(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order; unreferenced blocks join
        the tail of their free list (so pass a request's blocks tail-first: its last blocks,
        the least shareable, are then evicted before its prefix)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free_blank[block.block_id] = block
                    continue
                self._free_cached[block.block_id] = block
                if self.tenant_quota is not None:
                    self._tenant_free.setdefault(block.tenant, OrderedDict())[block.block_id] = block

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes, *, tenant: str | None = None) -> bool:
        """Register a full, referenced block under its chained hash (first writer wins).
        Returns whether the block was registered."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            # Another block already holds this prefix (two identical prompts in flight);
            # this one stays private and is recycled normally.
            return False
        assert block.ref_cnt > 0, f"caching an unreferenced block {block}"
        if self.tenant_quota is not None and self._tenant_cached.get(tenant, 0) >= self.tenant_quota:
            own = self._tenant_free.get(tenant)
            if own:  # at its quota: the tenant's own oldest unreferenced block goes down a tier
                oldest = next(iter(own.values()))
                if self.on_evict is not None:
                    self.on_evict(oldest)
                self.evict_cached_block(oldest)
        block.block_hash = block_hash
        block.tenant = tenant
        self._tenant_cached[tenant] = self._tenant_cached.get(tenant, 0) + 1
        self._cached[block_hash] = block
        self.events.record_stored(block_hash)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is referenced."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in list(self._free_cached.values()):
            self._take_free(block)
            self._drop_hash(block)
            self._free_blank[block.block_id] = block
        return True

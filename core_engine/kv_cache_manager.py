"""Block tables per request on top of the :class:`~core_engine.block_pool.BlockPool`, with
prefix caching by chained block hashes.

KV-cache layout (shared contract with ``core_engine/kernels`` and ``paged_attention``)
-------------------------------------------------------------------------------------
* One preallocated pool per model. For each layer ``l``: ``k_cache[l]`` and ``v_cache[l]``,
  each ``(num_blocks, block_size, n_kv_heads, head_dim)``, contiguous, model dtype.
* Token ``j`` of a sequence lives in block ``block_table[j // block_size]`` at offset
  ``j % block_size``; its flat *slot* is ``block_id * block_size + offset`` (index into
  ``k_cache[l].view(-1, n_kv_heads, head_dim)``).
* A batch passes ``block_tables`` ``(num_seqs, max_blocks)`` int32 (rows padded with 0, never
  read past the length) and ``context_lens`` ``(num_seqs,)`` int32 (tokens with K/V in the cache
  *including* this step's, i.e. the attention length).
* ``block_size`` is 16 by default.

Prefix caching
--------------
Full blocks are keyed by ``blake2b(parent_hash + token ids)`` so a hash names the whole prefix.
The first block's parent is the request's ``cache_salt`` (the tenant's partition, issue 44):
two salts never share a hash, so neither this cache nor the host and disk tiers keyed by the
same hashes can hit (and report ``cached_tokens`` for) a prefix another partition computed.
A new request walks its prompt's hashes and reuses every leading cached block (at least one
token is always left to compute, so the request has logits to sample from). Freed blocks keep
their hash until they are handed out again (LRU, see :mod:`core_engine.block_pool`).

This class owns no tensors, so it is unit-tested without a model: ``KVCacheManager(num_blocks=8,
block_size=4)`` is the simulated cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from core_engine.block_pool import BlockPool, KVCacheBlock
from core_engine.request import Request

__all__ = ["KVCacheManager", "hash_block_tokens", "prompt_block_hashes"]

_ROOT_HASH = b"infermux-kv-root"


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], cache_salt: str | None = None
) -> bytes:
    """Chained hash of one full block: it identifies the block *and* everything before it.

    ``cache_salt`` counts for the first block only (``parent_hash`` None): every later hash
    chains from that one, so the salt reaches them all.
    """
    if parent_hash is not None:
        root = parent_hash
    elif cache_salt is None:
        root = _ROOT_HASH
    else:
        # Longer than any 16-byte parent hash, so a salted root is never a block's hash.
        root = _ROOT_HASH + b"\0" + cache_salt.encode()
    h = hashlib.blake2b(root, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """The chained hashes of ``token_ids``' full blocks, exactly as the engine keys its prefix
    cache for a request of ``cache_salt`` (a router compares them with the hashes an engine
    reported as cached)."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size], cache_salt))
    return hashes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Which blocks each request holds; allocation with prefix reuse; freeing."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_caching: bool = True,
        tenant_quota: int | None = None,
        pin_tenant_share: float | None = 0.5,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching, tenant_quota=tenant_quota)
        #: Blocks registered in the prefix cache since the last :meth:`take_newly_cached`
        #: (their K/V are written by the step being scheduled); the KV tiers write them
        #: through to disk after that step. Collected only while ``track_new_blocks``.
        self.track_new_blocks = False
        self._newly_cached: list[tuple[KVCacheBlock, bytes]] = []
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        #: Prefix-cache counters (tokens queried / hit) for metrics.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        #: Pinned prefix blocks (``SamplingParams.pin_prefix``): block id -> (block, expiry).
        #: A pin is one more reference, so the block is never evicted until it expires; pins
        #: hold at most a quarter of the pool, so they can never starve the requests.
        self._pins: dict[int, tuple[KVCacheBlock, float]] = {}
        self.max_pinned_blocks = max(1, num_blocks // 4)
        #: Of those, the most one tenant's requests may pin (``pin_tenant_share`` of them;
        #: None: no per-tenant cap), so that one tenant cannot take every pin; requests with
        #: no tenant (open mode, the engine used directly) are held by the pool-wide cap only.
        self.max_pinned_blocks_per_tenant = (
            None if pin_tenant_share is None else max(1, int(self.max_pinned_blocks * pin_tenant_share))
        )
        self._pin_tenants: dict[int, str] = {}  # block id -> the tenant that pinned it

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def update_block_hashes(self, request: Request, num_tokens: int) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], request.cache_salt))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Leading cached blocks of ``request``'s known tokens and how many tokens they hold.

        Pure lookup: nothing is referenced until :meth:`allocate_slots` takes them.
        """
        if not self.enable_caching or request.wants_prompt_logprobs:
            return [], 0
        # Leave at least one token to compute: the last position's logits are needed.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self.update_block_hashes(request, max_hit_blocks * self.block_size)
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        *,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` are prefix hits from :meth:`get_computed_blocks` (first
        scheduling only). ``num_lookahead_tokens`` more slots are for proposed (speculative)
        tokens: allocated, never registered in the prefix cache, given back by
        :meth:`trim` when rejected. Returns the newly allocated blocks, or None (and changes
        nothing) when the pool is short; the scheduler then preempts or waits.
        """
        req_blocks = self.req_to_blocks.get(request.req_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        assert num_total <= request.num_tokens, "cannot allocate slots for unknown tokens"
        num_new_blocks = (
            self.num_blocks_for(num_total + num_lookahead_tokens) - len(req_blocks) - len(new_computed_blocks)
        )
        # Reviving a free cached block consumes a free-queue entry too.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_revived > self.block_pool.num_free_blocks:
            return None
        if request.req_id not in self.req_to_blocks:
            self.req_to_blocks[request.req_id] = req_blocks
        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = (
            self.block_pool.get_new_blocks(num_new_blocks, tenant=request.tenant) if num_new_blocks > 0 else []
        )
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, num_total)
        return new_blocks

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # Blocks are registered as soon as their tokens are scheduled: the K/V of a step are
        # written before any attention of that step reads them, so a same-step hit is safe.
        num_full = num_tokens // self.block_size
        start = self._num_cached_blocks.get(request.req_id, 0)
        if num_full <= start:
            return
        self.update_block_hashes(request, num_full * self.block_size)
        pool = self.block_pool
        for i in range(start, num_full):
            block = req_blocks[i]
            block_hash = request.block_hashes[i]
            if pool.cache_full_block(block, block_hash, tenant=request.tenant) and self.track_new_blocks:
                self._newly_cached.append((block, block_hash))
        self._num_cached_blocks[request.req_id] = num_full

    def take_newly_cached(self) -> list[tuple[KVCacheBlock, bytes]]:
        """``(block, hash)`` registered since the last call (see ``track_new_blocks``); a
        block whose hash changed since was handed out again, its old content is gone."""
        out, self._newly_cached = self._newly_cached, []
        return out

    def free(self, request: Request) -> None:
        """Release all of ``request``'s blocks now (finish, abort or preemption)."""
        blocks = self.req_to_blocks.pop(request.req_id, None)
        self._num_cached_blocks.pop(request.req_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def trim(self, request: Request, num_tokens: int) -> int:
        """Free the request's blocks past the first ``num_tokens`` tokens (rejected proposals'
        slots); returns how many blocks went back to the pool."""
        blocks = self.req_to_blocks.get(request.req_id)
        keep = self.num_blocks_for(num_tokens)
        if not blocks or len(blocks) <= keep:
            return 0
        # Only never-registered blocks can be past the known tokens (lookahead slots).
        assert self._num_cached_blocks.get(request.req_id, 0) <= keep
        excess = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(excess))
        return len(excess)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pins)

    def pin_prefix(self, request: Request, num_tokens: int, ttl_s: float, now: float) -> int:
        """Keep the cached blocks of ``request``'s first ``num_tokens`` tokens for ``ttl_s``
        (a pinned block again pinned gets the later expiry). Call while the request still
        holds its blocks; returns how many tokens are pinned (whole blocks)."""
        if not self.enable_caching:
            return 0
        num_full = min(num_tokens // self.block_size, self._num_cached_blocks.get(request.req_id, 0))
        self.update_block_hashes(request, num_full * self.block_size)
        pool = self.block_pool
        tenant = request.tenant
        tenant_cap = self.max_pinned_blocks_per_tenant if tenant is not None else None
        held = sum(1 for owner in self._pin_tenants.values() if owner == tenant) if tenant_cap is not None else 0
        num_pinned = 0
        for block_hash in request.block_hashes[:num_full]:
            block = pool.get_cached_block(block_hash)  # the registered copy of this prefix
            if block is None:
                break
            pinned = self._pins.get(block.block_id)
            if pinned is None:
                if len(self._pins) >= self.max_pinned_blocks or (tenant_cap is not None and held >= tenant_cap):
                    break
                pool.touch([block])
                if tenant is not None:
                    self._pin_tenants[block.block_id] = tenant
                    held += 1
            expiry = max(now + ttl_s, pinned[1] if pinned is not None else 0.0)
            self._pins[block.block_id] = (block, expiry)
            num_pinned += 1
        return num_pinned * self.block_size

    def expire_pins(self, now: float) -> int:
        """Release the pins whose time is up; returns how many blocks were released."""
        expired = [block for block, expiry in self._pins.values() if expiry <= now]
        for block in expired:
            del self._pins[block.block_id]
            self._pin_tenants.pop(block.block_id, None)
        # The prefix's last blocks first, as requests free theirs.
        self.block_pool.free_blocks(reversed(expired))
        return len(expired)

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (pins included); only when no request holds blocks."""
        if self.req_to_blocks:
            return False
        self.expire_pins(float("inf"))
        return self.block_pool.reset_prefix_cache()

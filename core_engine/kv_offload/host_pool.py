"""The host tier: KV blocks in CPU memory, below the engine's own pool.

One preallocated tensor of ``num_slots`` blocks, each block contiguous (``(num_layers, 2,
block_size, n_kv_heads, head_dim)`` in the KV storage dtype, plus its ``(num_layers, 2,
n_kv_heads)`` float32 scales when the KV cache is quantized), pinned when the device is CUDA
so that copies to and from the GPU can run asynchronously. Blocks are found by their chained
prefix hash (:func:`core_engine.kv_cache_manager.hash_block_tokens`) and evicted least recently
used first, with the same per-tenant quota rule as the device pool
(:mod:`core_engine.block_pool`): a tenant at its quota recycles its own oldest block.

``on_evict(block_hash, slot)`` is called before a slot is reused, while it still holds its
block, so that the disk tier can take it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["HostKVPool"]


class HostKVPool:
    """``num_slots`` KV blocks in CPU memory, keyed by prefix hash, LRU with tenant quotas."""

    def __init__(
        self,
        num_slots: int,
        *,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        scale_shape: tuple[int, ...] | None,
        pin_memory: bool = False,
        tenant_quota: int | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV pool needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self.data = torch.zeros((num_slots, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self.scales = (
            None
            if scale_shape is None
            else torch.zeros((num_slots, *scale_shape), dtype=torch.float32, pin_memory=pin_memory)
        )
        self.tenant_quota = tenant_quota
        # hash -> (slot, tenant), least recently used first.
        self._lru: OrderedDict[bytes, tuple[int, str | None]] = OrderedDict()
        self._tenant_lru: dict[str | None, OrderedDict[bytes, None]] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self.on_evict: Callable[[bytes, int], None] | None = None
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        """Blocks held."""
        return len(self._lru)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    def slot_of(self, block_hash: bytes) -> int | None:
        entry = self._lru.get(block_hash)
        return None if entry is None else entry[0]

    def touch(self, block_hash: bytes) -> None:
        """Mark a block recently used."""
        entry = self._lru.get(block_hash)
        if entry is None:
            return
        self._lru.move_to_end(block_hash)
        self._tenant_lru[entry[1]].move_to_end(block_hash)

    def _victim(self, tenant: str | None) -> bytes:
        if self.tenant_quota is not None:
            own = self._tenant_lru.get(tenant)
            if own is not None and len(own) >= self.tenant_quota:
                return next(iter(own))
        return next(iter(self._lru))

    def _take_slot(self, tenant: str | None) -> int:
        if self._free:
            return self._free.pop()
        victim = self._victim(tenant)
        slot = self._lru[victim][0]
        if self.on_evict is not None:
            self.on_evict(victim, slot)
        self._remove(victim)
        self.num_evictions += 1
        return self._free.pop()

    def _remove(self, block_hash: bytes) -> None:
        slot, tenant = self._lru.pop(block_hash)
        del self._tenant_lru[tenant][block_hash]
        self._free.append(slot)

    def put(self, block_hash: bytes, data: Tensor, scales: Tensor | None, *, tenant: str | None = None) -> int:
        """Store one block (``data`` of ``block_shape``; ``scales`` when quantized); a block
        already held is only touched. Returns its slot."""
        held = self.slot_of(block_hash)
        if held is not None:
            self.touch(block_hash)
            return held
        slot = self._take_slot(tenant)
        self.data[slot].copy_(data, non_blocking=self.data.is_pinned())
        if self.scales is not None and scales is not None:
            self.scales[slot].copy_(scales, non_blocking=self.scales.is_pinned())
        self._lru[block_hash] = (slot, tenant)
        self._tenant_lru.setdefault(tenant, OrderedDict())[block_hash] = None
        return slot

    def gather(self, block_hashes: Sequence[bytes]) -> tuple[Tensor, Tensor | None]:
        """Copies of the blocks (all must be held), ``(N, *block_shape)`` and scales; they
        are touched. The copies stay valid when the slots are reused afterwards."""
        slots = []
        for block_hash in block_hashes:
            slots.append(self._lru[block_hash][0])
            self.touch(block_hash)
        index = torch.tensor(slots, dtype=torch.long)
        data = self.data.index_select(0, index)
        scales = None if self.scales is None else self.scales.index_select(0, index)
        return data, scales

    def discard(self, block_hash: bytes) -> None:
        if block_hash in self._lru:
            self._remove(block_hash)

    def clear(self) -> None:
        for block_hash in list(self._lru):
            self._remove(block_hash)

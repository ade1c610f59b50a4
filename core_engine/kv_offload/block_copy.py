"""Moving whole KV blocks between the device pool, host memory and bytes on disk.

A block in the lower tiers is contiguous: ``(num_layers, 2, block_size, n_kv_heads, head_dim)``
in the pool's storage dtype, plus ``(num_layers, 2, n_kv_heads)`` float32 scales when the KV
cache is quantized (:mod:`core_engine.kv_quant`). In the device pool the same values are
spread over ``KVCache.storage`` ``(num_layers, 2, num_blocks, ...)`` and ``KVCache.scales``.
On disk a block is its data bytes followed by its scale bytes. float8 storage is moved as raw
bytes (uint8), which every copy kernel takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from core_engine.paged_attention import KVCache

__all__ = ["BlockCopier", "tier_block_nbytes"]


def _raw(t: Tensor) -> Tensor:
    """A view copy kernels take: float8 storage as uint8 (same bytes)."""
    if t.element_size() == 1 and t.dtype not in (torch.int8, torch.uint8):
        return t.view(torch.uint8)
    return t


def _as_bytes(t: Tensor) -> Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def tier_block_nbytes(kv_cache: KVCache) -> int:
    """Bytes one block takes in the host and disk tiers (K/V data of all layers + scales)."""
    storage = kv_cache.storage
    num_layers, _, _, block_size, num_kv_heads, head_dim = storage.shape
    data = 2 * num_layers * block_size * num_kv_heads * head_dim * storage.element_size()
    scales = 0 if getattr(kv_cache, "scales", None) is None else 2 * num_layers * num_kv_heads * 4
    return data + scales


class BlockCopier:
    """Reads and writes blocks of one :class:`KVCache` in the tiers' layout."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        storage = kv_cache.storage
        self.device = storage.device
        num_layers, _, _, block_size, num_kv_heads, head_dim = storage.shape
        self.block_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.dtype = storage.dtype
        scales: Tensor | None = getattr(kv_cache, "scales", None)
        self.scale_shape = None if scales is None else (num_layers, 2, num_kv_heads)
        self.data_nbytes = int(torch.Size(self.block_shape).numel()) * storage.element_size()
        scale_nbytes = 0 if self.scale_shape is None else int(torch.Size(self.scale_shape).numel()) * 4
        self.block_nbytes = self.data_nbytes + scale_nbytes

    def read(self, block_ids: Sequence[int]) -> tuple[Tensor, Tensor | None]:
        """Copies of device blocks as ``(N, *block_shape)`` (and ``(N, *scale_shape)``)."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        data = _raw(self.kv_cache.storage).index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()
        scales_all: Tensor | None = getattr(self.kv_cache, "scales", None)
        scales = None if scales_all is None else scales_all.index_select(2, index).permute(2, 0, 1, 3).contiguous()
        if data.dtype != self.dtype:
            data = data.view(self.dtype)
        return data, scales

    def write(self, block_ids: Sequence[int], data: Tensor, scales: Tensor | None) -> None:
        """Store ``(N, *block_shape)`` blocks (and their scales) into device blocks."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        source = _raw(data.to(self.device, non_blocking=True)).permute(1, 2, 0, 3, 4, 5)
        _raw(self.kv_cache.storage).index_copy_(2, index, source)
        scales_all: Tensor | None = getattr(self.kv_cache, "scales", None)
        if scales_all is not None and scales is not None:
            scales_all.index_copy_(2, index, scales.to(self.device, non_blocking=True).permute(1, 2, 0, 3))

    def to_bytes(self, data: Tensor, scales: Tensor | None) -> bytes:
        """One block's bytes on disk: data then scales."""
        parts = [_as_bytes(data.cpu())]
        if scales is not None:
            parts.append(_as_bytes(scales.cpu()))
        return b"".join(bytes(p.numpy().data) for p in parts)

    def from_bytes(self, payload: bytes) -> tuple[Tensor, Tensor | None]:
        """The block of :meth:`to_bytes` (``ValueError``/``RuntimeError`` on a wrong size)."""
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        data = raw[: self.data_nbytes].view(_raw(torch.empty(0, dtype=self.dtype)).dtype)
        if data.dtype != self.dtype:
            data = data.view(self.dtype)
        data = data.view(self.block_shape)
        scales = None
        if self.scale_shape is not None:
            scales = raw[self.data_nbytes :].view(torch.float32).view(self.scale_shape)
        return data, scales

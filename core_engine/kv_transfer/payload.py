"""What a prefill engine hands to a decode engine: the prompt, its first token, its KV blocks.

The blocks are in the tiers' contiguous layout (:mod:`core_engine.kv_offload.block_copy`):
``data`` ``(num_blocks, num_layers, 2, block_size, n_kv_heads, head_dim)`` in the pool's storage
dtype, ``scales`` ``(num_blocks, num_layers, 2, n_kv_heads)`` float32 when the KV cache is
quantized. The last block is partial when the prompt is not a multiple of ``block_size``;
only full blocks have a prefix hash. On the wire a transfer is the msgpack metadata followed
by the data bytes and the scale bytes (:meth:`PrefilledKV.buffers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import torch
from torch import Tensor

if TYPE_CHECKING:
    from core_engine.paged_attention import KVCache

__all__ = ["KVTransferMeta", "PrefilledKV", "kv_layout"]


def _raw(t: Tensor) -> Tensor:
    """float8 storage as uint8 (same bytes), which numpy and buffers take."""
    if t.element_size() == 1 and t.dtype not in (torch.int8, torch.uint8):
        return t.view(torch.uint8)
    return t


def kv_layout(kv_cache: KVCache) -> str:
    """A string both engines must agree on before blocks move between them."""
    storage = kv_cache.storage
    num_layers, _, _, block_size, num_kv_heads, head_dim = storage.shape
    return (
        f"kv={kv_cache.quant.name} storage={storage.dtype} layers={num_layers} block={block_size} "
        f"kv_heads={num_kv_heads} head_dim={head_dim}"
    )


class KVTransferMeta(msgspec.Struct, frozen=True, kw_only=True):
    """The description that travels ahead of a transfer's bytes."""

    #: The prompt the KV belongs to (the decode side checks it is its request's prompt).
    prompt_token_ids: list[int]
    #: The token the prefill engine sampled after the prompt.
    first_token_id: int
    #: Chained hashes of the prompt's full blocks (``kv_cache_manager.hash_block_tokens``).
    block_hashes: list[bytes]
    #: Blocks carried (the full ones, then a partial one if the prompt has a tail).
    num_blocks: int
    #: :func:`kv_layout` of the sending engine.
    layout: str
    #: One block's shape and storage dtype (``torch.float32``...), and its scales' shape
    #: (None: not quantized), so that a receiver decodes the bytes without the engine.
    block_shape: tuple[int, ...]
    dtype: str
    scale_shape: tuple[int, ...] | None = None
    data_nbytes: int
    scales_nbytes: int = 0


@dataclass(slots=True)
class PrefilledKV:
    """A prefilled prompt: its metadata and its blocks (see the module docstring)."""

    meta: KVTransferMeta
    data: Tensor  # (num_blocks, num_layers, 2, block_size, n_kv_heads, head_dim)
    scales: Tensor | None = None  # (num_blocks, num_layers, 2, n_kv_heads) float32

    @property
    def nbytes(self) -> int:
        return self.meta.data_nbytes + self.meta.scales_nbytes

    def buffers(self) -> list[memoryview]:
        """The bytes to send, data then scales (views of host tensors: no copy on CPU)."""
        parts = [self.data, *(() if self.scales is None else (self.scales,))]
        return [_raw(p.contiguous().cpu()).view(-1).view(torch.uint8).numpy().data for p in parts]

    @classmethod
    def from_buffer(cls, meta: KVTransferMeta, payload: bytes | bytearray | memoryview) -> PrefilledKV:
        """The blocks of ``payload`` (what :meth:`buffers` sent): views of a ``bytearray``
        (which the caller hands over), copies of anything else; ``ValueError`` when the bytes
        do not match the metadata."""
        expected = meta.data_nbytes + meta.scales_nbytes
        if len(payload) != expected:
            raise ValueError(f"KV transfer payload has {len(payload)} bytes, its metadata says {expected}")
        dtype = getattr(torch, meta.dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"KV transfer: unknown storage dtype {meta.dtype!r}")
        block_shape, scale_shape = meta.block_shape, meta.scale_shape
        owned = payload if isinstance(payload, bytearray) else bytearray(payload)  # a buffer the tensors may keep
        raw = torch.frombuffer(owned, dtype=torch.uint8) if expected else torch.empty(0, dtype=torch.uint8)
        data = raw[: meta.data_nbytes].view(_raw(torch.empty(0, dtype=dtype)).dtype)
        if data.dtype != dtype:
            data = data.view(dtype)
        data = data.view(meta.num_blocks, *block_shape)
        scales = None
        if scale_shape is not None:
            scales = raw[meta.data_nbytes :].view(torch.float32).view(meta.num_blocks, *scale_shape)
        return cls(meta=meta, data=data, scales=scales)

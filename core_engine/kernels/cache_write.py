"""Write this step's new keys and values into their slots of the paged KV cache.

A slot is ``block_id * block_size + offset`` (see :mod:`core_engine.kv_cache_manager`): token
``t``'s key lands in ``k_cache[slot // block_size, slot % block_size]``. Every slot must be a
valid index; tokens that should not be cached are simply left out of the call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core_engine.kernels.dispatch import use_triton

__all__ = ["reshape_and_cache", "reshape_and_cache_reference"]


def _check_cache_args(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            "key and value must both be (T, n_kv_heads, head_dim), "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            "k_cache and v_cache must both be (num_blocks, block_size, n_kv_heads, head_dim) "
            f"matching key {tuple(key.shape)}, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    is_int = slot_mapping.dtype in (torch.int32, torch.int64)
    if slot_mapping.shape != (key.shape[0],) or not is_int:
        raise ValueError(
            f"slot_mapping must be ({key.shape[0]},) int64, "
            f"got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )


def reshape_and_cache_reference(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Torch reference (and the CPU path): ``index_copy_`` into the caches viewed as slots."""
    num_blocks, block_size, n_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.long()
    # Both caches are contiguous pools, so the view aliases them and the copy lands in place.
    k_cache.view(num_blocks * block_size, n_kv_heads, head_dim).index_copy_(
        0, slots, key.to(k_cache.dtype)
    )
    v_cache.view(num_blocks * block_size, n_kv_heads, head_dim).index_copy_(
        0, slots, value.to(v_cache.dtype)
    )


def reshape_and_cache(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Store key/value (T, n_kv_heads, head_dim) at slot_mapping (T,) of the (num_blocks,
    block_size, n_kv_heads, head_dim) caches, in place. key/value may be strided views (e.g. of
    a fused QKV output) and are converted to the cache dtype.
    """
    _check_cache_args(key, value, k_cache, v_cache, slot_mapping)
    if use_triton(key.device):
        from core_engine.kernels.triton_ops.cache_write import reshape_and_cache_triton

        reshape_and_cache_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    reshape_and_cache_reference(key, value, k_cache, v_cache, slot_mapping)

"""Triton KV-cache slot write against the torch reference."""

from __future__ import annotations

import pytest
import torch

from core_engine.kernels import reshape_and_cache, reshape_and_cache_reference
from core_engine.kernels.triton_ops.cache_write import reshape_and_cache_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_write_matches_reference_bit_for_bit(
    device: torch.device, dtype: torch.dtype
) -> None:
    num_blocks, block_size, n_kv, head_dim = (
        6,
        4,
        3,
        24,
    )  # 3 heads and 24 dims are padded in the kernel
    gen = torch.Generator().manual_seed(13)
    qkv = torch.randn(7, (2 + 2 * n_kv) * head_dim, generator=gen).to(dtype).to(device)
    key = qkv[:, 2 * head_dim : (2 + n_kv) * head_dim].view(7, n_kv, head_dim)  # strided views
    value = qkv[:, (2 + n_kv) * head_dim :].view(7, n_kv, head_dim)
    # Slots across blocks, including the first and the very last slot of the pool.
    slots = torch.tensor([0, 23, 5, 6, 7, 12, 17], device=device)
    k_cache = (
        torch.randn(num_blocks, block_size, n_kv, head_dim, generator=gen).to(dtype).to(device)
    )
    v_cache = (
        torch.randn(num_blocks, block_size, n_kv, head_dim, generator=gen).to(dtype).to(device)
    )
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reshape_and_cache_reference(key, value, k_expected, v_expected, slots)
    reshape_and_cache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


def test_cache_write_converts_to_the_cache_dtype(device: torch.device) -> None:
    key = torch.randn(2, 1, 16, device=device)
    value = torch.randn(2, 1, 16, device=device)
    k_cache = torch.zeros(2, 2, 1, 16, dtype=torch.float16, device=device)
    v_cache = torch.zeros_like(k_cache)
    reshape_and_cache(key, value, k_cache, v_cache, torch.tensor([3, 1], device=device))
    assert torch.equal(k_cache[1, 1], key[0].half())
    assert torch.equal(v_cache[0, 1], value[1].half())

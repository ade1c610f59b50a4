"""Triton paged-attention decode against the torch reference (interpreter or CUDA)."""

from __future__ import annotations

import pytest
import torch
from kernel_case import assert_close, make_paged_kv, quantize_paged_kv

from core_engine.kernels import paged_attention_decode, paged_attention_decode_reference, use_triton
from core_engine.kernels.triton_ops.paged_attention import paged_attention_decode_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _query(
    num_seqs: int, n_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    return (
        torch.randn(num_seqs, n_heads, head_dim, generator=torch.Generator().manual_seed(7))
        .to(dtype)
        .to(device)
    )


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ragged_batch_with_partial_blocks(
    device: torch.device, dtype: torch.dtype, group: int, num_splits: int
) -> None:
    # One token, a partial first block, exactly two blocks, a partial fifth block; the tables are
    # padded past each sequence's end, and unused slots hold NaN.
    lens = [1, 3, 8, 19]
    n_kv, head_dim = 2, 16
    paged = make_paged_kv(
        lens, block_size=4, n_kv_heads=n_kv, head_dim=head_dim, dtype=dtype, device=device
    )
    q = _query(len(lens), n_kv * group, head_dim, dtype, device)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, head_dim**-0.5)
    out = paged_attention_decode_triton(*args, num_splits=num_splits, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    assert not out.isnan().any()
    assert_close(out, paged_attention_decode_reference(*args), dtype)


@pytest.mark.parametrize("block_size", [6, 16])
def test_odd_block_size_and_head_dim(device: torch.device, block_size: int) -> None:
    # block_size 6 is not a power of two; head_dim 24 is padded to 32 inside the kernel.
    lens = [5, 17, 40]
    paged = make_paged_kv(
        lens, block_size=block_size, n_kv_heads=1, head_dim=24, dtype=torch.float32, device=device
    )
    q = _query(len(lens), 3, 24, torch.float32, device)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.2)
    for num_splits in (1, 2):
        out = paged_attention_decode_triton(*args, num_splits=num_splits)
        assert_close(out, paged_attention_decode_reference(*args), torch.float32)


def test_dispatcher_runs_triton_here_with_default_tuning(device: torch.device) -> None:
    # Realistic shapes on a GPU (Llama-8B-like heads, long ragged contexts); small ones in the
    # interpreter, which runs every program in Python.
    if device.type == "cuda":
        lens, n_kv, group, head_dim, block_size = (
            [1, 100, 1000, 2047, 333, 64, 16, 1500],
            8,
            4,
            128,
            16,
        )
    else:
        lens, n_kv, group, head_dim, block_size = [2, 30, 9], 2, 3, 32, 16
    assert use_triton(device)
    for dtype in (torch.float32, torch.bfloat16):
        paged = make_paged_kv(
            lens,
            block_size=block_size,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
        )
        q = _query(len(lens), n_kv * group, head_dim, dtype, device)
        args = (
            q,
            paged.k_cache,
            paged.v_cache,
            paged.block_tables,
            paged.context_lens,
            head_dim**-0.5,
        )
        out = paged_attention_decode(*args)
        assert torch.equal(out, paged_attention_decode_triton(*args)), (
            "the dispatcher did not run the kernel"
        )
        assert_close(out, paged_attention_decode_reference(*args), dtype)


CODE_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_quantized_cache_matches_the_reference(
    device: torch.device, code_dtype: torch.dtype, num_splits: int
) -> None:
    # Ragged lengths with partial blocks; unused slots hold the largest code and unowned
    # blocks a NaN scale, so reading either shows in the output.
    lens = [1, 6, 19]
    paged = make_paged_kv(
        lens, block_size=4, n_kv_heads=2, head_dim=16, dtype=torch.float32, device=device
    )
    quant = quantize_paged_kv(paged, code_dtype)
    q = _query(len(lens), 6, 16, torch.float32, device)
    args = (q, quant.k_codes, quant.v_codes, paged.block_tables, paged.context_lens, 0.25)
    scales = {"k_scale": quant.k_scale, "v_scale": quant.v_scale}
    out = paged_attention_decode_triton(*args, **scales, num_splits=num_splits, block_n=16)
    assert not out.isnan().any()
    assert_close(out, paged_attention_decode_reference(*args, **scales), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantized_cache_with_half_precision_queries(device: torch.device, dtype: torch.dtype) -> None:
    lens = [3, 17]
    paged = make_paged_kv(
        lens, block_size=16, n_kv_heads=1, head_dim=32, dtype=torch.float32, device=device
    )
    quant = quantize_paged_kv(paged, torch.int8)
    q = _query(len(lens), 3, 32, dtype, device)
    args = (q, quant.k_codes, quant.v_codes, paged.block_tables, paged.context_lens, 32**-0.5)
    out = paged_attention_decode(*args, k_scale=quant.k_scale, v_scale=quant.v_scale)
    assert out.dtype == dtype
    assert torch.equal(
        out, paged_attention_decode_triton(*args, k_scale=quant.k_scale, v_scale=quant.v_scale)
    ), "the dispatcher did not run the kernel"
    expected = paged_attention_decode_reference(*args, k_scale=quant.k_scale, v_scale=quant.v_scale)
    assert_close(out, expected, dtype)

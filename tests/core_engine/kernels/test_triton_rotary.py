"""Triton rotary embedding against the torch reference, both pair layouts."""

from __future__ import annotations

import pytest
import torch
from kernel_case import assert_close

from core_engine.kernels import (
    apply_rotary_embedding,
    apply_rotary_embedding_reference,
    rotary_cos_sin,
)
from core_engine.kernels.triton_ops.rotary import apply_rotary_embedding_triton


def _fused_qkv(
    num_tokens: int,
    n_heads: int,
    n_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
):
    qkv = torch.randn(
        num_tokens, (n_heads + 2 * n_kv) * head_dim, generator=torch.Generator().manual_seed(5)
    )
    qkv = qkv.to(dtype).to(device)
    q = qkv[:, : n_heads * head_dim].view(num_tokens, n_heads, head_dim)
    k = qkv[:, n_heads * head_dim : (n_heads + n_kv) * head_dim].view(num_tokens, n_kv, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_out_of_place_on_fused_views(
    device: torch.device, dtype: torch.dtype, is_neox: bool
) -> None:
    qkv, q, k = _fused_qkv(6, 4, 2, 16, dtype, device)
    before = qkv.clone()
    cos, sin = (t.to(device) for t in rotary_cos_sin(16, 64))
    positions = torch.tensor([0, 1, 5, 63, 5, 2], device=device)
    q_out, k_out = apply_rotary_embedding_triton(q, k, positions, cos, sin, is_neox=is_neox)
    q_ref, k_ref = apply_rotary_embedding_reference(q, k, positions, cos, sin, is_neox=is_neox)
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)
    assert torch.equal(qkv, before), "out-of-place rotary modified its inputs"


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_in_place_partial_rotary_dim(device: torch.device, is_neox: bool) -> None:
    # rotary_dim 12 of head_dim 16 (6 pairs, padded to 8 in the kernel); 3 q heads (padded to 4).
    qkv, q, k = _fused_qkv(5, 3, 1, 16, torch.float32, device)
    before = qkv.clone()
    cos, sin = (t.to(device) for t in rotary_cos_sin(12, 20, base=500.0))
    positions = torch.tensor([19, 0, 3, 3, 7], device=device)
    q_ref, k_ref = apply_rotary_embedding_reference(q, k, positions, cos, sin, is_neox=is_neox)
    q_out, k_out = apply_rotary_embedding(q, k, positions, cos, sin, is_neox=is_neox, inplace=True)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    assert_close(q, q_ref, torch.float32)
    assert_close(k, k_ref, torch.float32)
    assert torch.equal(q[..., 12:], q_ref[..., 12:]), "dims past rotary_dim changed"
    assert torch.equal(qkv[:, 4 * 16 :], before[:, 4 * 16 :]), "the value slice changed"


def test_rotary_with_bf16_tables_like_the_model(device: torch.device) -> None:
    # core_engine.model stores its cos/sin tables in the model dtype.
    _, q, k = _fused_qkv(4, 2, 2, 8, torch.bfloat16, device)
    cos, sin = (t.to(device) for t in rotary_cos_sin(8, 10, dtype=torch.bfloat16))
    positions = torch.tensor([9, 8, 1, 0], device=device)
    q_out, k_out = apply_rotary_embedding_triton(q, k, positions, cos, sin)
    q_ref, k_ref = apply_rotary_embedding_reference(q, k, positions, cos, sin)
    assert_close(q_out, q_ref, torch.bfloat16)
    assert_close(k_out, k_ref, torch.bfloat16)

"""Rotary embedding in Triton: one program per token rotates all its q and k heads in place."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["apply_rotary_embedding_triton"]


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_head,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    # x_ptr points at this token's head 0; cos, sin: (HALF_PAD,) fp32.
    heads = tl.arange(0, HEADS_PAD)
    pairs = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_heads) & (pairs[None, :] < HALF)
    if IS_NEOX:
        first = pairs
        second = pairs + HALF
    else:
        first = 2 * pairs
        second = 2 * pairs + 1
    ptr1 = x_ptr + heads[:, None] * stride_head + first[None, :]  # (HEADS_PAD, HALF_PAD)
    ptr2 = x_ptr + heads[:, None] * stride_head + second[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr2, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(ptr1, (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(ptr2, (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # (T, n_heads, head_dim), rotated in place
    k_ptr,  # (T, n_kv_heads, head_dim), rotated in place
    positions_ptr,  # (T,)
    cos_ptr,  # (max_positions, HALF)
    sin_ptr,
    num_q_heads,
    num_k_heads,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cos,
    stride_sin,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, HALF_PAD)
    pair_mask = pairs < HALF
    cos = tl.load(cos_ptr + position * stride_cos + pairs, mask=pair_mask, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_sin + pairs, mask=pair_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_q_token,
        stride_q_head,
        num_q_heads,
        cos,
        sin,
        HALF,
        HALF_PAD,
        Q_HEADS_PAD,
        IS_NEOX,
    )
    _rotate_heads(
        k_ptr + token * stride_k_token,
        stride_k_head,
        num_k_heads,
        cos,
        sin,
        HALF,
        HALF_PAD,
        K_HEADS_PAD,
        IS_NEOX,
    )


def apply_rotary_embedding_triton(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    is_neox: bool = True,
    inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    """Triton version of :func:`~core_engine.kernels.apply_rotary_embedding_reference`."""
    if not inplace:
        q, k = q.clone(), k.clone()
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("q, k, cos and sin must be contiguous in their last dim")
    num_tokens = q.shape[0]
    half = cos.shape[1]
    if num_tokens > 0:
        _rotary_kernel[(num_tokens,)](
            q,
            k,
            positions.contiguous(),
            cos,
            sin,
            q.shape[1],
            k.shape[1],
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            sin.stride(0),
            HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
            Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]),
            K_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
            IS_NEOX=is_neox,
        )
    return q, k

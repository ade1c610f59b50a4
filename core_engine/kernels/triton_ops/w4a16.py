"""W4A16 matmul in Triton: one program per ``(BLOCK_M, BLOCK_N)`` tile of the output.

Each program walks K in steps of ``BLOCK_K`` (a multiple of 32, so a step holds whole Q4_1
blocks) and reads the packed bytes of its ``BLOCK_N`` weight rows as a ``(BLOCK_K/2, BLOCK_N)``
tile: row ``r`` of the tile is byte ``r % 16`` of block ``r // 16``. Its low nibbles are the
weights ``32 (r // 16) + r % 16`` and its high nibbles those 16 further on, so the tile turns
into two halves of ``W^T`` that meet two gathers of the activation columns in two ``tl.dot``
calls; no nibble interleaving is needed. The codes become ``d * q + m`` in fp32 with each
row's scale and minimum for the block, are cast to x's dtype for the tensor cores (fp32 dots
for fp32 x) and accumulate in fp32.

Tiles: decode (M <= 16) pads M to ``tl.dot``'s minimum of 16 and narrows the tile over N so that
``N / BLOCK_N`` programs are spread over the SMs; larger M takes 64 x 64 tiles. The choice is
by reasoning, not yet by a GPU benchmark; a split-K variant is the next step if decode on
narrow layers proves short of programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from core_engine.kernels.dispatch import interpreter_enabled

__all__ = ["w4a16_matmul_triton"]


@triton.jit
def _w4a16_matmul_kernel(
    out_ptr,  # (M, N), x's dtype
    x_ptr,  # (M, K)
    qweight_ptr,  # (N, K // 2) uint8
    scales_ptr,  # (N, K // 32) fp16
    mins_ptr,  # (N, K // 32) fp16
    bias_ptr,  # (N,), read only when HAS_BIAS
    size_m,  # M, N, K (lower case: the compile tests take upper-case names as constexprs)
    size_n,
    size_k,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_sn,
    stride_mn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < size_m
    mask_n = offs_n < size_n
    rows = tl.arange(0, BLOCK_K // 2)  # rows of the packed tile
    k_low = (rows // 16) * 32 + rows % 16  # (BLOCK_K/2,) the step's k of each low nibble
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # (BLOCK_M, 1)
    q_cols = qweight_ptr + offs_n.to(tl.int64)[None, :] * stride_qn  # (1, BLOCK_N)
    d_cols = scales_ptr + offs_n.to(tl.int64)[None, :] * stride_sn
    m_cols = mins_ptr + offs_n.to(tl.int64)[None, :] * stride_mn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, size_k, BLOCK_K):
        packed = tl.load(
            q_cols + (k0 // 2 + rows)[:, None], mask=mask_n[None, :], other=0
        )  # (BLOCK_K/2, BLOCK_N) uint8
        group = (k0 // 32 + rows // 16)[:, None]  # (BLOCK_K/2, 1)
        d = tl.load(d_cols + group, mask=mask_n[None, :], other=0.0).to(tl.float32)
        m = tl.load(m_cols + group, mask=mask_n[None, :], other=0.0).to(tl.float32)
        w_low = (packed & 0x0F).to(tl.float32) * d + m  # (BLOCK_K/2, BLOCK_N) of W^T
        w_high = (packed >> 4).to(tl.float32) * d + m
        x_low = tl.load(
            x_rows + (k0 + k_low)[None, :] * stride_xk, mask=mask_m[:, None], other=0.0
        )  # (BLOCK_M, BLOCK_K/2)
        x_high = tl.load(
            x_rows + (k0 + k_low + 16)[None, :] * stride_xk, mask=mask_m[:, None], other=0.0
        )
        if DOT_FP32:
            acc = tl.dot(x_low.to(tl.float32), w_low, acc, input_precision="ieee")
            acc = tl.dot(x_high.to(tl.float32), w_high, acc, input_precision="ieee")
        else:
            acc = tl.dot(x_low, w_low.to(x_ptr.dtype.element_ty), acc)
            acc = tl.dot(x_high, w_high.to(x_ptr.dtype.element_ty), acc)

    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc += bias[None, :]
    tl.store(
        out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _default_tiles(m: int, k: int) -> tuple[int, int, int]:
    if m <= 16:
        block_m, block_n = 16, 32
    elif m <= 32:
        block_m, block_n = 32, 64
    else:
        block_m, block_n = 64, 64
    block_k = next(b for b in (128, 64, 32) if k % b == 0)  # K is a multiple of 32
    return block_m, block_n, block_k


def _packed_rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def w4a16_matmul_triton(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    mins: Tensor,
    bias: Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> Tensor:
    """Triton version of :func:`~core_engine.kernels.w4a16_matmul_reference`.

    ``block_m``/``block_n`` (powers of two >= 16) and ``block_k`` (a power-of-two multiple of
    32 that divides K) default to a choice by M and K; tests set them to reach every path.
    """
    m, k = x.shape
    n = qweight.shape[0]
    default_m, default_n, default_k = _default_tiles(m, k)
    block_m, block_n, block_k = block_m or default_m, block_n or default_n, block_k or default_k
    if block_k % 32 or block_k & (block_k - 1) or k % block_k:
        raise ValueError(
            f"block_k must be a power-of-two multiple of 32 that divides K={k}, got {block_k}"
        )
    qweight, scales, mins = _packed_rows(qweight), _packed_rows(scales), _packed_rows(mins)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    # bf16 tl.dot is wrong in the interpreter; fp32 x keeps fp32 (ieee) dots.
    dot_fp32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpreter_enabled())
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_matmul_kernel[grid](
        out,
        x,
        qweight,
        scales,
        mins,
        bias.contiguous() if bias is not None else scales,  # unused without HAS_BIAS
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        qweight.stride(0),
        scales.stride(0),
        mins.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        DOT_FP32=dot_fp32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out

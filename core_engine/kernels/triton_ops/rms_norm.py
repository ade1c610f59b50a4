"""RMSNorm (optionally fused with the residual add) in Triton: one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["fused_add_rms_norm_triton", "rms_norm_triton"]


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # (rows, hidden)
    new_residual_ptr,  # (rows, hidden), written only when HAS_RESIDUAL
    x_ptr,
    residual_ptr,
    weight_ptr,  # (hidden,)
    eps,
    hidden,
    stride_out,
    stride_new_residual,
    stride_x,
    stride_residual,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Round the sum to the stream's dtype first, as an unfused `x + residual` would.
        h = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * stride_new_residual + cols, h, mask=mask)
        x = h
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + cols,
        (x32 * inv_rms * weight).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _rows(t: Tensor) -> Tensor:
    # (..., hidden) -> (rows, hidden) without copying when the last dim is already packed.
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor | None]:
    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res2 = _rows(residual) if residual is not None else x2
    new_residual = torch.empty_like(out) if residual is not None else out
    block = triton.next_power_of_2(hidden)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            out,
            new_residual,
            x2,
            res2,
            weight.contiguous(),
            eps,
            hidden,
            out.stride(0),
            new_residual.stride(0),
            x2.stride(0),
            res2.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    out = out.view(x.shape)
    return out, (new_residual.view(x.shape) if residual is not None else None)


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Triton version of :func:`~core_engine.kernels.rms_norm_reference`."""
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm_triton(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Triton version of :func:`~core_engine.kernels.fused_add_rms_norm_reference`."""
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual

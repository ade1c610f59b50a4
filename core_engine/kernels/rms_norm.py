"""RMSNorm, alone and fused with the residual add that precedes it in every Llama block.

Arithmetic is fp32 whatever the input dtype: ``y = x * rsqrt(mean(x^2) + eps) * weight``,
rounded once to ``x``'s dtype at the end. In the fused form the residual sum is rounded to
``x``'s dtype first (it is what the next layer adds to), and the norm reads that rounded sum.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core_engine.kernels.dispatch import use_triton

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_reference", "rms_norm", "rms_norm_reference"]


def _check_norm_args(x: Tensor, weight: Tensor, residual: Tensor | None = None) -> None:
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"weight must be ({x.shape[-1] if x.dim() else '?'},), got {tuple(weight.shape)}"
        )
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Torch reference: RMSNorm over the last dim of ``x`` (..., hidden); returns x's dtype."""
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)  # (..., 1)
    return (x32 * inv_rms * weight.float()).to(x.dtype)


def fused_add_rms_norm_reference(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Torch reference: ``h = x + residual``; returns ``(rms_norm(h), h)``, both in x's dtype."""
    new_residual = (x + residual).to(x.dtype)
    return rms_norm_reference(new_residual, weight, eps), new_residual


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim. x: (..., hidden); weight: (hidden,). Returns x's shape/dtype."""
    _check_norm_args(x, weight)
    if use_triton(x.device):
        from core_engine.kernels.triton_ops.rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """``h = x + residual`` then RMSNorm, in one pass: returns ``(normed, h)``.

    x, residual: (..., hidden); weight: (hidden,). ``h`` is the next residual stream.
    """
    _check_norm_args(x, weight, residual)
    if use_triton(x.device):
        from core_engine.kernels.triton_ops.rms_norm import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_reference(x, residual, weight, eps)

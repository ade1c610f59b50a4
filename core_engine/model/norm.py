"""The model's RMSNorm: ``F.rms_norm`` over the last dim, or the Triton kernel where the kernel
dispatcher picks Triton (CUDA tensors with ``triton`` importable, or the CPU interpreter).

The CPU path is ``F.rms_norm`` exactly as before; the Triton kernel computes in fp32 and
rounds once at the end (``F.rms_norm`` rounds before the weight multiply), so the two may
differ by one ulp of a half-precision activation.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from core_engine.kernels.dispatch import use_triton

__all__ = ["rms_norm"]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x`` (..., hidden) with ``weight`` (hidden,); returns x's shape and dtype."""
    if use_triton(x.device):
        from core_engine.kernels.rms_norm import rms_norm as rms_norm_kernel

        return rms_norm_kernel(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)

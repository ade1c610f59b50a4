"""W4A16 matmul: ``x @ W^T (+ bias)`` with ``W`` in the engine's int4 format, ``x`` in 16 bits.

The int4 format is GGUF's Q4_1 block split into three arrays, so a Q4_1 tensor loads without
a second rounding (:mod:`core_engine.model.block_weights`). For ``W`` (N, K), K a multiple of
32, block ``b`` of row ``n`` holds weights ``32b .. 32b + 31``:

* ``qweight`` (N, K/2) uint8: bytes ``16b .. 16b + 15`` of the row are the block; byte ``j``
  holds weight ``32b + j`` in its low nibble and ``32b + j + 16`` in its high one (ggml's
  order, not the adjacent pairs of GPTQ/AWQ);
* ``scales`` ``d`` and ``mins`` ``m``, (N, K/32) fp16: ``W[n, k] = d[n, k // 32] * q + m[n, k // 32]``.

Dequantisation is fp32: ``d * q`` is exact there (11 + 4 significant bits), so the one
rounding of the add gives what ggml's ``dequantize_row_q4_1`` and ``gguf.quants`` give. The
matmul accumulates in fp32 and rounds once to ``x``'s dtype. The Triton kernel
(:mod:`core_engine.kernels.triton_ops.w4a16`) reads the packed bytes and never materialises
``W``: at decode a matmul is a read of the weight, and int4 reads a quarter of fp16's bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core_engine.kernels.dispatch import use_triton

__all__ = ["check_w4a16_args", "unpack_int4", "w4a16_matmul", "w4a16_matmul_reference"]

#: Weights per (scale, min) block, as in Q4_1.
GROUP_SIZE = 32
_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_int4_weight(
    qweight: Tensor, scales: Tensor, mins: Tensor, x_k: int | None = None
) -> tuple[int, int]:
    """Validate one int4 weight's arrays (and its K against x's ``x_k``); returns ``(N, K)``."""
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(
            f"qweight must be a 2-D uint8 tensor (N, K/2), got {qweight.dtype} {tuple(qweight.shape)}"
        )
    n, half_k = qweight.shape
    if x_k is not None and 2 * half_k != x_k:
        raise ValueError(f"qweight {tuple(qweight.shape)} encodes K={2 * half_k} but x has K={x_k}")
    if half_k % (GROUP_SIZE // 2):
        raise ValueError(
            f"qweight must hold whole blocks of {GROUP_SIZE} weights (K/2 a multiple of "
            f"{GROUP_SIZE // 2}), got {tuple(qweight.shape)}"
        )
    k = 2 * half_k
    for name, t in (("scales", scales), ("mins", mins)):
        if t.dtype != torch.float16 or t.shape != (n, k // GROUP_SIZE):
            raise ValueError(
                f"{name} must be float16 ({n}, {k // GROUP_SIZE}) for qweight "
                f"{tuple(qweight.shape)}, got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != qweight.device:
            raise ValueError(f"{name} is on {t.device}, qweight on {qweight.device}")
    return n, k


def check_w4a16_args(
    x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor, bias: Tensor | None = None
) -> None:
    """Raise ``ValueError`` naming the argument whose shape, dtype or device does not fit."""
    if x.dim() != 2 or x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(
            f"x must be a 2-D (M, K) float16, bfloat16 or float32 tensor, got {x.dtype} "
            f"{tuple(x.shape)}"
        )
    if x.shape[1] % GROUP_SIZE:
        raise ValueError(f"x's K ({x.shape[1]}) must be a multiple of {GROUP_SIZE}")
    n, _ = _check_int4_weight(qweight, scales, mins, x.shape[1])
    if qweight.device != x.device:
        raise ValueError(f"qweight is on {qweight.device}, x on {x.device}")
    if bias is not None:
        if bias.shape != (n,) or not bias.dtype.is_floating_point:
            raise ValueError(
                f"bias must be a floating ({n},) tensor, got {bias.dtype} {tuple(bias.shape)}"
            )
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device}, x on {x.device}")


def unpack_int4(qweight: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """The fp32 (N, K) matrix that an int4 weight encodes (also for dequantised tiles on CPU).

    A torch function rather than ``gguf.quants``: the arrays are already split out of their
    blocks and may live on the GPU. The tests check it against ``gguf.quants`` bit for bit.
    """
    n, k = _check_int4_weight(qweight, scales, mins)
    blocks = qweight.reshape(n, k // GROUP_SIZE, GROUP_SIZE // 2)  # (N, K/32, 16)
    q = torch.cat((blocks & 0x0F, blocks >> 4), dim=-1)  # (N, K/32, 32): low nibbles first
    w = q.float() * scales.float()[..., None] + mins.float()[..., None]  # (N, K/32, 32)
    return w.reshape(n, k)


def w4a16_matmul_reference(
    x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor, bias: Tensor | None = None
) -> Tensor:
    """Torch reference: dequantise ``W`` to fp32, ``x @ W^T + bias`` in fp32, round to x's dtype.

    x: (M, K); qweight: (N, K/2) uint8; scales, mins: (N, K/32) fp16; bias: (N,). Returns (M, N).
    """
    weight = unpack_int4(qweight, scales, mins)  # (N, K)
    out = x.float() @ weight.t()  # (M, N)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def w4a16_matmul(
    x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor, bias: Tensor | None = None
) -> Tensor:
    """``x @ W^T + bias`` for an int4 ``W`` (see the module docstring for the layout).

    x: (M, K) fp16/bf16/fp32; qweight: (N, K/2) uint8; scales, mins: (N, K/32) fp16;
    bias: (N,) or None. Returns (M, N) in x's dtype, accumulated in fp32.
    """
    check_w4a16_args(x, qweight, scales, mins, bias)
    if use_triton(x.device):
        from core_engine.kernels.triton_ops.w4a16 import w4a16_matmul_triton

        return w4a16_matmul_triton(x, qweight, scales, mins, bias)
    return w4a16_matmul_reference(x, qweight, scales, mins, bias)

"""Rotary position embedding applied to q and k for a flat batch of tokens.

Two pairings of the rotated dims exist; ``is_neox`` picks one:

* NeoX / rotate-half (``is_neox=True``): dims ``i`` and ``i + R/2`` form a pair. This is what
  :mod:`core_engine.model` uses — its GGUF loader un-permutes llama.cpp's q/k rows.
* Interleaved / GPT-J (``is_neox=False``): dims ``2i`` and ``2i + 1`` form a pair, the layout
  of llama.cpp's ``LLAMA_ROPE_TYPE_NORM`` on un-permuted GGUF weights.

``R`` (the rotary dim) is ``2 * cos.shape[-1]`` and may be less than ``head_dim``; dims past it
pass through unchanged. Pair ``i`` at position ``p`` is rotated by the angle whose cosine is
``cos[p, i]`` (tables as built by :class:`core_engine.model.rope.RotaryEmbedding` or
:func:`rotary_cos_sin`). The rotation is computed in fp32 and rounded to the input's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core_engine.kernels.dispatch import use_triton

__all__ = ["apply_rotary_embedding", "apply_rotary_embedding_reference", "rotary_cos_sin"]


def rotary_cos_sin(
    rotary_dim: int,
    max_positions: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Plain (unscaled) RoPE tables: cos and sin, each ``(max_positions, rotary_dim // 2)``."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)  # (R/2,)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)  # (P, R/2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _check_rotary_args(q: Tensor, k: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must be (T, n_heads, head_dim) and (T, n_kv_heads, head_dim), got "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be ({q.shape[0]},), got {tuple(positions.shape)}")
    if cos.dim() != 2 or sin.shape != cos.shape or 2 * cos.shape[1] > q.shape[2]:
        raise ValueError(
            f"cos and sin must both be (max_positions, rotary_dim // 2) with rotary_dim <= "
            f"{q.shape[2]}, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )


def _rotate_reference(x: Tensor, cos: Tensor, sin: Tensor, is_neox: bool) -> Tensor:
    # x: (T, n, R); cos, sin: (T, 1, R/2) fp32. Returns the rotated (T, n, R) in x's dtype.
    half = cos.shape[-1]
    x32 = x.float()
    if is_neox:
        x1, x2 = x32[..., :half], x32[..., half:]
    else:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out = torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)
    return out.to(x.dtype)


def apply_rotary_embedding_reference(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    is_neox: bool = True,
    inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    """Torch reference; see :func:`apply_rotary_embedding` for the arguments."""
    rotary_dim = 2 * cos.shape[1]
    cos_t = cos[positions].float().unsqueeze(1)  # (T, 1, R/2)
    sin_t = sin[positions].float().unsqueeze(1)
    q_out = q if inplace else q.clone()
    k_out = k if inplace else k.clone()
    q_out[..., :rotary_dim] = _rotate_reference(q[..., :rotary_dim], cos_t, sin_t, is_neox)
    k_out[..., :rotary_dim] = _rotate_reference(k[..., :rotary_dim], cos_t, sin_t, is_neox)
    return q_out, k_out


def apply_rotary_embedding(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    is_neox: bool = True,
    inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    """Rotate q (T, n_heads, head_dim) and k (T, n_kv_heads, head_dim) by their positions (T,).

    cos, sin: (max_positions, rotary_dim // 2). q and k may be strided views (e.g. slices of a
    fused QKV output); with ``inplace=True`` they are rotated in place and returned, otherwise
    new tensors are returned and the inputs are left untouched.
    """
    _check_rotary_args(q, k, positions, cos, sin)
    if use_triton(q.device):
        from core_engine.kernels.triton_ops.rotary import apply_rotary_embedding_triton

        return apply_rotary_embedding_triton(
            q, k, positions, cos, sin, is_neox=is_neox, inplace=inplace
        )
    return apply_rotary_embedding_reference(
        q, k, positions, cos, sin, is_neox=is_neox, inplace=inplace
    )

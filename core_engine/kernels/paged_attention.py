"""Decode attention over a paged KV cache (one new query token per sequence).

Layout (the contract of :mod:`core_engine.kv_cache_manager`):

* ``k_cache``, ``v_cache``: ``(num_blocks, block_size, n_kv_heads, head_dim)``, one layer's;
* ``block_tables``: ``(num_seqs, max_blocks_per_seq)`` int32; token ``j`` of sequence ``s`` lives
  in block ``block_tables[s, j // block_size]`` at offset ``j % block_size``; entries past a
  sequence's last block are never read (pad them with 0);
* ``context_lens``: ``(num_seqs,)`` int32, tokens of each sequence in the cache *including*
  this step's (whose K/V were written by :func:`~core_engine.kernels.reshape_and_cache`
  first); each must be >= 1 and <= ``max_blocks_per_seq * block_size``;
* ``q``: ``(num_seqs, n_heads, head_dim)``; GQA: query head ``h`` reads kv head
  ``h // (n_heads // n_kv_heads)``.

* quantized caches (int8 or float8 codes, :mod:`core_engine.kv_quant`) come with ``k_scale``
  and ``v_scale``: ``(num_blocks, n_kv_heads)`` float32, the value of a code in block ``b``
  and kv head ``h`` being ``code * scale[b, h]``.

The decode token sits at the last position, so it attends to all ``context_lens[s]`` keys of its
sequence and no causal mask is needed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from core_engine.kernels.dispatch import use_triton

__all__ = ["check_paged_decode_args", "paged_attention_decode", "paged_attention_decode_reference"]


_CODE_DTYPES = tuple(
    d for d in (torch.int8, getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None
)


def check_paged_decode_args(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> None:
    """Raise ``ValueError`` naming the argument whose shape or dtype breaks the layout above.

    Only shapes and dtypes are checked (no device sync); lengths are the caller's invariant.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be (num_seqs, n_heads, head_dim), got shape {tuple(q.shape)}")
    num_seqs, n_heads, head_dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape[-1] != head_dim:
        raise ValueError(
            f"k_cache must be (num_blocks, block_size, n_kv_heads, {head_dim}), "
            f"got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}"
        )
    n_kv_heads = k_cache.shape[2]
    if n_heads % n_kv_heads != 0:
        raise ValueError(
            f"q has {n_heads} heads, not a multiple of the cache's {n_kv_heads} kv heads"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be ({num_seqs}, max_blocks_per_seq), "
            f"got {tuple(block_tables.shape)}"
        )
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"context_lens must be ({num_seqs},), got {tuple(context_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale go together: pass both or neither")
    is_code = k_cache.dtype in _CODE_DTYPES
    if k_scale is None:
        if is_code:
            raise ValueError(f"a {k_cache.dtype} cache holds codes: pass k_scale and v_scale")
        return
    assert v_scale is not None
    if not is_code:
        raise ValueError(f"k_scale/v_scale need an int8 or float8 cache, got {k_cache.dtype}")
    expected = (k_cache.shape[0], n_kv_heads)
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if tuple(t.shape) != expected or t.dtype != torch.float32:
            raise ValueError(f"{name} must be {expected} float32, got {tuple(t.shape)} {t.dtype}")


def paged_attention_decode_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """Torch reference (and the CPU path): gather each sequence's blocks (dequantized with
    ``k_scale``/``v_scale`` when given), masked softmax in fp32.

    Returns ``(num_seqs, n_heads, head_dim)`` in ``q``'s dtype. Work and memory grow with
    ``max_blocks_per_seq``, not with each sequence's own length (no per-sequence Python loop).
    """
    num_seqs, n_heads, head_dim = q.shape
    num_blocks, block_size, n_kv_heads, _ = k_cache.shape
    group = n_heads // n_kv_heads
    max_len = block_tables.shape[1] * block_size
    # Padding entries are masked below, but must still be valid indices for the gather.
    tables = block_tables.long().clamp(0, num_blocks - 1)  # (S, max_blocks)
    keys = k_cache[tables].float()  # (S, max_blocks, block_size, n_kv, D)
    values = v_cache[tables].float()
    if k_scale is not None and v_scale is not None:
        keys = keys * k_scale[tables][:, :, None, :, None]  # scales: (S, max_blocks, n_kv)
        values = values * v_scale[tables][:, :, None, :, None]
    keys = keys.reshape(num_seqs, max_len, n_kv_heads, head_dim)  # (S, L, n_kv, D)
    values = values.reshape(num_seqs, max_len, n_kv_heads, head_dim)
    q_groups = q.float().reshape(num_seqs, n_kv_heads, group, head_dim)  # (S, n_kv, G, D)
    scores = torch.einsum("skgd,slkd->skgl", q_groups, keys) * scale  # (S, n_kv, G, L)
    positions = torch.arange(max_len, device=q.device)
    is_past_end = positions[None, :] >= context_lens[:, None].to(positions.dtype)  # (S, L)
    scores = scores.masked_fill(is_past_end[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Slots past the end hold stale or uninitialised memory (maybe NaN): 0 * NaN would leak.
    values = values.masked_fill(is_past_end[:, :, None, None], 0.0)
    out = torch.einsum("skgl,slkd->skgd", probs, values)  # (S, n_kv, G, D)
    return out.reshape(num_seqs, n_heads, head_dim).to(q.dtype)


def paged_attention_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
) -> Tensor:
    """Attention of each sequence's one new query over its cached keys/values.

    q: (num_seqs, n_heads, head_dim); caches: (num_blocks, block_size, n_kv_heads, head_dim);
    block_tables: (num_seqs, max_blocks_per_seq) int32; context_lens: (num_seqs,) int32;
    k_scale, v_scale: (num_blocks, n_kv_heads) float32 for int8/float8 caches, else None.
    Returns (num_seqs, n_heads, head_dim) in q's dtype. Triton on CUDA, torch otherwise.
    """
    check_paged_decode_args(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    args = (q, k_cache, v_cache, block_tables, context_lens, scale)
    if use_triton(q.device):
        from core_engine.kernels.triton_ops.paged_attention import paged_attention_decode_triton

        return paged_attention_decode_triton(*args, k_scale=k_scale, v_scale=v_scale)
    return paged_attention_decode_reference(*args, k_scale=k_scale, v_scale=v_scale)

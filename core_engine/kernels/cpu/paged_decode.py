"""Decode attention over the paged KV cache on the CPU, in C++ (``paged_decode.cpp``).

Same signature and layout as :func:`core_engine.kernels.paged_attention.paged_attention_decode`
(one query token per sequence). It reads each sequence's K/V in place through its block table:
the torch path gathers them into a dense copy, reshapes them and makes a masked
``scaled_dot_product_attention`` call, ~0.25 ms per layer of SmolLM2-135M at batch 1, most of
it per-op overhead. Caches in float32, bfloat16 or int8 codes (with their scales); queries in
float32 or bfloat16. fp8 caches are not handled here (:func:`supports_paged_decode`). It also
takes a layer's sliding window and logit soft-cap
(:class:`~core_engine.attention.LayerAttention`), which the Triton kernel does not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from core_engine.kernels.cpu import cpu_extension
from core_engine.kernels.paged_attention import check_paged_decode_args

__all__ = ["paged_decode", "paged_decode_kernel", "supports_paged_decode"]

_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
_QUERY_DTYPES = (torch.float32, torch.bfloat16)


def supports_paged_decode(cache_dtype: torch.dtype, query_dtype: torch.dtype) -> bool:
    """Whether the kernel takes caches of ``cache_dtype`` (int8: codes) and ``query_dtype`` queries."""
    return cache_dtype in _CACHE_DTYPES and query_dtype in _QUERY_DTYPES


def paged_decode_kernel() -> Callable[..., Tensor]:
    """The compiled function itself (built on a machine's first call, ~1 min on 2 cores).

    It checks shapes, dtypes, lengths and block ids in C++ (``ValueError``), so a hot loop may
    call it directly; tables and lengths must be int32, and ``window``/``softcap`` are 0 for
    none (not None).
    """
    return cpu_extension("paged_decode").paged_decode


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention of each sequence's one new query over its cached keys/values.

    q: (num_seqs, n_heads, head_dim) float32/bfloat16; caches: (num_blocks, block_size,
    n_kv_heads, head_dim) float32/bfloat16, or int8 codes with k_scale, v_scale (num_blocks,
    n_kv_heads) float32; block_tables: (num_seqs, max_blocks_per_seq); context_lens:
    (num_seqs,). ``window``: the query (at position ``context_len - 1``) sees only the last
    ``window`` keys; ``softcap``: scaled scores ``s`` become ``softcap * tanh(s / softcap)``
    before the softmax (None: neither). Returns (num_seqs, n_heads, head_dim) in q's dtype,
    accumulated in fp32.
    """
    check_paged_decode_args(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    if not supports_paged_decode(k_cache.dtype, q.dtype):
        raise ValueError(
            f"paged_decode takes {_CACHE_DTYPES} caches and {_QUERY_DTYPES} queries, "
            f"got k_cache {k_cache.dtype}, q {q.dtype}"
        )
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 or None, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    return paged_decode_kernel()(
        q, k_cache, v_cache, block_tables.to(torch.int32), context_lens.to(torch.int32), scale,
        k_scale=k_scale, v_scale=v_scale, window=window or 0, softcap=softcap or 0.0,
    )

"""Kernels of the core engine: Triton on CUDA, torch everywhere else.

Each operation has a torch reference (``*_reference``, also the CPU path) and a Triton
implementation (:mod:`core_engine.kernels.triton_ops`) with the same signature; the plain name
dispatches per call (see :mod:`core_engine.kernels.dispatch`).

================================  =====================================================
:func:`paged_attention_decode`    decode attention over the paged KV cache (GQA, splits)
:func:`reshape_and_cache`         write new K/V into their cache slots
:func:`rms_norm`                  RMSNorm
:func:`fused_add_rms_norm`        residual add + RMSNorm in one pass
:func:`apply_rotary_embedding`    RoPE on q and k (NeoX or interleaved pairs)
:func:`w4a16_matmul`              ``x @ W^T`` for int4 (Q4_1-block) W, fp32 sums
:func:`unpack_int4`               the fp32 matrix an int4 weight encodes
================================  =====================================================

Importing this package never imports triton; the Triton modules load on first use.
"""

from __future__ import annotations

from core_engine.kernels.cache_write import reshape_and_cache, reshape_and_cache_reference
from core_engine.kernels.dispatch import interpreter_enabled, triton_available, use_triton
from core_engine.kernels.paged_attention import (
    paged_attention_decode,
    paged_attention_decode_reference,
)
from core_engine.kernels.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from core_engine.kernels.rotary import (
    apply_rotary_embedding,
    apply_rotary_embedding_reference,
    rotary_cos_sin,
)
from core_engine.kernels.w4a16 import (
    check_w4a16_args,
    unpack_int4,
    w4a16_matmul,
    w4a16_matmul_reference,
)

__all__ = [
    "apply_rotary_embedding",
    "apply_rotary_embedding_reference",
    "check_w4a16_args",
    "fused_add_rms_norm",
    "fused_add_rms_norm_reference",
    "interpreter_enabled",
    "paged_attention_decode",
    "paged_attention_decode_reference",
    "reshape_and_cache",
    "reshape_and_cache_reference",
    "rms_norm",
    "rms_norm_reference",
    "rotary_cos_sin",
    "triton_available",
    "unpack_int4",
    "use_triton",
    "w4a16_matmul",
    "w4a16_matmul_reference",
]

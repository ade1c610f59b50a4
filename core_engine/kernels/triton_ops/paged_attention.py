"""Paged-attention decode in Triton: one program per (sequence, kv head, context split).

All query heads of a kv group are processed together, so each K/V tile is read once per
group: q is a ``(GROUP_PAD, head_dim)`` tile (padded to 16 rows for ``tl.dot``), keys come in
tiles of ``BLOCK_N`` tokens gathered through the block table, and softmax is computed online
(running max and sum) across tiles. Long contexts with few sequences are split across
programs (flash-decoding); a second kernel merges the per-split partial results.

Quantized caches (int8 or float8 codes, one float32 scale per block and kv head) are
dequantized in the tile loop: each tile's codes are multiplied by their blocks' scales, in
fp32, before the dots; a cache of codes costs the kernel half (or a quarter) of the bytes.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from core_engine.kernels.dispatch import interpreter_enabled

__all__ = ["paged_attention_decode_triton"]

_LOG2E = 1.4426950408889634
# Past this many splits the merge costs more than the extra parallelism gives.
_MAX_SPLITS = 32


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # (S, H, D), written when not IS_SPLIT
    part_acc_ptr,  # (S, H, num_splits, HEAD_DIM) fp32, written when IS_SPLIT
    part_max_ptr,  # (S, H, num_splits) fp32, running max in log2 units
    part_sum_ptr,  # (S, H, num_splits) fp32
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,  # (num_blocks, n_kv_heads) fp32, read when QUANTIZED
    v_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works with exp2
    num_heads,
    num_splits,
    tiles_per_split,
    stride_q_seq,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_scale_block,  # of k_scale and v_scale (both contiguous (num_blocks, n_kv_heads))
    stride_table_seq,
    stride_out_seq,
    stride_out_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    # Split count is a runtime value (it follows the batch): constexpr would compile per value.
    IS_SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)

    group_offs = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group_offs  # (GROUP_PAD,)
    head_mask = group_offs < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=q_mask,
        other=0.0,
    )  # (GROUP_PAD, HEAD_DIM_PAD)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    for tile in range(tile_start, tile_end):
        tokens = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) positions in the sequence
        token_mask = tokens < context_len
        block_ids = tl.load(
            block_tables_ptr + seq * stride_table_seq + tokens // BLOCK_SIZE,
            mask=token_mask,
            other=0,
        ).to(tl.int64)
        slots = tokens % BLOCK_SIZE
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(
            k_cache_ptr
            + block_ids[:, None] * stride_k_block
            + slots[:, None] * stride_k_slot
            + kv_head * stride_k_head
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )  # (BLOCK_N, HEAD_DIM_PAD)
        v = tl.load(
            v_cache_ptr
            + block_ids[:, None] * stride_v_block
            + slots[:, None] * stride_v_slot
            + kv_head * stride_v_head
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )  # (BLOCK_N, HEAD_DIM_PAD)
        if QUANTIZED:
            scale_offs = block_ids * stride_scale_block + kv_head
            k_scale = tl.load(k_scale_ptr + scale_offs, mask=token_mask, other=0.0)  # (BLOCK_N,)
            v_scale = tl.load(v_scale_ptr + scale_offs, mask=token_mask, other=0.0)
            k = k.to(tl.float32) * k_scale[:, None]
            v = v.to(tl.float32) * v_scale[:, None]
            if not DOT_FP32:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
        elif DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # (GROUP_PAD, BLOCK_N)
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        # Every tile visited holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
        p = tl.exp2(scores - m_new[:, None])  # (GROUP_PAD, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    if not IS_SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:
        rows = (seq * num_heads + heads) * num_splits + split  # (GROUP_PAD,)
        tl.store(part_max_ptr + rows, m_i, mask=head_mask)
        tl.store(part_sum_ptr + rows, l_i, mask=head_mask)
        tl.store(part_acc_ptr + rows[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask)


@triton.jit
def _paged_decode_merge_kernel(
    out_ptr,  # (S, H, D)
    part_acc_ptr,  # (S, H, num_splits, HEAD_DIM) fp32
    part_max_ptr,  # (S, H, num_splits) fp32
    part_sum_ptr,  # (S, H, num_splits) fp32
    num_heads,
    num_splits,
    stride_out_seq,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS_PAD)
    split_mask = splits < num_splits
    rows = (seq * num_heads + head) * num_splits + splits  # (NUM_SPLITS_PAD,)
    m = tl.load(part_max_ptr + rows, mask=split_mask, other=float("-inf"))
    l_part = tl.load(part_sum_ptr + rows, mask=split_mask, other=0.0)
    # Splits past the sequence's end are empty (max -inf); clamping keeps exp2 free of inf - inf.
    m_all = tl.maximum(tl.max(m, 0), -1e30)
    w = tl.exp2(m - m_all)  # (NUM_SPLITS_PAD,)
    total = tl.sum(w * l_part, 0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    acc = tl.load(
        part_acc_ptr + rows[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # (NUM_SPLITS_PAD, HEAD_DIM_PAD)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_num_splits(device: torch.device, num_programs: int, max_tiles: int) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one by one: more of them only costs time
    # Aim for about two programs per SM so that small batches still fill the GPU.
    target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(max_tiles, _MAX_SPLITS, triton.cdiv(target, num_programs)))


def paged_attention_decode_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    *,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> Tensor:
    """Triton version of :func:`~core_engine.kernels.paged_attention_decode_reference`.

    ``num_splits`` (context partitions per sequence) and ``block_n`` (tokens per tile, a power
    of two >= 16) default to a choice by device; tests set them to reach every path. The
    context split bound comes from ``block_tables``' width, so no device sync is needed.
    ``k_scale``/``v_scale``: (num_blocks, n_kv_heads) float32 for caches of int8/float8 codes.
    """
    num_seqs, n_heads, head_dim = q.shape
    _, block_size, n_kv_heads, _ = k_cache.shape
    group = n_heads // n_kv_heads
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in head_dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    quantized = k_scale is not None and v_scale is not None
    if quantized:
        assert k_scale is not None and v_scale is not None
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()
    else:
        k_scale = v_scale = k_cache  # unused by the unquantized path
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    out = torch.empty((num_seqs, n_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out

    if block_n is None:
        # Bigger tiles keep more bytes in flight on a GPU; the interpreter prefers small ones.
        block_n = max(64 if q.is_cuda else 16, triton.next_power_of_2(block_size))
    max_tiles = max(1, triton.cdiv(block_tables.shape[1] * block_size, block_n))
    if num_splits is None:
        num_splits = _default_num_splits(q.device, num_seqs * n_kv_heads, max_tiles)
    tiles_per_split = triton.cdiv(max_tiles, max(1, min(num_splits, max_tiles)))
    num_splits = triton.cdiv(max_tiles, tiles_per_split)

    if num_splits > 1:
        part_acc = torch.empty(
            (num_seqs, n_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_max = torch.empty(
            (num_seqs, n_heads, num_splits), dtype=torch.float32, device=q.device
        )
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused by the single-split path

    # bf16 tl.dot is wrong in the interpreter, and mixed dtypes cannot feed tensor cores
    # (dequantized codes are cast to q's dtype, so quantized caches keep them).
    dot_fp32 = (
        interpreter_enabled()
        or q.dtype == torch.float32
        or (q.dtype != k_cache.dtype and not quantized)
    )
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    _paged_decode_kernel[(num_seqs, n_kv_heads, num_splits)](
        out,
        part_acc,
        part_max,
        part_sum,
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        context_lens,
        scale * _LOG2E,
        n_heads,
        num_splits,
        tiles_per_split,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_scale.stride(0) if quantized else 0,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        IS_SPLIT=num_splits > 1,
        DOT_FP32=dot_fp32,
        QUANTIZED=quantized,
    )
    if num_splits > 1:
        _paged_decode_merge_kernel[(num_seqs, n_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            n_heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out

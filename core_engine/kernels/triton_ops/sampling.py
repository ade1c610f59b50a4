"""Sampling-side kernels in Triton: one program per row of logits, looping over the vocabulary.

The filter finds its top-k and top-p thresholds without sorting. fp32 values map to int32
keys that sort the same way (flip the magnitude bits of negatives), so "the k-th largest
value" is the largest key ``t`` with ``count(key >= t) >= k``, found by a multi-way search:
each pass over the row evaluates ``NUM_PROBES`` candidate thresholds at once and shrinks the
interval ~17-fold, so 8 passes pin an exact key among 2^32. Top-p searches the same way on the
mass ``sum(exp(x - m) for key >= t)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["filter_logits_triton", "greedy_sample_triton"]

_NUM_PROBES = 16


@triton.jit
def _greedy_sample_kernel(
    token_ids_ptr,  # (B,) int64
    logprobs_ptr,  # (B,) fp32
    logits_ptr,  # (B, V)
    vocab_size,
    stride_logits,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), dtype=tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    best = tl.zeros([], dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + offs
        x = tl.load(
            logits_ptr + row * stride_logits + cols, mask=cols < vocab_size, other=float("-inf")
        )
        x = x.to(tl.float32)
        chunk_max = tl.max(x, 0)
        chunk_best = tl.argmax(x, 0) + start  # argmax returns the first of equal maxima
        # Strictly greater: an equal maximum in a later chunk must not displace the first.
        best = tl.where(chunk_max > m, chunk_best, best)
        m_new = tl.maximum(m, chunk_max)
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    tl.store(token_ids_ptr + row, best.to(tl.int64))
    tl.store(logprobs_ptr + row, -tl.log(total))


@triton.jit
def _order_key(x):
    # fp32 -> int64 with the same order: negatives have their magnitude bits flipped.
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _scaled_chunk(logits_row_ptr, start, vocab_size, temperature, BLOCK_V: tl.constexpr):
    cols = start + tl.arange(0, BLOCK_V)
    mask = cols < vocab_size
    x = tl.load(logits_row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
    # Round-to-nearest division, bit-identical to torch's `logits / temperature`.
    return tl.div_rn(x, temperature), mask


@triton.jit
def _probes(lo, hi, NUM_PROBES: tl.constexpr):
    # NUM_PROBES thresholds spread over [lo, hi): lo + floor((hi - lo) * j / (NUM_PROBES + 1)).
    steps = tl.arange(1, NUM_PROBES + 1).to(tl.int64)
    return lo + ((hi - lo) * steps) // (NUM_PROBES + 1)  # (NUM_PROBES,)


@triton.jit
def _filter_logits_kernel(
    out_ptr,  # (B, V) fp32
    logits_ptr,  # (B, V)
    temperature_ptr,  # (B,)
    top_k_ptr,  # (B,)
    top_p_ptr,  # (B,)
    min_p_ptr,  # (B,)
    vocab_size,
    stride_logits,
    stride_out,
    BLOCK_V: tl.constexpr,
    NUM_PROBES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_logits
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    top_k = tl.load(top_k_ptr + row).to(tl.int64)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    min_p = tl.load(min_p_ptr + row).to(tl.float32)

    m = tl.full([], float("-inf"), dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        x, mask = _scaled_chunk(logits_row, start, vocab_size, temperature, BLOCK_V)
        m = tl.maximum(m, tl.max(x, 0))
    max_key = _order_key(m)

    # Top-k: the largest key t with count(key >= t) >= top_k. Invariant: lo qualifies, hi does not.
    kth_key = tl.full([], -(2**31), dtype=tl.int64)
    if top_k < vocab_size:
        lo = kth_key
        hi = max_key + 1
        while hi - lo > 1:
            probes = _probes(lo, hi, NUM_PROBES)
            counts = tl.zeros([NUM_PROBES], dtype=tl.int64)
            for start in range(0, vocab_size, BLOCK_V):
                x, mask = _scaled_chunk(logits_row, start, vocab_size, temperature, BLOCK_V)
                above = (_order_key(x)[:, None] >= probes[None, :]) & mask[
                    :, None
                ]  # (BLOCK_V, NUM_PROBES)
                counts += tl.sum(above.to(tl.int64), 0)
            qualifies = counts >= top_k
            lo = tl.max(tl.where(qualifies, probes, lo), 0)
            hi = tl.min(tl.where(qualifies, hi, probes), 0)
        kth_key = lo

    # Top-p over the top-k survivors: the largest t whose mass(key >= t) >= top_p * survivors' mass.
    threshold_key = kth_key
    if top_p < 1.0:
        total = tl.zeros([], dtype=tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            x, mask = _scaled_chunk(logits_row, start, vocab_size, temperature, BLOCK_V)
            total += tl.sum(tl.where(mask & (_order_key(x) >= kth_key), tl.exp(x - m), 0.0), 0)
        target = top_p * total
        lo = kth_key
        hi = max_key + 1
        while hi - lo > 1:
            probes = _probes(lo, hi, NUM_PROBES)
            mass = tl.zeros([NUM_PROBES], dtype=tl.float32)
            for start in range(0, vocab_size, BLOCK_V):
                x, mask = _scaled_chunk(logits_row, start, vocab_size, temperature, BLOCK_V)
                weight = tl.where(mask, tl.exp(x - m), 0.0)  # (BLOCK_V,)
                above = _order_key(x)[:, None] >= probes[None, :]  # (BLOCK_V, NUM_PROBES)
                mass += tl.sum(tl.where(above, weight[:, None], 0.0), 0)
            qualifies = mass >= target
            lo = tl.max(tl.where(qualifies, probes, lo), 0)
            hi = tl.min(tl.where(qualifies, hi, probes), 0)
        threshold_key = lo

    for start in range(0, vocab_size, BLOCK_V):
        x, mask = _scaled_chunk(logits_row, start, vocab_size, temperature, BLOCK_V)
        keep = (_order_key(x) >= threshold_key) & (tl.exp(x - m) >= min_p)
        cols = start + tl.arange(0, BLOCK_V)
        tl.store(out_ptr + row * stride_out + cols, tl.where(keep, x, float("-inf")), mask=mask)


def greedy_sample_triton(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Triton version of :func:`~core_engine.kernels.greedy_sample_reference`."""
    num_seqs, vocab_size = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    token_ids = torch.empty(num_seqs, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(num_seqs, dtype=torch.float32, device=logits.device)
    if num_seqs > 0:
        _greedy_sample_kernel[(num_seqs,)](
            token_ids,
            logprobs,
            logits,
            vocab_size,
            logits.stride(0),
            BLOCK_V=min(4096, triton.next_power_of_2(vocab_size)),
        )
    return token_ids, logprobs


def filter_logits_triton(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    *,
    block_v: int | None = None,
) -> Tensor:
    """Triton version of :func:`~core_engine.kernels.filter_logits_reference`.

    ``block_v`` (vocabulary chunk per loop step, a power of two) is for tests that need the
    multi-chunk path on a small vocabulary.
    """
    num_seqs, vocab_size = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty((num_seqs, vocab_size), dtype=torch.float32, device=logits.device)
    if block_v is None:
        block_v = min(1024, triton.next_power_of_2(vocab_size))
    if num_seqs > 0:
        _filter_logits_kernel[(num_seqs,)](
            out,
            logits,
            temperature.contiguous(),
            top_k.contiguous(),
            top_p.contiguous(),
            min_p.contiguous(),
            vocab_size,
            logits.stride(0),
            out.stride(0),
            BLOCK_V=block_v,
            NUM_PROBES=_NUM_PROBES,
            num_warps=8,
        )
    return out

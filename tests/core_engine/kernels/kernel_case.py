"""Shared inputs for the kernel tests: paged KV caches with known dense contents, tolerances."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from core_engine.attention import LayerAttention

# Per dtype (atol, rtol) for kernel vs reference. bf16 allows ~2 ulp: the Triton interpreter
# rounds fp32 -> bf16 by truncation where a GPU (and torch) round to nearest.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


@dataclass
class PagedKV:
    """A paged cache holding known per-sequence K/V, with everything unused set to NaN."""

    k_cache: Tensor  # (num_blocks, block_size, n_kv_heads, head_dim)
    v_cache: Tensor
    block_tables: Tensor  # (num_seqs, max_blocks) int32, padded with 0
    context_lens: Tensor  # (num_seqs,) int32
    keys: list[Tensor]  # per sequence (context_len, n_kv_heads, head_dim), the dense truth
    values: list[Tensor]


def make_paged_kv(
    context_lens: list[int],
    *,
    block_size: int,
    n_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    extra_table_width: int = 1,
) -> PagedKV:
    """Scatter random dense K/V for each sequence into shuffled blocks of one pool.

    Unused slots (the tails of partial blocks, spare blocks) are NaN, so a kernel that reads
    past a sequence's end turns its output into NaN. Tables are wider than needed by
    ``extra_table_width`` zero-padded entries.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 2  # two spare blocks nobody owns
    k_cache = torch.full((num_blocks, block_size, n_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + extra_table_width
    block_tables = torch.zeros((len(context_lens), max_blocks), dtype=torch.int32)
    keys, values = [], []
    for s, (n, nb) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        k = torch.randn((n, n_kv_heads, head_dim), generator=gen).to(dtype)
        v = torch.randn((n, n_kv_heads, head_dim), generator=gen).to(dtype)
        keys.append(k.to(device))
        values.append(v.to(device))
        ids = [order.pop() for _ in range(nb)]
        block_tables[s, :nb] = torch.tensor(ids, dtype=torch.int32)
        for j in range(n):
            k_cache[ids[j // block_size], j % block_size] = k[j].float()
            v_cache[ids[j // block_size], j % block_size] = v[j].float()
    return PagedKV(
        k_cache=k_cache.to(dtype).to(device),
        v_cache=v_cache.to(dtype).to(device),
        block_tables=block_tables.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
    )


def dense_decode_attention(
    q: Tensor, keys: list[Tensor], values: list[Tensor], scale: float
) -> Tensor:
    """Textbook attention, one sequence at a time in float64: softmax(q k^T * scale) v.

    q: (num_seqs, n_heads, head_dim); keys[s], values[s]: (len_s, n_kv_heads, head_dim).
    """
    outs = []
    for s, (k, v) in enumerate(zip(keys, values, strict=True)):
        group = q.shape[1] // k.shape[1]
        k_full = k.double().repeat_interleave(group, dim=1)  # (L, n_heads, D)
        v_full = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[s].double(), k_full) * scale  # (n_heads, L)
        outs.append(torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v_full))
    return torch.stack(outs)  # (num_seqs, n_heads, D)


@dataclass
class QuantizedPagedKV:
    """A :class:`PagedKV` as codes with one float32 scale per (block, kv head)."""

    k_codes: Tensor  # (num_blocks, block_size, n_kv_heads, head_dim) int8 / float8
    v_codes: Tensor
    k_scale: Tensor  # (num_blocks, n_kv_heads) float32; NaN for blocks nobody owns
    v_scale: Tensor
    keys: list[Tensor]  # per sequence, the dequantized values (what attention should see)
    values: list[Tensor]


def quantize_paged_kv(paged: PagedKV, code_dtype: torch.dtype) -> QuantizedPagedKV:
    """Quantize ``paged`` per (block, kv head) with scale ``amax / qmax``.

    Unused slots get the largest code and unowned blocks a NaN scale, so a kernel that reads
    past a sequence's end, or a scale it should not, still turns its output into NaN or junk.
    """
    qmax = 127.0 if code_dtype == torch.int8 else torch.finfo(code_dtype).max

    def one(cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = cache.float().cpu()
        unused = x.isnan()
        amax = x.nan_to_num(0.0).abs().amax(dim=(1, 3))  # (num_blocks, n_kv)
        scale = torch.where(amax > 0, amax / qmax, float("nan"))
        codes = (x / scale[:, None, :, None]).nan_to_num(0.0).clamp(-qmax, qmax)
        codes = codes.masked_fill(unused, qmax)
        if code_dtype == torch.int8:
            codes = codes.round()
        codes = codes.to(code_dtype)
        dense = codes.float() * scale[:, None, :, None]  # (num_blocks, block_size, n_kv, D)
        return codes, scale, dense

    k_codes, k_scale, k_dense = one(paged.k_cache)
    v_codes, v_scale, v_dense = one(paged.v_cache)
    block_size = paged.k_cache.shape[1]
    keys, values = [], []
    tables = paged.block_tables.cpu()
    for s, n in enumerate(paged.context_lens.tolist()):
        pos = torch.arange(n)
        blocks = tables[s, pos // block_size].long()
        keys.append(k_dense[blocks, pos % block_size])
        values.append(v_dense[blocks, pos % block_size])
    device = paged.k_cache.device
    return QuantizedPagedKV(
        k_codes=k_codes.to(device),
        v_codes=v_codes.to(device),
        k_scale=k_scale.to(device),
        v_scale=v_scale.to(device),
        keys=[k.to(device) for k in keys],
        values=[v.to(device) for v in values],
    )


def reference_attention(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, spec: LayerAttention) -> Tensor:
    """q (T, n_heads, hd) at ``positions`` (T,) over keys, values (S, n_kv, hd) of positions
    0..S-1: fp32 scores, scaled, soft-capped, masked (causal, window), softmaxed. (T, n_heads, hd)."""
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)  # (S, H, hd)
    v = values.float().repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if spec.scale is None else spec.scale
    scores = torch.einsum("thd,shd->hts", q.float(), k) * scale  # (H, T, S)
    if spec.softcap is not None:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    distance = positions.view(-1, 1) - torch.arange(keys.shape[0]).view(1, -1)  # (T, S): p - j
    visible = distance >= 0
    if spec.window is not None:
        visible &= distance < spec.window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)

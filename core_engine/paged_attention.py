"""PagedAttention: the serving engine's :class:`~core_engine.attention.AttentionContext`.

The K/V of every sequence live in one preallocated pool of fixed-size blocks
(:class:`KVCache`); a sequence's block table says which blocks hold its tokens. Layout (the
contract with ``core_engine/kernels``, also in :mod:`core_engine.kv_cache_manager`):

* ``k_caches[l]``, ``v_caches[l]``: ``(num_blocks, block_size, n_kv_heads, head_dim)`` per layer,
  contiguous, views into one allocation;
* token ``j`` of a sequence is at ``slot = block_table[j // block_size] * block_size +
  j % block_size`` of ``k_caches[l].view(-1, n_kv_heads, head_dim)``;
* decode batches pass ``block_tables`` ``(num_seqs, max_blocks)`` int32 and ``context_lens``
  ``(num_seqs,)`` int32 (attention length including the new token).

One step's tokens are laid out decodes first, then prefill chunks. A decode is one new token,
or (speculative decoding) the last sampled token plus the proposed ones: a *multi-token
decode* of ``q`` queries, query ``i`` at position ``p + i`` seeing keys ``0..p + i``. On the
torch path all decodes of a step, single- and multi-token, are one batched attention call
(queries padded to the longest, masked). Per layer,
:meth:`PagedAttention.forward` first writes the step's new K/V into their slots (so a prefix
block cached by another request this same step is already filled when read), then attends:
decodes in one batched call, each prefill chunk causally over its cached prefix plus itself.
On CUDA the decode uses the Triton paged-decode kernel of ``core_engine.kernels`` when present.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["AttentionMetadata", "KVCache", "PagedAttention", "PrefillSpan"]


class KVCache:
    """The preallocated K/V pool of all layers (see the module docstring for the layout)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # (layers, 2, num_blocks, block_size, n_kv_heads, head_dim): one allocation for all.
        self.storage = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.k_caches = [self.storage[i, 0] for i in range(num_layers)]
        self.v_caches = [self.storage[i, 1] for i in range(num_layers)]
        # Flat slot views, (num_blocks * block_size, n_kv_heads, head_dim).
        self.k_slots = [c.view(-1, num_kv_heads, head_dim) for c in self.k_caches]
        self.v_slots = [c.view(-1, num_kv_heads, head_dim) for c in self.v_caches]

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block costs across all layers (K and V)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk of the step: tokens ``[token_start, token_end)`` of the flat batch."""

    token_start: int
    token_end: int
    #: Tokens of this sequence already cached before the chunk (its first position).
    num_computed_tokens: int
    #: (context_len,) slots of the whole context (prefix + chunk); None when there is no
    #: prefix, so the chunk attends over its own k/v directly.
    context_slots: Tensor | None
    #: (chunk, context_len) bool causal mask; None with no prefix (plain causal).
    mask: Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs of the paged attention, built once and reused by every layer."""

    #: (T,) int64 slot of each new token.
    slot_mapping: Tensor
    num_decodes: int
    #: (D, max_blocks) int32 and (D,) int32 for the decodes (see layout).
    block_tables: Tensor | None
    context_lens: Tensor | None
    #: CPU decode path: (D * S,) slots of each decode's context, padded, and (D, 1, 1, S) mask
    #: ((D, Q, S) per query when a decode has several tokens).
    decode_slots: Tensor | None
    decode_mask: Tensor | None
    prefills: list[PrefillSpan]
    #: Multi-token decodes only: the longest decode's token count ``Q``, the flat row of each
    #: padded query ``(D * Q,)`` (padding repeats row 0), and the padded rows that are real
    #: ``(num_decode_tokens,)``. None when every decode has one token.
    decode_max_queries: int = 1
    decode_query_rows: Tensor | None = None
    decode_real_rows: Tensor | None = None
    #: Tokens of all decodes (== ``num_decodes`` without multi-token decodes).
    num_decode_tokens: int = 0


def build_attention_metadata(
    *,
    block_size: int,
    decodes: Sequence[tuple[int, Sequence[int]] | tuple[int, Sequence[int], int]],
    prefills: Sequence[tuple[int, int, Sequence[int]]],
    device: torch.device,
    use_kernel: bool,
) -> AttentionMetadata:
    """Build the metadata of one step.

    ``decodes``: ``(position, block_ids)`` per decode sequence (one new token at ``position``),
    or ``(position, block_ids, num_tokens)`` for a multi-token decode (tokens at ``position``
    .. ``position + num_tokens - 1``; torch path only: the Triton decode kernel takes one).
    ``prefills``: ``(num_computed_tokens, num_new_tokens, block_ids)`` per prefill chunk.
    """
    slots: list[int] = []
    lens = [d[2] if len(d) == 3 else 1 for d in decodes]  # type: ignore[misc]
    max_q = max(lens, default=1)
    if max_q > 1 and use_kernel:
        raise ValueError("the Triton decode kernel takes one token per decode: pass prefills")
    for (pos, blocks, *_), n in zip(decodes, lens, strict=True):
        for p in range(pos, pos + n):
            slots.append(blocks[p // block_size] * block_size + p % block_size)
    num_decode_tokens = len(slots)
    spans: list[PrefillSpan] = []
    start = num_decode_tokens
    offsets = torch.arange(block_size, device=device)
    for num_computed, num_new, blocks in prefills:
        end_pos = num_computed + num_new
        ctx_slots = (torch.tensor(blocks, device=device).unsqueeze(1) * block_size + offsets).view(-1)
        new_slots = ctx_slots[num_computed:end_pos]
        slots.extend(new_slots.tolist())
        if num_computed == 0:
            spans.append(PrefillSpan(start, start + num_new, 0, None, None))
        else:
            q_pos = torch.arange(num_computed, end_pos, device=device).unsqueeze(1)  # (chunk, 1)
            mask = torch.arange(end_pos, device=device).unsqueeze(0) <= q_pos  # (chunk, S)
            spans.append(PrefillSpan(start, start + num_new, num_computed, ctx_slots[:end_pos], mask))
        start += num_new
    block_tables = context_lens = decode_slots = decode_mask = None
    query_rows = real_rows = None
    if decodes:
        max_blocks = max(len(d[1]) for d in decodes)
        block_tables = torch.tensor(
            [list(d[1]) + [0] * (max_blocks - len(d[1])) for d in decodes], dtype=torch.int32, device=device
        )  # (D, max_blocks)
        context_lens = torch.tensor(
            [d[0] + n for d, n in zip(decodes, lens, strict=True)], dtype=torch.int32, device=device
        )
        if not use_kernel:
            max_len = int(context_lens.max())
            # (D, max_blocks * block_size) -> the first max_len slots of each context.
            decode_slots = (
                (block_tables.long().unsqueeze(2) * block_size + offsets).flatten(1)[:, :max_len].reshape(-1)
            )  # (D * max_len,)
            keys = torch.arange(max_len, device=device)
            if max_q == 1:
                decode_mask = (keys.unsqueeze(0) < context_lens.unsqueeze(1)).view(len(decodes), 1, 1, max_len)
            else:
                # Query i of decode d sits at position context_len - n_d + i.
                q_lens = torch.tensor(lens, device=device)
                first = context_lens.long() - q_lens  # (D,)
                qi = torch.arange(max_q, device=device)
                q_pos = first.unsqueeze(1) + qi.unsqueeze(0)  # (D, Q)
                decode_mask = keys.view(1, 1, -1) <= q_pos.unsqueeze(2)  # (D, Q, S)
                row0 = torch.cumsum(q_lens, 0) - q_lens  # first flat row of each decode
                valid = qi.unsqueeze(0) < q_lens.unsqueeze(1)  # (D, Q)
                query_rows = torch.where(valid, row0.unsqueeze(1) + qi.unsqueeze(0), 0).view(-1)
                real_rows = valid.view(-1).nonzero().squeeze(1)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decodes=len(decodes),
        block_tables=block_tables,
        context_lens=context_lens,
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        prefills=spans,
        decode_max_queries=max_q,
        decode_query_rows=query_rows,
        decode_real_rows=real_rows,
        num_decode_tokens=num_decode_tokens,
    )


def _load_kernels(
    device: torch.device, use_kernels: bool | None
) -> tuple[Callable[..., Tensor], Callable[..., None]] | None:
    """The decode + cache-write kernels of ``core_engine.kernels`` (Triton where it runs), or
    None for the torch path. ``use_kernels=None``: on CUDA only."""
    if use_kernels is False or (use_kernels is None and device.type != "cuda"):
        return None
    from core_engine.kernels.dispatch import use_triton  # lazy: CPU users never import triton

    if not use_triton(device):
        if use_kernels:
            raise RuntimeError(f"Triton kernels do not run on {device} here (TRITON_INTERPRET=1 for CPU)")
        return None
    from core_engine.kernels.cache_write import reshape_and_cache
    from core_engine.kernels.paged_attention import paged_attention_decode

    return paged_attention_decode, reshape_and_cache


class PagedAttention:
    """:class:`~core_engine.attention.AttentionContext` over a :class:`KVCache`.

    Call :meth:`prepare` with the step's :class:`AttentionMetadata` before the model forward.
    ``use_kernels``: None picks the Triton kernels on CUDA and torch elsewhere; True forces the
    kernels (on CPU under the Triton interpreter, for tests).
    """

    def __init__(self, kv_cache: KVCache, *, num_heads: int, use_kernels: bool | None = None) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = kv_cache.num_kv_heads
        self.group = num_heads // kv_cache.num_kv_heads
        self.head_dim = kv_cache.head_dim
        self.scale = kv_cache.head_dim**-0.5
        self.metadata: AttentionMetadata | None = None
        self._multi_mask: Tensor | None = None
        device = kv_cache.storage.device
        kernels = _load_kernels(device, use_kernels)
        self._decode_kernel, self._cache_kernel = kernels if kernels is not None else (None, None)

    @property
    def uses_kernel(self) -> bool:
        return self._decode_kernel is not None

    def prepare(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        self._multi_mask = None
        if metadata.decode_query_rows is not None and metadata.decode_mask is not None:
            # (D, Q, S) -> (D, 1, Q * G, S): the G query heads of a kv head are G rows per query.
            d, q, s = metadata.decode_mask.shape
            self._multi_mask = (
                metadata.decode_mask.unsqueeze(2).expand(d, q, self.group, s).reshape(d, 1, q * self.group, s)
            )

    def forward(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: (T, n_heads, hd); k, v: (T, n_kv_heads, hd). Returns (T, n_heads, hd)."""
        md = self.metadata
        assert md is not None, "PagedAttention.prepare() was not called"
        k_slots = self.kv_cache.k_slots[layer_idx]
        v_slots = self.kv_cache.v_slots[layer_idx]
        if self._cache_kernel is not None:
            self._cache_kernel(
                k, v, self.kv_cache.k_caches[layer_idx], self.kv_cache.v_caches[layer_idx], md.slot_mapping
            )
        else:
            k_slots.index_copy_(0, md.slot_mapping, k)
            v_slots.index_copy_(0, md.slot_mapping, v)
        num_d = md.num_decode_tokens
        if not md.prefills:
            return self._decode(layer_idx, q, md)
        out = torch.empty_like(q)
        if num_d:
            out[:num_d] = self._decode(layer_idx, q[:num_d], md)
        for span in md.prefills:
            out[span.token_start : span.token_end] = self._prefill(
                k_slots, v_slots, q[span.token_start : span.token_end],
                k[span.token_start : span.token_end], v[span.token_start : span.token_end], span,
            )
        return out

    def _decode(self, layer_idx: int, q: Tensor, md: AttentionMetadata) -> Tensor:
        num_d = q.shape[0]
        if self._decode_kernel is not None:
            return self._decode_kernel(
                q.contiguous(), self.kv_cache.k_caches[layer_idx], self.kv_cache.v_caches[layer_idx],
                md.block_tables, md.context_lens, self.scale,
            )
        assert md.decode_slots is not None and md.decode_mask is not None
        num_d = md.num_decodes
        # Gather each context's keys: (D*S, n_kv, hd) -> (D, n_kv, S, hd). index_select on the
        # flat slot list is several times faster on CPU than advanced indexing.
        shape = (num_d, md.decode_mask.shape[-1], self.num_kv_heads, self.head_dim)
        keys = self.kv_cache.k_slots[layer_idx].index_select(0, md.decode_slots).view(shape).transpose(1, 2)
        values = self.kv_cache.v_slots[layer_idx].index_select(0, md.decode_slots).view(shape).transpose(1, 2)
        if md.decode_query_rows is not None:
            assert md.decode_real_rows is not None and self._multi_mask is not None
            nq, g, hd, nkv = md.decode_max_queries, self.group, self.head_dim, self.num_kv_heads
            # Padded queries (D, Q, n_kv, G, hd) -> (D, n_kv, Q * G, hd): one masked call.
            q_ = q.index_select(0, md.decode_query_rows).view(num_d, nq, nkv, g, hd)
            q_ = q_.permute(0, 2, 1, 3, 4).reshape(num_d, nkv, nq * g, hd)
            out = F.scaled_dot_product_attention(q_, keys, values, attn_mask=self._multi_mask, scale=self.scale)
            out = out.view(num_d, nkv, nq, g, hd).permute(0, 2, 1, 3, 4).reshape(num_d * nq, self.num_heads, hd)
            return out.index_select(0, md.decode_real_rows)
        # The G query heads sharing a kv head act as G query rows: (D, n_kv, G, hd).
        q_ = q.reshape(num_d, self.num_kv_heads, self.group, self.head_dim)
        out = F.scaled_dot_product_attention(q_, keys, values, attn_mask=md.decode_mask, scale=self.scale)
        return out.reshape(num_d, self.num_heads, self.head_dim)

    def _prefill(
        self, k_slots: Tensor, v_slots: Tensor, q: Tensor, k: Tensor, v: Tensor, span: PrefillSpan
    ) -> Tensor:
        # 4-D inputs: torch's CPU flash-attention kernel only takes batched tensors (3-D ones
        # fall back to the math path, 3-4x slower on a 512-token prefill).
        q_ = q.transpose(0, 1).unsqueeze(0)  # (1, n_heads, Tq, hd)
        if span.context_slots is None:
            keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
        else:
            keys = k_slots.index_select(0, span.context_slots).transpose(0, 1)  # (n_kv, S, hd)
            values = v_slots.index_select(0, span.context_slots).transpose(0, 1)
            mask, causal = span.mask, False
        out = F.scaled_dot_product_attention(
            q_, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, is_causal=causal,
            scale=self.scale, enable_gqa=True,
        )  # (1, n_heads, Tq, hd)
        return out[0].transpose(0, 1)

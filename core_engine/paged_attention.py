"""PagedAttention: the serving engine's :class:`~core_engine.attention.AttentionContext`.

The K/V of every sequence live in one preallocated pool of fixed-size blocks
(:class:`KVCache`); a sequence's block table says which blocks hold its tokens. Layout (the
contract with ``core_engine/kernels``, also in :mod:`core_engine.kv_cache_manager`):

* ``k_caches[l]``, ``v_caches[l]``: ``(num_blocks, block_size, n_kv_heads, head_dim)`` per layer,
  contiguous, views into one allocation;
* token ``j`` of a sequence is at ``slot = block_table[j // block_size] * block_size +
  j % block_size`` of ``k_caches[l].view(-1, n_kv_heads, head_dim)``;
* decode batches pass ``block_tables`` ``(num_seqs, max_blocks)`` int32 and ``context_lens``
  ``(num_seqs,)`` int32 (attention length including the new token);
* quantized pools (``kv_cache_dtype`` int8 / fp8, :mod:`core_engine.kv_quant`) store codes in
  those views and one float32 scale per (layer, K/V, block, kv head) in ``KVCache.scales``;
  ``k_scale``/``v_scale`` of layer ``l`` are ``scales[l, 0]``/``scales[l, 1]``, ``(num_blocks,
  n_kv_heads)``.

One step's tokens are laid out decodes first, then prefill chunks. A decode is one new token,
or (speculative decoding) the last sampled token plus the proposed ones: a *multi-token
decode* of ``q`` queries, query ``i`` at position ``p + i`` seeing keys ``0..p + i``. On the
torch path all decodes of a step, single- and multi-token, are one batched attention call
(queries padded to the longest, masked). Per layer,
:meth:`PagedAttention.forward` first writes the step's new K/V into their slots (so a prefix
block cached by another request this same step is already filled when read), then attends:
decodes in one batched call, each prefill chunk causally over its cached prefix plus itself.
On CUDA the decode uses the Triton paged-decode kernel of ``core_engine.kernels`` when present;
on the CPU a step whose decodes are all single-token uses the C++ one of
:mod:`core_engine.kernels.cpu.paged_decode` (float32, bfloat16 and int8 pools; it reads K/V
in place through the block tables, where the torch path gathers them, reshapes them and makes
a masked attention call: SmolLM2-135M, batch 1, 128 tokens, 0.02 instead of 0.08-0.18 ms a
layer, 1-2 threads); ``INFERMUX_KERNELS=torch`` turns it off. A quantized pool is dequantized
where it is read: after the gather on the torch path (decodes and prefill chunks with a cached
prefix; a chunk without one attends over its fresh k/v), in the inner loops of the decode
kernels.

Layers with a :class:`~core_engine.attention.LayerAttention` spec (Gemma, Mistral) take the
same paths with their scale, sliding window and soft-cap: the C++ decode kernel takes all
three; the Triton one only a scale, so a windowed or soft-capped layer decodes on the torch
path, whose gather (``decode_slots``/``decode_mask``, left out of a kernel's metadata) the
context then builds from the block tables, once a step. Masks that depend on a window are
built on a layer's first use and reused by every layer with that window in the step; scores
are soft-capped by an explicit fp32 attention (:func:`~core_engine.attention.softcapped_attention`),
as ``scaled_dot_product_attention`` cannot cap them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from core_engine.attention import DEFAULT, LayerAttention, causal_mask, softcapped_attention
from core_engine.kv_quant import (
    KVWritePlan,
    dequantize,
    kv_quant_spec,
    plan_kv_write,
    resolve_kv_cache_dtype,
    write_quantized,
)

__all__ = ["AttentionMetadata", "KVCache", "PagedAttention", "PrefillSpan"]

logger = logging.getLogger(__name__)


class KVCache:
    """The preallocated K/V pool of all layers (see the module docstring for the layout).

    ``dtype`` is the model's compute dtype; ``cache_dtype`` (a ``kv_cache_dtype`` name, see
    :mod:`core_engine.kv_quant`) how the values are stored. Quantized pools keep int8 (or fp8
    bytes as uint8) in ``storage`` and a float32 ``scales`` tensor
    ``(num_layers, 2, num_blocks, n_kv_heads)``: one scale per layer, K/V, block and kv head.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        cache_dtype: str = "auto",
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.quant = resolve_kv_cache_dtype(cache_dtype, dtype, device)
        # (layers, 2, num_blocks, block_size, n_kv_heads, head_dim): one allocation for all.
        self.storage = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
            dtype=self.quant.storage_dtype, device=device,
        )
        # (layers, 2, num_blocks, n_kv_heads) float32; None when values are stored unscaled.
        self.scales: Tensor | None = None
        if self.quant.is_quantized:
            self.scales = torch.zeros((num_layers, 2, num_blocks, num_kv_heads), dtype=torch.float32, device=device)
        self.k_caches = [self.storage[i, 0] for i in range(num_layers)]
        self.v_caches = [self.storage[i, 1] for i in range(num_layers)]
        # Flat slot views, (num_blocks * block_size, n_kv_heads, head_dim).
        self.k_slots = [c.view(-1, num_kv_heads, head_dim) for c in self.k_caches]
        self.v_slots = [c.view(-1, num_kv_heads, head_dim) for c in self.v_caches]

    @staticmethod
    def bytes_per_block(
        *,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        cache_dtype: str = "auto",
    ) -> int:
        """Bytes one block costs across all layers (K and V, and their scales if quantized)."""
        spec = kv_quant_spec(cache_dtype, dtype)
        per_head = block_size * head_dim * spec.storage_dtype.itemsize
        if spec.is_quantized:
            per_head += torch.float32.itemsize  # its scale
        return 2 * num_layers * num_kv_heads * per_head

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's data and scales (all layers, K and V)."""
        return self.bytes_per_block(
            num_layers=self.num_layers, block_size=self.block_size, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, dtype=self.dtype, cache_dtype=self.quant.name,
        )

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.storage.numel() * self.storage.element_size() + scales

    def gather_blocks(self, block_ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """Copies of the blocks ``block_ids`` (n,): their data ``(num_layers, 2, n, block_size,
        n_kv_heads, head_dim)`` in the storage dtype (fp8 as its bytes) and their scales
        ``(num_layers, 2, n, n_kv_heads)`` (None when unquantized), on the pool's device."""
        ids = block_ids.to(device=self.storage.device, dtype=torch.long)
        data = self.storage.index_select(2, ids)
        scales = None if self.scales is None else self.scales.index_select(2, ids)
        return data, scales

    def scatter_blocks(self, block_ids: Tensor, data: Tensor, scales: Tensor | None) -> None:
        """Write blocks back (the inverse of :meth:`gather_blocks`; any device)."""
        ids = block_ids.to(device=self.storage.device, dtype=torch.long)
        n = ids.shape[0]
        expected = (self.num_layers, 2, n, self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(data.shape) != expected or data.dtype != self.storage.dtype:
            raise ValueError(
                f"data must be {expected} {self.storage.dtype}, got {tuple(data.shape)} {data.dtype}"
            )
        if (scales is None) != (self.scales is None):
            raise ValueError("scales must be given exactly when the cache is quantized")
        if scales is not None and tuple(scales.shape) != (self.num_layers, 2, n, self.num_kv_heads):
            raise ValueError(
                f"scales must be {(self.num_layers, 2, n, self.num_kv_heads)}, got {tuple(scales.shape)}"
            )
        self.storage.index_copy_(2, ids, data.to(self.storage.device))
        if self.scales is not None and scales is not None:
            self.scales.index_copy_(2, ids, scales.to(device=self.scales.device, dtype=torch.float32))


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
    #: Torch decode path: (D * S,) slots of each decode's context, padded, and (D, 1, 1, S) mask
    #: ((D, Q, S) per query when a decode has several tokens); None for the kernels.
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
    #: Multi-token decodes only: ``(D, Q)`` int64 position of each padded query (padding at
    #: its decode's last position), for the masks of sliding-window layers.
    decode_query_positions: Tensor | None = None


def _decode_context_slots(block_tables: Tensor, context_lens: Tensor, block_size: int) -> Tensor:
    """(D * S,) slots of each decode's first ``S = max(context_lens)`` context tokens (the
    torch path's gather; slots past a context's end are padding, masked out)."""
    max_len = int(context_lens.max())
    offsets = torch.arange(block_size, device=block_tables.device)
    # (D, max_blocks * block_size) -> the first max_len slots of each context.
    return (block_tables.long().unsqueeze(2) * block_size + offsets).flatten(1)[:, :max_len].reshape(-1)


def _single_decode_mask(context_lens: Tensor, num_keys: int) -> Tensor:
    """(D, 1, 1, num_keys) bool: each single-token decode sees its whole context."""
    keys = torch.arange(num_keys, device=context_lens.device)
    return (keys.unsqueeze(0) < context_lens.unsqueeze(1)).view(-1, 1, 1, num_keys)


def build_attention_metadata(
    *,
    block_size: int,
    decodes: Sequence[tuple[int, Sequence[int]] | tuple[int, Sequence[int], int]],
    prefills: Sequence[tuple[int, int, Sequence[int]]],
    device: torch.device,
    use_kernel: bool,
    decode_gather: bool = True,
) -> AttentionMetadata:
    """Build the metadata of one step.

    ``decodes``: ``(position, block_ids)`` per decode sequence (one new token at ``position``),
    or ``(position, block_ids, num_tokens)`` for a multi-token decode (tokens at ``position``
    .. ``position + num_tokens - 1``; torch path only: the Triton decode kernel takes one).
    ``prefills``: ``(num_computed_tokens, num_new_tokens, block_ids)`` per prefill chunk.
    ``decode_gather=False`` leaves out the torch path's ``decode_slots`` and ``decode_mask``
    when every decode has one token, for the C++ CPU kernel that reads the block tables (they
    cost ~0.13 ms a step to build, ``use_kernel`` leaves them out always).
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
    query_rows = real_rows = query_positions = None
    if decodes:
        max_blocks = max(len(d[1]) for d in decodes)
        block_tables = torch.tensor(
            [list(d[1]) + [0] * (max_blocks - len(d[1])) for d in decodes], dtype=torch.int32, device=device
        )  # (D, max_blocks)
        context_lens = torch.tensor(
            [d[0] + n for d, n in zip(decodes, lens, strict=True)], dtype=torch.int32, device=device
        )
        if not use_kernel and (decode_gather or max_q > 1):
            decode_slots = _decode_context_slots(block_tables, context_lens, block_size)  # (D * max_len,)
            max_len = decode_slots.shape[0] // len(decodes)
            if max_q == 1:
                decode_mask = _single_decode_mask(context_lens, max_len)
            else:
                keys = torch.arange(max_len, device=device)
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
                query_positions = torch.minimum(q_pos, context_lens.long().unsqueeze(1) - 1)
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
        decode_query_positions=query_positions,
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


def _load_cpu_decode(kv_cache: KVCache) -> Callable[..., Tensor] | None:
    """The C++ decode attention for a CPU pool, or None (the torch path): fp8 or float16
    pools, ``INFERMUX_KERNELS=torch``, or no working C++ compiler (warned)."""
    from core_engine.kernels.cpu import KernelBuildError
    from core_engine.kernels.cpu.paged_decode import paged_decode_kernel, supports_paged_decode
    from core_engine.kernels.dispatch import torch_forced

    if torch_forced() or not supports_paged_decode(kv_cache.storage.dtype, kv_cache.dtype):
        return None
    try:
        return paged_decode_kernel()
    except KernelBuildError as exc:
        logger.warning("the C++ decode attention did not build, decodes use torch's: %s", exc)
        return None


class PagedAttention:
    """:class:`~core_engine.attention.AttentionContext` over a :class:`KVCache`.

    Call :meth:`prepare` with the step's :class:`AttentionMetadata` before the model forward.
    ``use_kernels``: None picks the Triton kernels on CUDA and torch elsewhere; True forces the
    kernels (on CPU under the Triton interpreter, for tests). Without them, a CPU pool's
    single-token decodes run the C++ decode attention when it takes the pool's dtype (see the
    module docstring). A quantized cache is written by
    :func:`~core_engine.kv_quant.write_quantized` on every device and dequantized where it is
    read (in the decode kernel, or right after the gather on the torch path).
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
        # The torch decode path's gather of this step: the metadata's, or built from the block
        # tables when a layer the kernel cannot run needs it (:meth:`_decode_gather`).
        self._decode_slots: Tensor | None = None
        self._decode_mask: Tensor | None = None
        # Sliding-window masks of this step, built on first use: decodes' by window, (D, 1, 1,
        # S) or (D, 1, Q * G, S); prefill chunks' by (chunk index, window), (chunk, S).
        self._decode_window_masks: dict[int, Tensor] = {}
        self._span_masks: dict[tuple[int, int | None], Tensor] = {}
        # Quantized caches, per step: the write plan, and the block of each slot read.
        self._write_plan: KVWritePlan | None = None
        self._decode_slot_blocks: Tensor | None = None
        self._prefill_slot_blocks: list[Tensor | None] = []
        device = kv_cache.storage.device
        kernels = _load_kernels(device, use_kernels)
        self._decode_kernel: Callable[..., Tensor] | None = None
        self._cache_kernel: Callable[..., None] | None = None
        if kernels is not None:
            self._decode_kernel, self._cache_kernel = kernels
        # C++ decode attention of CPU pools (same signature as the Triton kernel).
        self._cpu_decode: Callable[..., Tensor] | None = None
        if device.type == "cpu" and self._decode_kernel is None:
            self._cpu_decode = _load_cpu_decode(kv_cache)

    @property
    def uses_kernel(self) -> bool:
        return self._decode_kernel is not None

    @property
    def uses_cpu_kernel(self) -> bool:
        """Whether single-token decodes run the C++ decode attention (CPU pools)."""
        return self._cpu_decode is not None

    def prepare(self, metadata: AttentionMetadata) -> None:
        self.metadata = metadata
        self._multi_mask = None
        self._decode_slots, self._decode_mask = metadata.decode_slots, metadata.decode_mask
        self._decode_window_masks = {}
        self._span_masks = {}
        if metadata.decode_query_rows is not None and metadata.decode_mask is not None:
            self._multi_mask = self._per_query_head(metadata.decode_mask)
        if self.kv_cache.quant.is_quantized:
            bs = self.kv_cache.block_size
            self._write_plan = plan_kv_write(metadata.slot_mapping, bs)
            slots = metadata.decode_slots
            self._decode_slot_blocks = None if slots is None else slots // bs
            self._prefill_slot_blocks = [
                None if span.context_slots is None else span.context_slots // bs for span in metadata.prefills
            ]

    def _per_query_head(self, mask: Tensor) -> Tensor:
        """(D, Q, S) -> (D, 1, Q * G, S): the G query heads of a kv head are G rows per query."""
        d, q, s = mask.shape
        return mask.unsqueeze(2).expand(d, q, self.group, s).reshape(d, 1, q * self.group, s)

    def forward(
        self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, spec: LayerAttention | None = None
    ) -> Tensor:
        """q: (T, n_heads, hd); k, v: (T, n_kv_heads, hd). Returns (T, n_heads, hd).

        ``spec``: the layer's scale, sliding window and soft-cap (None: Llama's attention).
        """
        spec = spec or DEFAULT
        md = self.metadata
        assert md is not None, "PagedAttention.prepare() was not called"
        cache = self.kv_cache
        if cache.scales is not None:
            assert self._write_plan is not None
            write_quantized(cache.storage[layer_idx], cache.scales[layer_idx], k, v, self._write_plan, cache.quant)
        elif self._cache_kernel is not None:
            self._cache_kernel(k, v, cache.k_caches[layer_idx], cache.v_caches[layer_idx], md.slot_mapping)
        else:
            dtype = cache.storage.dtype
            cache.k_slots[layer_idx].index_copy_(0, md.slot_mapping, k.to(dtype))
            cache.v_slots[layer_idx].index_copy_(0, md.slot_mapping, v.to(dtype))
        num_d = md.num_decode_tokens
        if not md.prefills:
            return self._decode(layer_idx, q, md, spec)
        out = torch.empty_like(q)
        if num_d:
            out[:num_d] = self._decode(layer_idx, q[:num_d], md, spec)
        for i, span in enumerate(md.prefills):
            out[span.token_start : span.token_end] = self._prefill(
                layer_idx, i, q[span.token_start : span.token_end],
                k[span.token_start : span.token_end], v[span.token_start : span.token_end], span, spec,
            )
        return out

    def _read(self, layer_idx: int, slots: Tensor, slot_blocks: Tensor | None) -> tuple[Tensor, Tensor]:
        """Keys and values at ``slots`` (N,), (N, n_kv, hd) each in the compute dtype.
        ``slot_blocks``: the block of each slot (quantized caches: where their scales are)."""
        cache = self.kv_cache
        # index_select on the flat slot list is several times faster on CPU than advanced indexing.
        keys = cache.k_slots[layer_idx].index_select(0, slots)
        values = cache.v_slots[layer_idx].index_select(0, slots)
        if cache.scales is not None:
            assert slot_blocks is not None
            scales = cache.scales[layer_idx].index_select(1, slot_blocks)  # (2, N, n_kv)
            keys = dequantize(keys, scales[0], cache.quant, cache.dtype)
            values = dequantize(values, scales[1], cache.quant, cache.dtype)
        elif keys.dtype != cache.dtype:
            keys, values = keys.to(cache.dtype), values.to(cache.dtype)
        return keys, values

    def _decode_gather(self) -> tuple[Tensor, Tensor]:
        """The torch decode path's ``(D * S,)`` context slots and ``(D, 1, 1, S)`` mask (or
        ``(D, Q, S)``). Metadata built for a decode kernel leaves them out; a layer the kernel
        cannot run (Triton, with a window or soft-cap) builds them here, once a step."""
        if self._decode_slots is None or self._decode_mask is None:
            md = self.metadata
            assert md is not None and md.block_tables is not None and md.context_lens is not None
            # Without the gather every decode has one token (build_attention_metadata).
            self._decode_slots = _decode_context_slots(md.block_tables, md.context_lens, self.kv_cache.block_size)
            self._decode_mask = _single_decode_mask(md.context_lens, self._decode_slots.shape[0] // md.num_decodes)
            if self.kv_cache.quant.is_quantized:
                self._decode_slot_blocks = self._decode_slots // self.kv_cache.block_size
        return self._decode_slots, self._decode_mask

    def _decode_window_mask(self, md: AttentionMetadata, window: int, num_keys: int) -> Tensor:
        """The decodes' mask with a sliding window: (D, 1, 1, S), or (D, 1, Q * G, S) with
        multi-token decodes; built once a step per window."""
        mask = self._decode_window_masks.get(window)
        if mask is None:
            if md.decode_query_positions is not None:
                mask = self._per_query_head(causal_mask(md.decode_query_positions, num_keys, window))
            else:
                assert md.context_lens is not None
                positions = md.context_lens.long().unsqueeze(1) - 1  # (D, 1): the new token's
                mask = causal_mask(positions, num_keys, window).unsqueeze(1)  # (D, 1, 1, S)
            self._decode_window_masks[window] = mask
        return mask

    def _decode(self, layer_idx: int, q: Tensor, md: AttentionMetadata, spec: LayerAttention) -> Tensor:
        cache = self.kv_cache
        scale = self.scale if spec.scale is None else spec.scale
        # The Triton kernel takes a scale but no window or soft-cap: those layers run torch's.
        triton_decode = self._decode_kernel if spec.window is None and spec.softcap is None else None
        # The C++ kernel takes one query per decode; a compiled forward traces the torch path.
        cpu_decode = (
            self._cpu_decode
            if md.decode_query_rows is None and not torch.compiler.is_compiling()
            else None
        )
        if triton_decode is not None or cpu_decode is not None:
            k_cache, v_cache = cache.k_caches[layer_idx], cache.v_caches[layer_idx]
            k_scale = v_scale = None
            if cache.scales is not None:
                k_cache, v_cache = k_cache.view(cache.quant.code_dtype), v_cache.view(cache.quant.code_dtype)
                k_scale, v_scale = cache.scales[layer_idx, 0], cache.scales[layer_idx, 1]
            if triton_decode is not None:
                return triton_decode(
                    q.contiguous(), k_cache, v_cache, md.block_tables, md.context_lens, scale,
                    k_scale=k_scale, v_scale=v_scale,
                )
            assert cpu_decode is not None  # q's rows may be strided: the kernel reads them in place
            return cpu_decode(
                q, k_cache, v_cache, md.block_tables, md.context_lens, scale, k_scale, v_scale,
                window=spec.window or 0, softcap=spec.softcap or 0.0,
            )
        decode_slots, decode_mask = self._decode_gather()
        num_d = md.num_decodes
        num_keys = decode_mask.shape[-1]
        # Each context's keys: (D*S, n_kv, hd) -> (D, n_kv, S, hd).
        shape = (num_d, num_keys, self.num_kv_heads, self.head_dim)
        keys, values = self._read(layer_idx, decode_slots, self._decode_slot_blocks)
        keys, values = keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)
        if md.decode_query_rows is not None:
            assert md.decode_real_rows is not None and self._multi_mask is not None
            nq, g, hd, nkv = md.decode_max_queries, self.group, self.head_dim, self.num_kv_heads
            # Padded queries (D, Q, n_kv, G, hd) -> (D, n_kv, Q * G, hd): one masked call.
            q_ = q.index_select(0, md.decode_query_rows).view(num_d, nq, nkv, g, hd)
            q_ = q_.permute(0, 2, 1, 3, 4).reshape(num_d, nkv, nq * g, hd)
            mask = self._multi_mask if spec.window is None else self._decode_window_mask(md, spec.window, num_keys)
            out = _attend(q_, keys, values, mask, scale, spec.softcap)
            out = out.view(num_d, nkv, nq, g, hd).permute(0, 2, 1, 3, 4).reshape(num_d * nq, self.num_heads, hd)
            return out.index_select(0, md.decode_real_rows)
        # The G query heads sharing a kv head act as G query rows: (D, n_kv, G, hd).
        q_ = q.reshape(num_d, self.num_kv_heads, self.group, self.head_dim)
        mask = decode_mask if spec.window is None else self._decode_window_mask(md, spec.window, num_keys)
        out = _attend(q_, keys, values, mask, scale, spec.softcap)
        return out.reshape(num_d, self.num_heads, self.head_dim)

    def _span_mask(self, span_idx: int, span: PrefillSpan, window: int | None) -> Tensor:
        """(chunk, S) bool mask of prefill chunk ``span_idx`` over its prefix and itself, with
        an optional sliding window; built once a step per (chunk, window)."""
        mask = self._span_masks.get((span_idx, window))
        if mask is None:
            num_new = span.token_end - span.token_start
            positions = torch.arange(num_new, device=self.kv_cache.storage.device) + span.num_computed_tokens
            mask = causal_mask(positions, span.num_computed_tokens + num_new, window)
            self._span_masks[(span_idx, window)] = mask
        return mask

    def _prefill(
        self, layer_idx: int, span_idx: int, q: Tensor, k: Tensor, v: Tensor, span: PrefillSpan,
        spec: LayerAttention,
    ) -> Tensor:
        # 4-D inputs: torch's CPU flash-attention kernel only takes batched tensors (3-D ones
        # fall back to the math path, 3-4x slower on a 512-token prefill).
        q_ = q.transpose(0, 1).unsqueeze(0)  # (1, n_heads, Tq, hd)
        if span.context_slots is None:
            # No cached prefix: the chunk's own fresh k/v (not their quantized copies).
            keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
        else:
            slot_blocks = self._prefill_slot_blocks[span_idx] if self.kv_cache.scales is not None else None
            keys, values = self._read(layer_idx, span.context_slots, slot_blocks)
            keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # (n_kv, S, hd)
            mask, causal = span.mask, False
        if spec.window is not None or (spec.softcap is not None and mask is None):
            # A window needs its own mask; the soft-capped attention takes a mask, not is_causal.
            mask, causal = self._span_mask(span_idx, span, spec.window), False
        scale = self.scale if spec.scale is None else spec.scale
        k_, v_ = keys.unsqueeze(0), values.unsqueeze(0)  # (1, n_kv, S, hd)
        if spec.softcap is not None:
            out = softcapped_attention(q_, k_, v_, mask, scale=scale, softcap=spec.softcap)
        else:
            out = F.scaled_dot_product_attention(
                q_, k_, v_, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )  # (1, n_heads, Tq, hd)
        return out[0].transpose(0, 1)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float | None) -> Tensor:
    """The decodes' attention call: q (D, n_kv, R, hd) over k, v (D, n_kv, S, hd) with a bool
    mask broadcastable to (D, n_kv, R, S); soft-capped scores take the explicit path."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return softcapped_attention(q, k, v, mask, scale=scale, softcap=softcap)

"""The attention seam between the model and whatever holds the KV cache.

:class:`~core_engine.model.llama.LlamaModel` computes q/k/v for the tokens of one step and calls
an :class:`AttentionContext` once per layer; the context stores the new k/v wherever it keeps
its cache (contiguous tensors here, a paged block pool in the serving engine) and returns the
attention output. The model knows nothing about sequences, blocks or batching.

Contract (keep it stable; changes are announced here):

- ``q``: ``(T, n_heads, head_dim)``; ``k``, ``v``: ``(T, n_kv_heads, head_dim)``. ``T`` is the
  number of tokens in this forward (all scheduled tokens of all sequences, flattened, in the
  order of ``input_ids``). They are in the model's compute dtype.
- RoPE has already been applied to q and k (rotate-half / NeoX layout: the loader un-permutes
  llama.cpp's interleaved q/k rows, so dims ``i`` and ``i + head_dim/2`` form a rotation pair).
- q, k and v may be non-contiguous views into one fused projection output: copy k/v into the
  cache (``index_copy_``/slice assignment work on views); do not ``.view`` them.
- ``spec`` (a :class:`LayerAttention`, or None for the defaults) says how this layer attends
  where an architecture differs from Llama: Gemma's and Mistral's layers pass one, Llama's None.
  None and ``LayerAttention()`` must give today's numerics (and None today's speed).
- Softmax scale is ``spec.scale``, by default ``head_dim ** -0.5``; with ``spec.softcap`` the
  scaled scores ``s`` become ``softcap * tanh(s / softcap)`` before the mask and the softmax
  (Gemma 2). GQA: query head ``h`` reads kv head ``h // (n_heads // n_kv_heads)``.
- Causal: a token at position ``p`` attends to the keys of positions ``0..p`` of its own
  sequence (previous steps' keys come from the cache, this step's from ``k``); with
  ``spec.window`` only to those of ``p - window + 1 .. p`` (``p - j < window``: Hugging Face's
  and llama.cpp's standard sliding window).
- Return ``(T, n_heads, head_dim)`` in the compute dtype (contiguous or not; the model reshapes).
- ``forward`` is called for ``layer_idx = 0 .. n_layers-1`` in order, once each, per model
  forward; a context may do per-step preparation (slot mapping, masks) before the model call
  and reuse it across layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DEFAULT",
    "AttentionContext",
    "ContiguousAttention",
    "LayerAttention",
    "PackedAttention",
    "causal_mask",
    "softcapped_attention",
]


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How one layer attends, where an architecture differs from Llama's (the defaults)."""

    scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    window: int | None = None  # sliding window (keys p-window+1..p); None: the whole context
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the softmax

    def __post_init__(self) -> None:
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"scale must be > 0 or None, got {self.scale}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 or None, got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")


#: Llama's attention: scale ``head_dim ** -0.5``, the whole causal context, no soft-capping.
DEFAULT = LayerAttention()


def causal_mask(query_positions: Tensor, num_keys: int, window: int | None = None) -> Tensor:
    """Which keys each query sees: ``(..., T)`` int positions -> ``(..., T, num_keys)`` bool.

    Key ``j`` is visible to a query at position ``p`` when ``j <= p`` and, with a ``window``,
    ``p - j < window``.
    """
    keys = torch.arange(num_keys, device=query_positions.device)
    pos = query_positions.unsqueeze(-1)  # (..., T, 1)
    mask = keys <= pos
    if window is not None:
        mask &= keys > pos - window
    return mask


def softcapped_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float, softcap: float
) -> Tensor:
    """Attention with soft-capped scores, which ``scaled_dot_product_attention`` cannot do.

    q: ``(B, n_heads, T, hd)``; k, v: ``(B, n_kv_heads, S, hd)`` (GQA: ``n_heads`` a multiple
    of ``n_kv_heads``); mask: bool broadcastable to ``(B, n_heads, T, S)``, True where a query
    sees a key, or None. Scores ``q.k * scale`` are capped to ``softcap * tanh(s / softcap)``,
    masked and softmaxed in fp32. Returns ``(B, n_heads, T, hd)`` in q's dtype.
    """
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, n_heads, T, S)
    scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)


@runtime_checkable
class AttentionContext(Protocol):
    """Per-forward attention: the model calls it once per layer with this step's new q/k/v."""

    def forward(
        self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, spec: LayerAttention | None = None
    ) -> Tensor:
        """Store ``k``/``v`` for ``layer_idx`` and return causal attention of ``q`` over the cache.

        q: (T, n_heads, head_dim); k, v: (T, n_kv_heads, head_dim), RoPE applied. ``spec``:
        this layer's scale, window and soft-cap (None: the defaults). Returns (T, n_heads,
        head_dim).
        """
        ...


class ContiguousAttention:
    """Reference attention for ONE sequence: KV kept in growing per-layer tensors, causal.

    Each forward appends its T tokens after the ones already cached (positions are implied:
    the cache length before the call is the position of the first new token). Used by the
    oracle tests and simple greedy loops; the serving engine uses a paged context instead.

    >>> attn = ContiguousAttention(num_layers=2)        # doctest: +SKIP
    >>> logits = model(ids, torch.arange(len(ids)), attn)  # prefill, then decode one by one
    """

    def __init__(self, num_layers: int, *, initial_capacity: int = 256) -> None:
        self.num_layers = num_layers
        self._initial_capacity = initial_capacity
        self._k: list[Tensor | None] = [None] * num_layers  # (capacity, n_kv_heads, head_dim)
        self._v: list[Tensor | None] = [None] * num_layers
        self._lengths = [0] * num_layers

    @property
    def num_tokens(self) -> int:
        """Tokens cached by the last layer (= tokens of all completed forwards)."""
        return self._lengths[-1]

    def reset(self) -> None:
        """Forget the cache (start a new sequence)."""
        self._k = [None] * self.num_layers
        self._v = [None] * self.num_layers
        self._lengths = [0] * self.num_layers

    def truncate(self, num_tokens: int) -> None:
        """Drop cached tokens past ``num_tokens`` (e.g. to re-run from an earlier point)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"num_tokens must be in [0, {self.num_tokens}], got {num_tokens}")
        self._lengths = [num_tokens] * self.num_layers

    def _append(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        start = self._lengths[layer_idx]
        end = start + k.shape[0]
        cache_k, cache_v = self._k[layer_idx], self._v[layer_idx]
        if cache_k is None or cache_v is None or end > cache_k.shape[0]:
            # Grow geometrically so a decode loop reallocates O(log n) times, not per token.
            capacity = max(self._initial_capacity, end, 2 * (0 if cache_k is None else cache_k.shape[0]))
            new_k = k.new_empty((capacity, *k.shape[1:]))
            new_v = v.new_empty((capacity, *v.shape[1:]))
            if cache_k is not None and cache_v is not None and start:
                new_k[:start] = cache_k[:start]
                new_v[:start] = cache_v[:start]
            self._k[layer_idx], self._v[layer_idx] = cache_k, cache_v = new_k, new_v
        cache_k[start:end] = k
        cache_v[start:end] = v
        self._lengths[layer_idx] = end
        return cache_k[:end], cache_v[:end]  # (S, n_kv_heads, head_dim)

    def forward(
        self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, spec: LayerAttention | None = None
    ) -> Tensor:
        """See :class:`AttentionContext`; all T tokens belong to the one cached sequence."""
        spec = spec or DEFAULT
        num_new = q.shape[0]
        keys, values = self._append(layer_idx, k, v)
        num_total = keys.shape[0]
        q_ = q.transpose(0, 1).unsqueeze(0)  # (1, n_heads, T, head_dim)
        k_ = keys.transpose(0, 1).unsqueeze(0)  # (1, n_kv_heads, S, head_dim)
        v_ = values.transpose(0, 1).unsqueeze(0)
        if num_new == 1 and spec.window is None:
            mask = None  # the single new token sees everything cached
        else:
            # Query i sits at position (S - T + i) and sees keys 0..S-T+i (bottom-right causal).
            positions = torch.arange(num_new, device=q.device) + (num_total - num_new)
            mask = causal_mask(positions, num_total, spec.window)  # (T, S)
        if spec.softcap is not None:
            scale = q.shape[-1] ** -0.5 if spec.scale is None else spec.scale
            out = softcapped_attention(q_, k_, v_, mask, scale=scale, softcap=spec.softcap)
        else:
            out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=spec.scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)  # (T, n_heads, head_dim)


class PackedAttention:
    """Causal attention over several whole sequences packed into one forward, keeping no KV.

    The sequences' tokens lie one after the other (``lengths`` of them each), every one from
    position 0: a token attends to the tokens at or before it in its own sequence only (a
    block-diagonal causal mask). Embeddings run their inputs through the model this way, in
    one forward, without taking blocks of the serving engine's paged cache.
    """

    def __init__(self, lengths: list[int], *, device: torch.device | str = "cpu") -> None:
        self.lengths = lengths
        seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)  # (T,)
        self.positions = torch.cat([torch.arange(n) for n in lengths]).to(device)  # (T,)
        self._same_sequence = seq.unsqueeze(1) == seq.unsqueeze(0)  # (T, T)
        self._masks: dict[int | None, Tensor] = {}

    def _mask(self, window: int | None) -> Tensor:
        mask = self._masks.get(window)
        if mask is None:
            behind = self.positions.unsqueeze(1) - self.positions.unsqueeze(0)  # (T, T): p_i - p_j
            mask = self._same_sequence & (behind >= 0)
            if window is not None:
                mask &= behind < window
            self._masks[window] = mask
        return mask

    def forward(
        self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, spec: LayerAttention | None = None
    ) -> Tensor:
        """See :class:`AttentionContext`; the T tokens are the packed sequences' tokens."""
        spec = spec or DEFAULT
        mask = self._mask(spec.window)  # (T, T)
        q_ = q.transpose(0, 1).unsqueeze(0)  # (1, n_heads, T, head_dim)
        k_ = k.transpose(0, 1).unsqueeze(0)  # (1, n_kv_heads, T, head_dim)
        v_ = v.transpose(0, 1).unsqueeze(0)
        if spec.softcap is not None:
            scale = q.shape[-1] ** -0.5 if spec.scale is None else spec.scale
            out = softcapped_attention(q_, k_, v_, mask, scale=scale, softcap=spec.softcap)
        else:
            out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=spec.scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)  # (T, n_heads, head_dim)

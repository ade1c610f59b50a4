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
- Softmax scale is ``head_dim ** -0.5``; GQA: query head ``h`` reads kv head
  ``h // (n_heads // n_kv_heads)``.
- Causal: a token at position ``p`` attends to the keys of positions ``0..p`` of its own
  sequence (previous steps' keys come from the cache, this step's from ``k``).
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

__all__ = ["AttentionContext", "ContiguousAttention", "LayerAttention"]


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How one layer attends, where an architecture differs from Llama's (the defaults)."""

    scale: float | None = None
    window: int | None = None
    softcap: float | None = None


@runtime_checkable
class AttentionContext(Protocol):
    """Per-forward attention: the model calls it once per layer with this step's new q/k/v."""

    def forward(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store ``k``/``v`` for ``layer_idx`` and return causal attention of ``q`` over the cache.

        q: (T, n_heads, head_dim); k, v: (T, n_kv_heads, head_dim), RoPE applied.
        Returns (T, n_heads, head_dim).
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

    def forward(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, spec: LayerAttention | None = None) -> Tensor:
        """See :class:`AttentionContext`; all T tokens belong to the one cached sequence."""
        num_new = q.shape[0]
        keys, values = self._append(layer_idx, k, v)
        num_total = keys.shape[0]
        if spec is not None and spec != LayerAttention():  # STUB: replaced by the attn-spec branch
            pos = torch.arange(num_new).unsqueeze(1) + (num_total - num_new)
            kpos = torch.arange(num_total).unsqueeze(0)
            ok = kpos <= pos
            if spec.window is not None:
                ok &= pos - kpos < spec.window
            g = q.shape[1] // k.shape[1]
            kk = keys.float().repeat_interleave(g, 1).transpose(0, 1)
            vv = values.float().repeat_interleave(g, 1).transpose(0, 1)
            s = q.float().transpose(0, 1) @ kk.transpose(1, 2) * (spec.scale or q.shape[-1] ** -0.5)
            if spec.softcap:
                s = spec.softcap * torch.tanh(s / spec.softcap)
            s = s.masked_fill(~ok, float("-inf")).softmax(-1)
            return (s @ vv).transpose(0, 1).to(q.dtype)
        q_ = q.transpose(0, 1).unsqueeze(0)  # (1, n_heads, T, head_dim)
        k_ = keys.transpose(0, 1).unsqueeze(0)  # (1, n_kv_heads, S, head_dim)
        v_ = values.transpose(0, 1).unsqueeze(0)
        if num_new == 1:
            mask = None  # the single new token sees everything cached
        else:
            # Query i sits at position (S - T + i) and sees keys 0..S-T+i (bottom-right causal).
            rows = torch.arange(num_new, device=q.device).unsqueeze(1) + (num_total - num_new)
            mask = torch.arange(num_total, device=q.device).unsqueeze(0) <= rows  # (T, S)
        out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)  # (T, n_heads, head_dim)

"""Gemma 2: the Llama-family decoder with Gemma's block (:class:`GemmaDecoderLayer`: an RMSNorm
after attention and after the FFN as well as before them, a GELU(tanh)-gated FFN), token
embeddings scaled by ``sqrt(hidden_size)``, every other layer (0, 2, ...) attending over a
sliding window, attention scores and final logits soft-capped (``cap * tanh(x / cap)``), the
attention scaled by ``query_pre_attn_scalar ** -0.5``, NeoX RoPE (rows in Hugging Face's order).

The per-layer attention (window, scale, cap) is :func:`core_engine.model.llama.layer_attention`
of the config; the embedding scale and the logit cap are applied by
:class:`~core_engine.model.llama.LlamaModel`. Hugging Face checkpoints store each norm weight as
an offset from 1; llama.cpp's converter adds the 1, so a GGUF holds the weights themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from core_engine.attention import AttentionContext
from core_engine.model.architecture import Architecture
from core_engine.model.config import LlamaConfig
from core_engine.model.llama import LlamaDecoderLayer, layer_weight
from core_engine.model.norm import rms_norm

__all__ = ["ARCHITECTURE", "GemmaDecoderLayer", "gemma_hf_hparams", "local_layers"]


class GemmaDecoderLayer(LlamaDecoderLayer):
    """``x += post_attn_norm(o(attn(rope(qkv(norm(x))))))``;
    ``x += post_ffn_norm(down(gelu_tanh(gate) * up))`` of ``ffn_norm(x)``."""

    #: The gate's activation (a test swaps in ggml's fp16-table GELU to compare with llama.cpp).
    activation: Callable[[Tensor], Tensor] = staticmethod(partial(F.gelu, approximate="tanh"))

    def __init__(self, config: LlamaConfig, *, dtype: torch.dtype, device: torch.device | str, qkv_bias: bool) -> None:
        super().__init__(config, dtype=dtype, device=device, qkv_bias=qkv_bias)
        self.post_attn_norm = layer_weight(config.hidden_size, dtype=dtype, device=device)
        self.post_ffn_norm = layer_weight(config.hidden_size, dtype=dtype, device=device)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext, layer_idx: int) -> Tensor:
        """x: (T, hidden) residual stream → (T, hidden); cos/sin: (T, 1, head_dim/2)."""
        h, hk = self.num_heads, self.num_heads + self.num_kv_heads
        qkv = self.qkv_heads(x, cos, sin)
        out = attn.forward(layer_idx, qkv[:, :h], qkv[:, h:hk], qkv[:, hk:], self.attention_spec)
        out = self.o(out.reshape(x.shape[0], self.q_size))  # (T, hidden)
        x = x + rms_norm(out, self.post_attn_norm, self.rms_eps)
        return self.feed_forward(x)

    def feed_forward(self, x: Tensor) -> Tensor:
        """``x + post_ffn_norm(down(gelu_tanh(gate) * up))`` of the normed ``x`` (T, hidden)."""
        gate, up = self.gate_up.normed(x, self.ffn_norm, self.rms_eps).chunk(2, dim=-1)  # (T, inter) each
        out = self.down(self.activation(gate) * up)  # (T, hidden)
        return x + rms_norm(out, self.post_ffn_norm, self.rms_eps)


def local_layers(pattern: int | Sequence[bool], num_layers: int) -> tuple[int, ...]:
    """The sliding-window layers of a pattern: ``n`` (every ``n``-th layer, 1-based, is
    global: 2 for Gemma 2, 6 for Gemma 3, as llama.cpp and transformers count), or one flag
    per layer (True: sliding), as ``{arch}.attention.sliding_window_pattern`` may store it."""
    if isinstance(pattern, int):
        return tuple(i for i in range(num_layers) if (i + 1) % pattern)
    return tuple(i for i, sliding in enumerate(pattern) if sliding)


def _gguf_attention_scale(hidden: int, heads: int, head_dim: int, *, num_layers: int, big_layers: int) -> float | None:
    """llama.cpp scales queries by ``head_dim ** -0.5`` except in the 27B models (told apart by
    their layer count), which take ``(hidden / heads) ** -0.5`` (their query_pre_attn_scalar)."""
    return (hidden / heads) ** -0.5 if num_layers == big_layers and hidden // heads != head_dim else None


def gemma_hf_hparams(cfg: Mapping[str, Any], config: LlamaConfig, *, default_pattern: int) -> dict[str, Any]:
    """What a Gemma ``config.json`` adds: the window and its layers (``layer_types``, else the
    pattern), the query scale, the soft-caps, the embedding scale."""
    types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern", default_pattern)
    window = cfg.get("sliding_window")
    local = (
        tuple(i for i, t in enumerate(types) if t == "sliding_attention") if types
        else local_layers(int(pattern), config.num_layers)
    )
    scalar = cfg.get("query_pre_attn_scalar")
    scale = None if scalar in (None, config.head_dim) else float(scalar) ** -0.5
    return {
        "sliding_window": int(window) if window else None,
        "local_layers": local if window else (),
        "attention_scale": scale,
        "attn_logit_softcap": cfg.get("attn_logit_softcapping"),
        "final_logit_softcap": cfg.get("final_logit_softcapping"),
        "embedding_scale": config.hidden_size**0.5,
    }


def _gguf_hparams(read: Callable[[str, Any], Any], config: LlamaConfig) -> dict[str, Any]:
    # llama.cpp's defaults where the converter wrote no key (Gemma 2's published values).
    return {
        "sliding_window": int(read("attention.sliding_window", 4096)),
        "local_layers": local_layers(read("attention.sliding_window_pattern", 2), config.num_layers),
        "attention_scale": _gguf_attention_scale(
            config.hidden_size, config.num_heads, config.head_dim, num_layers=config.num_layers, big_layers=46
        ),
        "attn_logit_softcap": float(read("attn_logit_softcapping", 50.0)),
        "final_logit_softcap": float(read("final_logit_softcapping", 30.0)),
        "embedding_scale": config.hidden_size**0.5,
    }


def _hf_hparams(cfg: Mapping[str, Any], config: LlamaConfig) -> dict[str, Any]:
    return gemma_hf_hparams(cfg, config, default_pattern=2)


ARCHITECTURE = Architecture(
    name="gemma2", permuted_qk_rows=False, layer_class=GemmaDecoderLayer, hf_norm_offset=True,
    gguf_hparams=_gguf_hparams, hf_hparams=_hf_hparams,
)

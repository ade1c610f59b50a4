"""Gemma 3 (text): Gemma 2's block (:class:`~core_engine.model.gemma2.GemmaDecoderLayer`) with
Qwen3-style RMSNorms over each q and k head before RoPE, five local (sliding-window) layers in
every six, the local layers on their own RoPE base (10,000 against the global 1,000,000, whose
linear scaling they do not share), and no soft-capping in GGUF files (llama.cpp's graph has
none; a ``config.json`` that sets one is honoured, as transformers does)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from core_engine.model.architecture import Architecture
from core_engine.model.config import LlamaConfig, RopeScaling
from core_engine.model.gemma2 import (
    GemmaDecoderLayer,
    _gguf_attention_scale,
    gemma_hf_hparams,
    local_layers,
)
from core_engine.model.qwen3 import QKNormDecoderLayer

__all__ = ["ARCHITECTURE", "Gemma3DecoderLayer"]


class Gemma3DecoderLayer(GemmaDecoderLayer, QKNormDecoderLayer):
    """Gemma's block whose q and k heads are RMS-normed before RoPE (``q_norm``, ``k_norm``)."""


def _gguf_hparams(read: Callable[[str, Any], Any], config: LlamaConfig) -> dict[str, Any]:
    window = read("attention.sliding_window", None)
    return {
        "sliding_window": int(window) if window else None,
        "local_layers": local_layers(read("attention.sliding_window_pattern", 6), config.num_layers) if window else (),
        "local_rope_theta": float(read("rope.freq_base_swa", 10000.0)),
        "attention_scale": _gguf_attention_scale(
            config.hidden_size, config.num_heads, config.head_dim, num_layers=config.num_layers, big_layers=62
        ),
        "embedding_scale": config.hidden_size**0.5,
    }


def _hf_hparams(cfg: Mapping[str, Any], config: LlamaConfig) -> dict[str, Any]:
    """Gemma's fields, and the two RoPEs of ``rope_parameters`` (per layer type; older
    configs: ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling`` of the global ones)."""
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention") or {"rope_theta": cfg.get("rope_theta", 1_000_000.0), **(cfg.get("rope_scaling") or {})}
    sliding = rope.get("sliding_attention") or {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    kind = full.get("rope_type") or full.get("type")
    if kind not in (None, "default", "linear"):
        raise ValueError(f"Gemma 3 RoPE scaling {kind!r} is not supported (linear is)")
    scaling = RopeScaling(kind="linear", factor=float(full["factor"])) if kind == "linear" and full["factor"] != 1.0 else None
    return {
        **gemma_hf_hparams(cfg, config, default_pattern=6),
        "rope_theta": float(full["rope_theta"]),
        "rope_scaling": scaling,
        "local_rope_theta": float(sliding["rope_theta"]),
    }


ARCHITECTURE = Architecture(
    name="gemma3", permuted_qk_rows=False, qk_norm=True, layer_class=Gemma3DecoderLayer, hf_norm_offset=True,
    gguf_hparams=_gguf_hparams, hf_hparams=_hf_hparams,
)

"""Qwen3 (dense): the Llama-family decoder with an RMSNorm over each q and k head before RoPE
(``attn_q_norm`` / ``attn_k_norm``, one weight of ``head_dim`` shared by the heads), no qkv
bias, NeoX RoPE (q/k rows in Hugging Face's order) and ``head_dim`` from the file."""

from __future__ import annotations

import torch
from torch import Tensor

from core_engine.model.architecture import Architecture
from core_engine.model.config import LlamaConfig
from core_engine.model.llama import LlamaDecoderLayer, layer_weight
from core_engine.model.norm import rms_norm
from core_engine.model.rope import apply_rotary

__all__ = ["ARCHITECTURE", "QKNormDecoderLayer"]

ARCHITECTURE = Architecture(name="qwen3", permuted_qk_rows=False, qk_norm=True)


class QKNormDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose q and k heads are RMS-normed (``q_norm``, ``k_norm``) before RoPE."""

    def __init__(self, config: LlamaConfig, *, dtype: torch.dtype, device: torch.device | str, qkv_bias: bool) -> None:
        super().__init__(config, dtype=dtype, device=device, qkv_bias=qkv_bias)
        self.q_norm = layer_weight(config.head_dim, dtype=dtype, device=device)
        self.k_norm = layer_weight(config.head_dim, dtype=dtype, device=device)

    def qkv_heads(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv.normed(x, self.attn_norm, self.rms_eps).view(x.shape[0], -1, d)
        q = apply_rotary(rms_norm(qkv[:, :h], self.q_norm, self.rms_eps), cos, sin)
        k = apply_rotary(rms_norm(qkv[:, h : h + kv], self.k_norm, self.rms_eps), cos, sin)
        return torch.cat((q, k, qkv[:, h + kv :]), dim=1)

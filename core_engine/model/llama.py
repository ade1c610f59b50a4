"""Llama-architecture decoder in plain torch: fused QKV and gate/up, RMSNorm, SwiGLU, GQA.

The model is stateless across steps: the KV cache lives behind the
:class:`~core_engine.attention.AttentionContext` passed to :meth:`LlamaModel.forward`. Weights
are the loader's (see :mod:`core_engine.gguf_loader`): q/k rows are already in rotate-half
order, so RoPE is the NeoX form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core_engine.attention import AttentionContext
from core_engine.model.config import LlamaConfig
from core_engine.model.linear import (
    DenseLinear,
    Linear,
    TopKRefinedLinear,
    make_linear,
    resolve_weight_format,
)
from core_engine.model.rope import RotaryEmbedding, apply_rotary

__all__ = ["LlamaDecoderLayer", "LlamaModel"]


def _weight(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Inference only: no autograd bookkeeping on weights.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block: ``x += o(attn(rope(qkv(norm(x)))))``; ``x += down(silu(g) * u)``."""

    def __init__(
        self, config: LlamaConfig, *, dtype: torch.dtype, device: torch.device | str, qkv_bias: bool
    ) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.rms_eps = config.rms_eps
        qkv_out = config.q_size + 2 * config.kv_size
        self.attn_norm = _weight(hidden, dtype=dtype, device=device)
        self.qkv_proj = _weight(qkv_out, hidden, dtype=dtype, device=device)  # rows: q | k | v
        self.qkv_bias = _weight(qkv_out, dtype=dtype, device=device) if qkv_bias else None
        self.o_proj = _weight(hidden, config.q_size, dtype=dtype, device=device)
        self.ffn_norm = _weight(hidden, dtype=dtype, device=device)
        self.gate_up_proj = _weight(2 * inter, hidden, dtype=dtype, device=device)  # gate | up
        self.down_proj = _weight(hidden, inter, dtype=dtype, device=device)
        # The products the forward pass calls; :meth:`LlamaModel.set_weight_format` swaps them.
        self.qkv: Linear = DenseLinear(self.qkv_proj, self.qkv_bias)
        self.o: Linear = DenseLinear(self.o_proj)
        self.gate_up: Linear = DenseLinear(self.gate_up_proj)
        self.down: Linear = DenseLinear(self.down_proj)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext, layer_idx: int
    ) -> Tensor:
        """x: (T, hidden) residual stream → (T, hidden); cos/sin: (T, 1, head_dim/2)."""
        num_tokens = x.shape[0]
        heads_qk = self.num_heads + self.num_kv_heads
        h = F.rms_norm(x, (x.shape[-1],), self.attn_norm, self.rms_eps)  # (T, hidden)
        qkv = self.qkv(h)  # (T, q_size + 2 kv_size)
        qkv = qkv.view(num_tokens, heads_qk + self.num_kv_heads, self.head_dim)
        qk = apply_rotary(qkv[:, :heads_qk], cos, sin)  # (T, n_heads + n_kv_heads, head_dim)
        out = attn.forward(layer_idx, qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, heads_qk:])
        x = self.o.add_to(x, out.reshape(num_tokens, self.q_size))  # x + out @ o_proj.T: (T, hidden)
        h = F.rms_norm(x, (x.shape[-1],), self.ffn_norm, self.rms_eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)  # (T, inter) each
        return self.down.add_to(x, F.silu(gate) * up)  # (T, hidden)


class LlamaModel(nn.Module):
    """Token ids + positions + an attention context → fp32 logits.

    Build it with :func:`core_engine.gguf_loader.load_model`; the constructor only allocates
    (uninitialised) weights of the right shapes.
    """

    #: Layer type built by the constructor (subclasses swap in their own numerics).
    decoder_layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        qkv_bias: bool = False,
        rope_freq_factors: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            self.decoder_layer_class(config, dtype=dtype, device=device, qkv_bias=qkv_bias)
            for _ in range(config.num_layers)
        )
        self.norm = _weight(config.hidden_size, dtype=dtype, device=device)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else _weight(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )
        self.rotary = RotaryEmbedding(config, dtype=dtype, device=device, freq_factors=rope_freq_factors)
        self.head: Linear = DenseLinear(self.lm_head)
        #: Storage of the matmul weights: "dense" (the parameters above) or "fp16" (packed).
        self.weight_format = "dense"

    def set_weight_format(self, weight_format: str) -> str:
        """Re-store every projection and the LM head in ``weight_format`` (see
        :mod:`core_engine.model.linear`); returns the resolved format.

        Packing frees the dense copies: afterwards the ``*_proj`` (and an untied ``lm_head``)
        parameters are ``None`` and only :meth:`forward` can use the weights. One-way: load the
        model again for another format.
        """
        resolved = resolve_weight_format(weight_format, dtype=self.dtype, device=self.device)
        if resolved == self.weight_format:
            return resolved
        if self.weight_format != "dense":
            raise ValueError(f"weights are already packed as {self.weight_format!r}")
        for layer in self.layers:
            layer.qkv = make_linear(resolved, layer.qkv_proj, layer.qkv_bias)
            layer.o = make_linear(resolved, layer.o_proj)
            layer.gate_up = make_linear(resolved, layer.gate_up_proj)
            layer.down = make_linear(resolved, layer.down_proj)
            layer.qkv_proj = layer.qkv_bias = layer.o_proj = layer.gate_up_proj = layer.down_proj = None
        self.head = make_linear(resolved, self.lm_head)
        if resolved == "int8":
            self.head = TopKRefinedLinear(self.head, self.lm_head.detach())
        if not self.config.tie_word_embeddings and resolved != "int8":
            # The embedding table stays (rows are looked up); int8 keeps the head's exact rows
            # for refining the top logits.
            self.lm_head = None
        self.weight_format = resolved
        return resolved

    def matmul_weight_bytes(self) -> int:
        """Bytes of projection and LM-head weight one forward step reads (a decode roofline)."""
        layers = sum(lin.nbytes for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return layers + self.head.nbytes

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.embed_tokens.device

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn: AttentionContext,
        *,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """Run one step over T flattened tokens.

        input_ids, positions: (T,) int64. ``logits_indices`` (N,) selects the rows whose logits
        are wanted (e.g. the last token of each sequence); ``None`` means all T.
        Returns fp32 logits (N or T, vocab_size).
        """
        x = F.embedding(input_ids, self.embed_tokens)  # (T, hidden)
        cos, sin = self.rotary.lookup(positions)  # (T, 1, head_dim/2) each
        for layer_idx, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn, layer_idx)
        if logits_indices is not None:
            x = x[logits_indices]  # (N, hidden)
        x = F.rms_norm(x, (x.shape[-1],), self.norm, self.config.rms_eps)
        return self.head(x).float()  # (N, vocab)

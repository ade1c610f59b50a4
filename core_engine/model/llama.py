"""Llama-architecture decoder in plain torch: fused QKV and gate/up, RMSNorm, SwiGLU, GQA.

The model is stateless across steps: the KV cache lives behind the
:class:`~core_engine.attention.AttentionContext` passed to :meth:`LlamaModel.forward`. Weights
are the loader's (see :mod:`core_engine.gguf_loader`): q/k rows are already in rotate-half
order, so RoPE is the NeoX form.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core_engine.attention import AttentionContext, LayerAttention
from core_engine.model.architecture import Architecture
from core_engine.model.block_weights import BlockSource
from core_engine.model.config import LlamaConfig
from core_engine.model.linear import (
    DenseLinear,
    ExpertsLinear,
    Linear,
    TopKRefinedLinear,
    block_linear,
    make_linear,
    resolve_weight_format,
)
from core_engine.model.norm import rms_norm
from core_engine.model.rope import RotaryEmbedding

__all__ = ["ARCHITECTURE", "LlamaDecoderLayer", "LlamaModel", "layer_attention", "layer_weight"]

logger = logging.getLogger(__name__)

#: Llama 2/3: llama.cpp's converter permutes the q/k rows for its interleaved RoPE.
ARCHITECTURE = Architecture(name="llama", permuted_qk_rows=True)


def _match_format(
    name: str, layer_formats: Mapping[str, str] | None, default: str, *, dtype: torch.dtype,
    device: torch.device, file_type: str | None,
) -> str:
    for pattern, fmt in (layer_formats or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return resolve_weight_format(fmt, dtype=dtype, device=device, file_type=file_type)
    return default


def _pack(
    fmt: str, name: str, weight: Tensor, bias: Tensor | None, source: BlockSource | None
) -> Linear | ExpertsLinear:
    """``weight`` (the dense parameter) as a product in ``fmt``, from the file's blocks when
    ``source`` has them in that format. A stacked (experts, out, in) weight becomes an
    :class:`ExpertsLinear` of one product per expert."""
    if weight.dim() == 3:
        num_experts, rows = weight.shape[:2]
        blocks = source.block_weight(name, fmt) if fmt in ("int4", "int8") and source is not None else None
        if blocks is None:
            return ExpertsLinear([_pack(fmt, name, w, None, None) for w in weight])  # type: ignore[misc]
        per_expert = [None if t is None else t.view(num_experts, rows, *t.shape[1:]) for t in blocks]
        return ExpertsLinear([
            block_linear(tuple(None if t is None else t[e] for t in per_expert), None, device=weight.device)  # type: ignore[arg-type]
            for e in range(num_experts)
        ])
    if fmt in ("int4", "int8") and source is not None:
        blocks = source.block_weight(name, fmt)
        if blocks is not None:
            return block_linear(blocks, bias, device=weight.device)
    if fmt == "dense":
        return DenseLinear(weight, bias)
    return make_linear(fmt, weight, bias)


def layer_weight(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised weight the loader fills (inference only: no autograd bookkeeping)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def layer_attention(config: LlamaConfig, layer_idx: int) -> LayerAttention | None:
    """How layer ``layer_idx`` attends (its window, softmax scale and soft-cap), or None where
    it attends like Llama's (the whole context, ``head_dim ** -0.5``, no cap)."""
    window = config.sliding_window if layer_idx in config.local_layers else None
    spec = LayerAttention(scale=config.attention_scale, window=window, softcap=config.attn_logit_softcap)
    return None if spec == LayerAttention() else spec


class LlamaDecoderLayer(nn.Module):
    """One pre-norm block: ``x += o(attn(rope(qkv(norm(x)))))``; ``x += down(silu(g) * u)``."""

    #: The products :meth:`LlamaModel.set_weight_format` stores (names of attributes).
    PRODUCTS: tuple[str, ...] = ("qkv", "o", "gate_up", "down")

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
        # How this layer attends where an architecture differs from Llama (None: Llama's way;
        # set by :class:`LlamaModel` from the config, :func:`layer_attention`).
        self.attention_spec: LayerAttention | None = None
        qkv_out = config.q_size + 2 * config.kv_size
        self.attn_norm = layer_weight(hidden, dtype=dtype, device=device)
        self.qkv_proj = layer_weight(qkv_out, hidden, dtype=dtype, device=device)  # rows: q | k | v
        self.qkv_bias = layer_weight(qkv_out, dtype=dtype, device=device) if qkv_bias else None
        self.o_proj = layer_weight(hidden, config.q_size, dtype=dtype, device=device)
        self.ffn_norm = layer_weight(hidden, dtype=dtype, device=device)
        self.gate_up_proj = layer_weight(2 * inter, hidden, dtype=dtype, device=device)  # gate | up
        self.down_proj = layer_weight(hidden, inter, dtype=dtype, device=device)
        # The products the forward pass calls; :meth:`LlamaModel.set_weight_format` swaps them.
        self.qkv: Linear = DenseLinear(self.qkv_proj, self.qkv_bias)
        self.o: Linear = DenseLinear(self.o_proj)
        self.gate_up: Linear = DenseLinear(self.gate_up_proj)
        self.down: Linear = DenseLinear(self.down_proj)

    def dense_weights(self) -> dict[str, tuple[Tensor, Tensor | None]]:
        """Product name -> (weight, bias) as loaded (None after packing)."""
        return {"qkv": (self.qkv_proj, self.qkv_bias), "o": (self.o_proj, None),
                "gate_up": (self.gate_up_proj, None), "down": (self.down_proj, None)}

    def qkv_heads(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """(T, n_heads + 2 n_kv_heads, head_dim): q | k | v of the normed input, RoPE on q and k."""
        heads_qk = self.num_heads + self.num_kv_heads
        return self.qkv.normed_rope(x, self.attn_norm, self.rms_eps, cos, sin, heads_qk, self.head_dim)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext, layer_idx: int
    ) -> Tensor:
        """x: (T, hidden) residual stream → (T, hidden); cos/sin: (T, 1, head_dim/2)."""
        num_tokens = x.shape[0]
        heads_qk = self.num_heads + self.num_kv_heads
        qkv = self.qkv_heads(x, cos, sin)
        out = attn.forward(
            layer_idx, qkv[:, : self.num_heads], qkv[:, self.num_heads : heads_qk], qkv[:, heads_qk:],
            self.attention_spec,
        )
        x = self.o.add_to(x, out.reshape(num_tokens, self.q_size))  # x + out @ o_proj.T: (T, hidden)
        return self.feed_forward(x)

    def feed_forward(self, x: Tensor) -> Tensor:
        """``x + down(silu(gate) * up)`` of the normed ``x`` (T, hidden)."""
        gate_up = self.gate_up.normed(x, self.ffn_norm, self.rms_eps)  # (T, 2 inter): gate | up
        return self.down.swiglu_add_to(x, gate_up)  # x + (silu(gate) * up) @ down.T: (T, hidden)

    def other_weight_bytes(self) -> int:
        """Bytes of matmul weights outside the products (MoE experts); 0 here."""
        return 0


class LlamaModel(nn.Module):
    """Token ids + positions + an attention context → fp32 logits.

    Build it with :func:`core_engine.gguf_loader.load_model`; the constructor only allocates
    (uninitialised) weights of the right shapes.
    """

    #: An ``nn.ModuleList`` of decoder layers whose class (and so attributes) varies with the
    #: architecture; typed loosely so that loaders and packers reach their weights.
    layers: Any

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        qkv_bias: bool = False,
        rope_freq_factors: Tensor | None = None,
        layer_class: type[LlamaDecoderLayer] | None = None,
    ) -> None:
        """``layer_class``: the decoder layer of the architecture
        (:func:`core_engine.model.architectures.decoder_layer_class`; the loaders pass it);
        None: plain Llama layers."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = layer_weight(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        if layer_class is None:
            if config.qk_norm or config.num_experts:
                raise ValueError(f"{config.architecture}: its layers are not Llama's; pass its layer_class")
            layer_class = LlamaDecoderLayer
        self.layers = nn.ModuleList(
            layer_class(config, dtype=dtype, device=device, qkv_bias=qkv_bias) for _ in range(config.num_layers)
        )
        for i, layer in enumerate(self.layers):
            layer.attention_spec = layer_attention(config, i)
        self.norm = layer_weight(config.hidden_size, dtype=dtype, device=device)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else layer_weight(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )
        self.rotary = RotaryEmbedding(config, dtype=dtype, device=device, freq_factors=rope_freq_factors)
        #: The local (sliding-window) layers' own RoPE where their base differs (Gemma 3).
        self.local_rotary: RotaryEmbedding | None = None
        if config.local_rope_theta is not None:
            local = msgspec.structs.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
            self.local_rotary = RotaryEmbedding(local, dtype=dtype, device=device)
        #: The layers that rotate with :attr:`local_rotary` (none without one).
        self._local_rope_layers = frozenset(config.local_layers) if self.local_rotary is not None else frozenset()
        self.head: Linear = DenseLinear(self.lm_head)
        #: Storage of the matmul weights: "dense" (the parameters above), or the packed format
        #: of :meth:`set_weight_format`; ``layer_formats`` the products stored otherwise.
        self.weight_format = "dense"
        self.layer_formats: dict[str, str] = {}
        #: The file's blocks for the int4/int8 formats (set by the GGUF loader).
        self.block_source: BlockSource | None = None
        #: The loader left the dense products unread (``load_model(packs_from_blocks=...)``):
        #: only :meth:`set_weight_format` into block formats from ``block_source`` fills them.
        self.products_unread = False

    #: The names :meth:`set_weight_format` matches ``layer_formats`` against (per layer: the
    #: layer class's ``PRODUCTS``; MoE layers have no gate_up/down products).
    PRODUCTS = LlamaDecoderLayer.PRODUCTS

    def product_names(self) -> list[str]:
        """``layers.{i}.{qkv,o,gate_up,down}`` for every layer, then ``head``."""
        return [f"layers.{i}.{p}" for i, layer in enumerate(self.layers) for p in layer.PRODUCTS] + ["head"]

    def set_weight_format(
        self,
        weight_format: str,
        *,
        layer_formats: Mapping[str, str] | None = None,
        source: BlockSource | None = None,
        file_type: str | None = None,
    ) -> str:
        """Re-store every projection and the LM head in ``weight_format`` (see
        :mod:`core_engine.model.linear`); returns the resolved format.

        ``layer_formats`` maps product names or globs (``"head"``, ``"layers.3.*"``,
        ``"layers.*.down"``; see :meth:`product_names`) to a format for those products; the
        first matching pattern wins. ``source`` gives the file's own blocks for the int4/int8
        formats (no second rounding where the file's block type matches).

        Packing frees the dense copies: afterwards the ``*_proj`` (and an untied ``lm_head``)
        parameters are ``None`` and only :meth:`forward` can use the weights. One-way: load the
        model again for another format.
        """
        source = source or self.block_source
        resolved = resolve_weight_format(weight_format, dtype=self.dtype, device=self.device, file_type=file_type)
        natural = getattr(source, "natural_format", None) if weight_format == "auto" and resolved in ("int4", "int8") else None
        formats = {
            name: _match_format(
                name, layer_formats, natural(name) if natural else resolved,
                dtype=self.dtype, device=self.device, file_type=file_type,
            )
            for name in self.product_names()
        }
        if self.products_unread and (source is None or not set(formats.values()) <= {"int4", "int8"}):
            raise ValueError("the dense weights were not loaded: only int4/int8 from the file's blocks can be stored")
        if set(formats.values()) == {self.weight_format} and not self.layer_formats:
            return resolved
        if self.weight_format != "dense" or self.layer_formats:
            raise ValueError(f"weights are already packed as {self.weight_format!r}")
        for i, layer in enumerate(self.layers):
            for product, (weight, bias) in layer.dense_weights().items():
                name = f"layers.{i}.{product}"
                setattr(layer, product, _pack(formats[name], name, weight, bias, source))
            layer.qkv_proj = layer.qkv_bias = layer.o_proj = layer.gate_up_proj = layer.down_proj = None
            if hasattr(layer, "experts_gate_up_proj"):
                layer.experts_gate_up_proj = layer.experts_down_proj = None
        head_format = formats["head"]
        self.head = _pack(head_format, "head", self.lm_head, None, source)  # type: ignore[assignment]  # any Linear
        refine = head_format in ("int8", "int4") and self.config.tie_word_embeddings
        if refine:
            # The embedding table (kept for lookups) holds the exact rows of a tied head.
            self.head = TopKRefinedLinear(self.head, self.embed_tokens.detach())  # tied: the same rows
        if not self.config.tie_word_embeddings and head_format != "dense":
            self.lm_head = None  # type: ignore[assignment]  # the packed head holds its rows
        self.weight_format = resolved
        self.layer_formats = {n: f for n, f in formats.items() if f != resolved}
        return resolved

    def product(self, name: str) -> Linear | ExpertsLinear:
        """The product called ``name`` (see :meth:`product_names`)."""
        if name == "head":
            return self.head
        _, idx, product = name.split(".")
        return getattr(self.layers[int(idx)], product)

    def matmul_weight_bytes(self) -> int:
        """Bytes of projection and LM-head weight a one-token decode step reads (a decode
        roofline): of a mixture's experts, the ``num_experts_used`` it multiplies."""
        cfg = self.config
        used = cfg.num_experts_used / cfg.num_experts if cfg.num_experts else 1.0

        def read(product: Linear | ExpertsLinear) -> float:
            return product.nbytes * (used if isinstance(product, ExpertsLinear) else 1.0)

        layers = round(sum(read(getattr(layer, p)) for layer in self.layers for p in layer.PRODUCTS))
        return layers + sum(layer.other_weight_bytes() for layer in self.layers) + self.head.nbytes

    def resident_weight_bytes(self) -> int:
        """Bytes of every weight the model holds: products, embedding table, norms, RoPE."""
        seen: set[int] = set()
        total = 0

        def add(tensor: Tensor | None) -> None:
            nonlocal total
            if tensor is None:
                return
            key = tensor.untyped_storage().data_ptr()
            if key not in seen:  # one count per storage (tied views)
                seen.add(key)
                total += tensor.untyped_storage().nbytes()

        for tensor in self.parameters():
            add(tensor)
        for name in self.product_names():
            lin = self.product(name)
            if isinstance(lin, TopKRefinedLinear):
                add(lin._exact)
            for part in lin.experts if isinstance(lin, ExpertsLinear) else [lin]:
                if isinstance(part, DenseLinear):
                    add(part.weight)
                    add(part.bias)
                else:
                    total += part.nbytes  # type: ignore[attr-defined]  # every packed Linear has nbytes
        return total

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
        x = self.hidden_states(input_ids, positions, attn)  # (T, hidden)
        if logits_indices is not None:
            x = x[logits_indices]  # (N, hidden)
        return self.compute_logits(x)

    def hidden_states(self, input_ids: Tensor, positions: Tensor, attn: AttentionContext) -> Tensor:
        """(T,) ids and positions -> (T, hidden) final residual rows, before the final norm
        and the LM head (:meth:`final_norm` gives what embeddings pool)."""
        x = self.embed(input_ids)  # (T, hidden)
        cos, sin = self.rotary.lookup(positions)  # (T, 1, head_dim/2) each
        local = None if self.local_rotary is None else self.local_rotary.lookup(positions)
        for layer_idx, layer in enumerate(self.layers):
            if local is not None and layer_idx in self._local_rope_layers:
                x = layer(x, *local, attn, layer_idx)
            else:
                x = layer(x, cos, sin, attn, layer_idx)
        return x

    def final_norm(self, x: Tensor) -> Tensor:
        """(N, hidden) final residual rows -> the normalised rows the LM head reads."""
        return rms_norm(x, self.norm, self.config.rms_eps)

    def embed(self, input_ids: Tensor) -> Tensor:
        """(T,) token ids -> (T, hidden) rows of the embedding table (scaled where the
        architecture scales them)."""
        x = F.embedding(input_ids, self.embed_tokens)
        scale = self.config.embedding_scale
        return x if scale is None else x * scale

    def compute_logits(self, x: Tensor) -> Tensor:
        """(N, hidden) final residual rows -> (N, vocab) fp32 logits: norm, LM head, soft-cap."""
        cfg = self.config
        x = self.final_norm(x)
        logits = self.head(x).float()  # (N, vocab)
        if cfg.final_logit_softcap is not None:
            logits = cfg.final_logit_softcap * torch.tanh(logits / cfg.final_logit_softcap)
        return logits

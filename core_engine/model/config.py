"""Hyper-parameters of a Llama-family model, read from GGUF metadata."""

from __future__ import annotations

import msgspec

__all__ = ["LlamaConfig", "RopeScaling"]


class RopeScaling(msgspec.Struct, kw_only=True, frozen=True):
    """RoPE position scaling from ``{arch}.rope.scaling.*`` (only what we implement).

    ``kind`` is ``"linear"`` (positions divided by ``factor``) or ``"longrope"`` (Phi-3's
    LongRoPE: per-pair frequency divisors, a short and a long set, and cos/sin scaled by
    ``attention_factor``; ``factor`` is the trained over the original context). Per-dimension
    frequency factors (Llama 3.x ``rope_freqs.weight``, LongRoPE's chosen set) are carried by
    the model weights, not here.
    """

    kind: str
    factor: float
    #: LongRoPE: the pretraining context; an engine context longer than it takes the long factors.
    original_context: int | None = None
    #: LongRoPE: multiplier of cos and sin (``{arch}.rope.scaling.attn_factor``).
    attention_factor: float = 1.0


class LlamaConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Everything the model and the engine need to know about one Llama-architecture file."""

    architecture: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    #: Dimensions of each head that RoPE rotates (the loader requires ``== head_dim``).
    rope_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    rms_eps: float
    #: Per-head RMSNorm of q and k before RoPE (Qwen3).
    qk_norm: bool = False
    #: Mixture of experts (Qwen3-MoE): experts per layer (0: a dense FFN), used per token, and
    #: each expert's intermediate size.
    num_experts: int = 0
    num_experts_used: int = 0
    expert_intermediate_size: int = 0
    #: Sliding-window attention: the window of the local layers (a query at position p sees
    #: keys p - window + 1 .. p) and which layers those are (Mistral: all; Gemma 2: every
    #: other one; Gemma 3: five of every six). None: every layer sees the whole context.
    sliding_window: int | None = None
    local_layers: tuple[int, ...] = ()
    #: RoPE base of the local layers where it differs (Gemma 3: 10,000 against 1,000,000; no
    #: position scaling there).
    local_rope_theta: float | None = None
    #: Softmax scale of the attention (Gemma: ``query_pre_attn_scalar ** -0.5``); None:
    #: ``head_dim ** -0.5``.
    attention_scale: float | None = None
    #: Soft-capping (Gemma 2): attention scores and final logits become ``cap * tanh(x / cap)``.
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    #: The token embeddings are multiplied by this (Gemma: ``sqrt(hidden_size)``).
    embedding_scale: float | None = None
    #: Trained context length (``{arch}.context_length``); the engine's default max length.
    context_length: int
    #: True when the file has no ``output.weight``: the LM head reuses the token embedding.
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str | None = None

    def context_window(self, max_model_len: int | None = None) -> int:
        """The engine's context window: ``max_model_len`` capped at the trained context length
        (None: the trained length)."""
        return min(max_model_len or self.context_length, self.context_length)

    @property
    def q_size(self) -> int:
        """Width of the query projection (``num_heads * head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projections (``num_kv_heads * head_dim``)."""
        return self.num_kv_heads * self.head_dim

"""Opt-in "llama.cpp numerics": reproduce llama.cpp's CPU arithmetic on quantised GGUF weights.

The default ("exact") engine multiplies exactly dequantised weights by fp32/bf16 activations.
llama.cpp's CPU backend (ggml) does not: before each matrix product it converts the *input
activations* to the weight type's "vec_dot" type and multiplies in that format, and it keeps
the KV cache in F16. On a Q4_1 file this moves its logits by ~0.15 on average, enough that an
exact engine agrees with llama.cpp on only ~97% of greedy tokens. This module emulates, in
torch and in fp32 (``load_model(path, numerics="llamacpp")``):

* **Activation quantisation** (ggml's x86 ``quantize_row_q8_0``/``quantize_row_q8_1``): per
  block of 32 inputs along K, ``amax = max|x|``, ``d = amax / 127`` (stored as fp16),
  ``q = round_half_even(x * (127 / amax))``; Q8_1 also stores ``s = fp16(d * sum(q))`` (with
  the fp32 ``d``). Q4_0 and Q8_0 weights take Q8_0 inputs, Q4_1 takes Q8_1, F16/BF16 weights
  take F16/BF16 inputs, F32 weights F32.
* **The block dot products**: ``q4_1 x q8_1 = sum_b d_w d_x sumi_b + m_w s_x``. With ``xq = q *
  fp16(d)`` and the dequantised weights ``w = q_w d_w + m_w``, ``xq . w`` already holds
  ``d_w d_x sumi_b + m_w fp16(d) sum(q)``, so the emulation is one dense fp32 matmul plus a
  rank-K/32 correction ``(s - fp16(d) sum(q)) @ m_w^T``. Integer block sums are exact in fp32;
  what remains is fp32 summation order (~1e-7 relative), as between two ggml builds.
* **F16 KV cache and F16 attention operands**: ggml stores K and V as F16, converts q to F16 for
  ``K q`` and the softmax probabilities to F16 for ``V p`` (flash attention off, llama.cpp's
  default in llama-cpp-python). The model rounds q, k, v; :class:`LlamaCppAttention` also
  rounds the probabilities (a plain :class:`~core_engine.attention.AttentionContext` does not).
* **RMSNorm** as ggml computes it (sum of squares in float64, ``1/sqrtf(mean + eps)``, then the
  weight), and **RoPE tables** as ggml builds them (``theta *= powf(base, -2/D)`` in fp32, one
  pair at a time).

Weights stay dequantised fp32 (plus the fp16 minimums of Q4_1 blocks, 1/32 of the weights), so
this mode costs about as much as the exact fp32 path; it is for oracle comparisons, not speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from torch import Tensor, nn

from core_engine.attention import AttentionContext, ContiguousAttention
from core_engine.model.config import LlamaConfig
from core_engine.model.llama import LlamaDecoderLayer, LlamaModel
from core_engine.model.rope import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from core_engine.gguf_loader import GGUFFile

__all__ = [
    "NUMERICS",
    "LinearNumerics",
    "LlamaCppAttention",
    "LlamaCppDecoderLayer",
    "LlamaCppModel",
    "LlamaCppNumerics",
    "attach_llamacpp_numerics",
    "ggml_rms_norm",
    "ggml_rope_tables",
    "quantize_activations",
]

#: Accepted values of ``load_model(..., numerics=)``.
NUMERICS = ("exact", "llamacpp")

QK = 32  # block length of Q8_0/Q8_1 (and of the weight block types)

#: ggml's ``vec_dot_type`` per weight type: the format the input activations are converted to.
VEC_DOT_TYPE: dict[Q, str] = {
    Q.F32: "f32",
    Q.F16: "f16",
    Q.BF16: "bf16",
    Q.Q8_0: "q8_0",
    Q.Q4_0: "q8_0",
    Q.Q4_1: "q8_1",
}


class LlamaCppNumerics(msgspec.Struct, kw_only=True, frozen=True):
    """Which parts of llama.cpp's arithmetic to emulate (all on by default).

    The switches exist to measure what each detail contributes (see
    ``docs/core-engine-model.md``); the engine uses the defaults.
    """

    #: Convert matmul inputs to the weight's vec_dot type (Q8_0/Q8_1/F16/BF16).
    quantize_activations: bool = True
    #: Round q, k and v to F16 (F16 KV cache; q converted to F16 for ``K q``).
    f16_kv: bool = True
    #: Round softmax probabilities to F16 before ``V p`` (needs :class:`LlamaCppAttention`).
    f16_probs: bool = True
    #: ggml's RMSNorm arithmetic instead of ``torch.nn.functional.rms_norm``.
    ggml_rms_norm: bool = True
    #: ggml's fp32 RoPE angle recurrence instead of float64 tables.
    ggml_rope: bool = True


def _round_f16(x: Tensor) -> Tensor:
    return x.to(torch.float16).to(x.dtype)


def quantize_activations(x: Tensor, vec_dot_type: str) -> tuple[Tensor, Tensor | None]:
    """Round ``x`` (T, K) fp32 as ggml converts a matmul input to ``vec_dot_type``.

    Returns ``(xq, s_err)``: ``xq`` (T, K) holds the represented values (``q * fp16(d)`` for the
    Q8 types); for Q8_1, ``s_err`` (T, K/32) is ``s - fp16(d) * sum(q)``, the difference between
    the block sum ggml stores and the one ``xq`` implies (``None`` for the other types).
    """
    if vec_dot_type == "f32":
        return x, None
    if vec_dot_type == "f16":
        return _round_f16(x), None
    if vec_dot_type == "bf16":
        return x.to(torch.bfloat16).to(x.dtype), None
    assert vec_dot_type in ("q8_0", "q8_1"), vec_dot_type
    num_tokens, k = x.shape
    blocks = x.reshape(num_tokens, k // QK, QK)  # (T, K/32, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # (T, K/32, 1)
    # Tensor/tensor division: torch turns division by (or of) a Python scalar into a
    # multiplication by a reciprocal, which rounds differently from ggml's fp32 division.
    c127 = torch.full_like(amax, 127.0)
    d = torch.div(amax, c127)
    # ggml multiplies by 127/amax (not divides by d) and rounds half to even (_mm256_round_ps).
    inv = torch.where(amax != 0, torch.div(c127, amax), torch.zeros_like(amax))
    q = torch.round(blocks * inv)  # (T, K/32, 32) integers in [-127, 127]
    d16 = _round_f16(d)
    xq = (q * d16).view(num_tokens, k)  # exact: int8 x fp16 fits fp32
    if vec_dot_type == "q8_0":
        return xq, None
    qsum = q.sum(dim=-1, keepdim=True)  # exact (|sum| <= 32 * 127)
    s = _round_f16(d * qsum)  # ggml: FP32_TO_FP16(d * sum), with the fp32 d
    return xq, (s - d16 * qsum).squeeze(-1)  # (T, K/32)


class LinearNumerics:
    """How llama.cpp multiplies by one (possibly fused) weight matrix.

    ``segments``: ``(rows, vec_dot_type, minimums)`` for consecutive row ranges of the fused
    weight (q | k | v may have different GGML types); ``minimums`` (rows, K/32) fp32 are the
    fp16 block minimums of Q4_1 weights, ``None`` for other types.
    """

    def __init__(self, segments: Sequence[tuple[int, str, Tensor | None]]) -> None:
        self.segments = list(segments)

    @property
    def vec_dot_types(self) -> list[str]:
        """Input formats, one per segment."""
        return [kind for _, kind, _ in self.segments]

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """x (T, K) @ weight (N, K).T (+ bias) → (T, N), with x rounded as ggml rounds it."""
        quantized: dict[str, tuple[Tensor, Tensor | None]] = {}
        outs: list[Tensor] = []
        start = 0
        for rows, kind, minimums in self.segments:
            if kind not in quantized:
                quantized[kind] = quantize_activations(x, kind)
            xq, s_err = quantized[kind]
            y = xq @ weight[start : start + rows].t()  # (T, rows)
            if minimums is not None:
                assert s_err is not None
                y = torch.addmm(y, s_err, minimums.t())  # + (s - fp16(d) sum q) m_w
            outs.append(y)
            start += rows
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if bias is None else out + bias


def ggml_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """ggml's ``rms_norm`` then ``mul``: float64 sum of squares, ``1/sqrtf(mean + eps)`` in fp32."""
    mean = (x.double().square().sum(dim=-1, keepdim=True) / x.shape[-1]).float()  # (T, 1)
    scale = 1.0 / torch.sqrt(mean + eps)
    return (x * scale) * weight


def ggml_rope_tables(config: LlamaConfig, freq_factors: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin (positions, D/2) fp32 as ggml's ``rope_cache_init`` computes them.

    ggml starts at ``theta = p`` and multiplies by ``theta_scale = powf(base, -2/D)`` in fp32 for
    each successive pair; linear scaling multiplies by ``1/factor`` and frequency factors divide,
    both in fp32, before ``cosf``/``sinf``.
    """
    half = config.rope_dim // 2
    theta_scale = np.float32(np.float64(config.rope_theta) ** (-2.0 / config.rope_dim))
    freq_scale = np.float32(1.0 / config.rope_scaling.factor) if config.rope_scaling is not None else np.float32(1.0)
    factors = (
        freq_factors.numpy().astype(np.float32) if freq_factors is not None else np.ones(half, dtype=np.float32)
    )
    theta = np.arange(config.context_length, dtype=np.float32)  # (P,)
    angles = np.empty((config.context_length, half), dtype=np.float32)
    for i in range(half):
        angles[:, i] = freq_scale * (theta / factors[i])
        theta = theta * theta_scale
    # cosf/sinf of an fp32 angle, correctly rounded (glibc's are within an ulp of that).
    cos = torch.from_numpy(np.cos(angles.astype(np.float64)).astype(np.float32))
    sin = torch.from_numpy(np.sin(angles.astype(np.float64)).astype(np.float32))
    return cos, sin


class LlamaCppDecoderLayer(LlamaDecoderLayer):
    """:class:`LlamaDecoderLayer` computing as llama.cpp's CPU backend does (fp32 weights only)."""

    #: Set by :func:`attach_llamacpp_numerics`; a layer without them multiplies in plain fp32.
    numerics: LlamaCppNumerics = LlamaCppNumerics()
    qkv_linear: LinearNumerics | None = None
    o_linear: LinearNumerics | None = None
    gate_up_linear: LinearNumerics | None = None
    down_linear: LinearNumerics | None = None

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        if self.numerics.ggml_rms_norm:
            return ggml_rms_norm(x, weight, self.rms_eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.rms_eps)

    @staticmethod
    def _linear(numerics: LinearNumerics | None, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return F.linear(x, weight, bias) if numerics is None else numerics(x, weight, bias)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext, layer_idx: int
    ) -> Tensor:
        """x: (T, hidden) residual stream → (T, hidden); cos/sin: (T, 1, head_dim/2)."""
        num_tokens = x.shape[0]
        heads_qk = self.num_heads + self.num_kv_heads
        h = self._norm(x, self.attn_norm)  # (T, hidden)
        qkv = self._linear(self.qkv_linear, h, self.qkv_proj, self.qkv_bias)  # (T, q_size + 2 kv_size)
        qkv = qkv.view(num_tokens, heads_qk + self.num_kv_heads, self.head_dim)
        qk = apply_rotary(qkv[:, :heads_qk], cos, sin)  # (T, n_heads + n_kv_heads, head_dim)
        v = qkv[:, heads_qk:]
        if self.numerics.f16_kv:
            # F16 KV cache; ggml also converts q to F16 (the vec_dot type of the F16 K).
            qk, v = _round_f16(qk), _round_f16(v)
        out = attn.forward(layer_idx, qk[:, : self.num_heads], qk[:, self.num_heads :], v)
        # ggml adds the residual after the full product (no addmm: its rounding differs).
        x = x + self._linear(self.o_linear, out.reshape(num_tokens, self.q_size), self.o_proj)
        h = self._norm(x, self.ffn_norm)
        gate, up = self._linear(self.gate_up_linear, h, self.gate_up_proj).chunk(2, dim=-1)  # (T, inter)
        return x + self._linear(self.down_linear, F.silu(gate) * up, self.down_proj)  # (T, hidden)


class LlamaCppModel(LlamaModel):
    """:class:`LlamaModel` with llama.cpp's CPU numerics; build it with ``load_model(..., numerics="llamacpp")``.

    Same signature and outputs as :class:`LlamaModel`, so any attention context works; only
    :class:`LlamaCppAttention` also rounds the softmax probabilities to F16 as ggml does.
    """

    decoder_layer_class = LlamaCppDecoderLayer
    layers: nn.ModuleList
    #: Set by :func:`attach_llamacpp_numerics`.
    numerics: LlamaCppNumerics = LlamaCppNumerics()
    lm_head_linear: LinearNumerics | None = None

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn: AttentionContext,
        *,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """See :meth:`LlamaModel.forward`: (T,) ids and positions → fp32 logits (N or T, vocab)."""
        x = F.embedding(input_ids, self.embed_tokens)  # (T, hidden)
        cos, sin = self.rotary.lookup(positions)  # (T, 1, head_dim/2) each
        for layer_idx, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn, layer_idx)
        if logits_indices is not None:
            x = x[logits_indices]  # (N, hidden)
        if self.numerics.ggml_rms_norm:
            x = ggml_rms_norm(x, self.norm, self.config.rms_eps)
        else:
            x = F.rms_norm(x, (x.shape[-1],), self.norm, self.config.rms_eps)
        if self.lm_head_linear is None:
            return F.linear(x, self.lm_head).float()
        return self.lm_head_linear(x, self.lm_head).float()  # (N, vocab)


class LlamaCppAttention(ContiguousAttention):
    """:class:`ContiguousAttention` that rounds the softmax probabilities to F16 before ``V p``.

    ggml (flash attention off) computes ``softmax(scale * K q + mask)`` in fp32 and multiplies
    the F16 V cache by the probabilities converted to F16. q, k, v arrive already rounded to
    F16 by :class:`LlamaCppModel`.
    """

    def __init__(self, num_layers: int, *, initial_capacity: int = 256, f16_probs: bool = True) -> None:
        super().__init__(num_layers, initial_capacity=initial_capacity)
        self.f16_probs = f16_probs

    def forward(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """See :class:`~core_engine.attention.AttentionContext`; one cached sequence."""
        num_new, num_heads, head_dim = q.shape
        keys, values = self._append(layer_idx, k, v)  # (S, n_kv_heads, head_dim)
        num_total, num_kv_heads = keys.shape[0], keys.shape[1]
        group = num_heads // num_kv_heads
        q_ = q.reshape(num_new, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # (n_kv, G, T, D)
        k_ = keys.permute(1, 2, 0).unsqueeze(1)  # (n_kv, 1, D, S)
        v_ = values.transpose(0, 1).unsqueeze(1)  # (n_kv, 1, S, D)
        scores = torch.matmul(q_, k_) * head_dim**-0.5  # (n_kv, G, T, S)
        if num_new > 1:
            rows = torch.arange(num_new, device=q.device).unsqueeze(1) + (num_total - num_new)
            future = torch.arange(num_total, device=q.device).unsqueeze(0) > rows  # (T, S)
            scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.f16_probs:
            probs = _round_f16(probs)
        out = torch.matmul(probs, v_)  # (n_kv, G, T, D)
        return out.permute(2, 0, 1, 3).reshape(num_new, num_heads, head_dim)


def _q4_1_minimums(gguf_file: GGUFFile, name: str) -> Tensor:
    """The fp16 ``m`` of every Q4_1 block of tensor ``name`` → (rows, K/32) fp32."""
    tensor = gguf_file.tensor(name)
    raw = np.asarray(tensor.data).reshape(-1).view(np.uint8).reshape(-1, 20)  # d f16 | m f16 | qs[16]
    minimums = torch.from_numpy(np.ascontiguousarray(raw[:, 2:4]).view(np.float16).astype(np.float32))
    rows = int(np.prod([int(n) for n in tensor.shape.tolist()[1:]]))
    return minimums.view(rows, -1)


def _segment(gguf_file: GGUFFile, name: str, num_heads: int | None = None) -> tuple[int, str, Tensor | None]:
    from core_engine.gguf_loader import _unpermute_rope_rows

    qtype = gguf_file.tensor_type(name)
    rows = int(gguf_file.tensor(name).shape[-1])  # GGUF lists ne0 (K) first
    minimums = None
    if qtype == Q.Q4_1:
        minimums = _q4_1_minimums(gguf_file, name)
        if num_heads is not None:  # q/k rows were un-permuted at load: permute their m alike
            minimums = _unpermute_rope_rows(minimums, num_heads).contiguous()
    return rows, VEC_DOT_TYPE[qtype], minimums


def _merge(segments: list[tuple[int, str, Tensor | None]]) -> LinearNumerics:
    """Fuse adjacent segments of the same type (one matmul instead of several)."""
    merged: list[tuple[int, str, Tensor | None]] = []
    for rows, kind, minimums in segments:
        if merged and merged[-1][1] == kind:
            prev_rows, _, prev_min = merged[-1]
            both = None if prev_min is None or minimums is None else torch.cat((prev_min, minimums))
            merged[-1] = (prev_rows + rows, kind, both)
        else:
            merged.append((rows, kind, minimums))
    return LinearNumerics(merged)


def attach_llamacpp_numerics(
    model: LlamaCppModel, gguf_file: GGUFFile, numerics: LlamaCppNumerics | None = None
) -> None:
    """Give a loaded :class:`LlamaCppModel` the per-weight formats and Q4_1 minimums of its file."""
    numerics = numerics or LlamaCppNumerics()
    cfg = model.config
    model.numerics = numerics
    freq_factors = gguf_file.dequantized("rope_freqs.weight") if gguf_file.has_tensor("rope_freqs.weight") else None
    if numerics.ggml_rope:
        cos, sin = ggml_rope_tables(cfg, freq_factors)
    else:
        reference = RotaryEmbedding(cfg, dtype=torch.float32, freq_factors=freq_factors)
        cos, sin = reference.cos, reference.sin
    model.rotary.cos.copy_(cos)
    model.rotary.sin.copy_(sin)
    if not numerics.quantize_activations:
        model.lm_head_linear = None
    else:
        head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
        model.lm_head_linear = _merge([_segment(gguf_file, head)])
    for idx, layer in enumerate(model.layers):
        assert isinstance(layer, LlamaCppDecoderLayer)
        layer.numerics = numerics
        if not numerics.quantize_activations:
            layer.qkv_linear = layer.o_linear = layer.gate_up_linear = layer.down_linear = None
            continue
        p = f"blk.{idx}."
        layer.qkv_linear = _merge([
            _segment(gguf_file, p + "attn_q.weight", cfg.num_heads),
            _segment(gguf_file, p + "attn_k.weight", cfg.num_kv_heads),
            _segment(gguf_file, p + "attn_v.weight"),
        ])
        layer.o_linear = _merge([_segment(gguf_file, p + "attn_output.weight")])
        layer.gate_up_linear = _merge([_segment(gguf_file, p + "ffn_gate.weight"), _segment(gguf_file, p + "ffn_up.weight")])
        layer.down_linear = _merge([_segment(gguf_file, p + "ffn_down.weight")])

"""Opt-in "llama.cpp numerics": reproduce llama.cpp's x86 CPU arithmetic on a GGUF file.

The default ("exact") engine multiplies exactly dequantised weights by fp32/bf16 activations.
llama.cpp's CPU backend (ggml) does not: before each matrix product it rounds the *input
activations* to the weight type's "vec_dot" type (Q8_1 for Q4_1 weights, Q8_0 for Q8_0/Q4_0,
F16/BF16 for F16/BF16) and multiplies in integer blocks; it keeps the KV cache in F16 and
feeds F16 q and softmax probabilities to the attention products. Those roundings make the
output a discontinuous function of the arithmetic, so an emulation that is right "up to fp32
rounding" still drifts as far from llama.cpp as exact arithmetic does (see
:mod:`core_engine.model.ggml_ops`). ``load_model(path, numerics="llamacpp")`` therefore builds
a :class:`LlamaCppModel` that computes every step with the same bits as ggml on x86 AVX512:

* RMSNorm, SwiGLU (ggml's ``expf`` polynomial), RoPE (fp32 angle recurrence, the C library's
  ``cosf``/``sinf``, FMA-contracted rotation), residual adds;
* Q8_0/Q8_1 activation quantisation and the block dot products in the order of the kernel
  llama.cpp picks (vec_dot/tinyBLAS lanes, or the repacked Q4_0 GEMM), F32/F16/BF16 weights
  in tinyBLAS's or ``ggml_vec_dot_*``'s order;
* F16 K/V/q/probabilities, ggml's softmax and the attention products in tinyBLAS's (prompt)
  or ``ggml_vec_dot_f16``'s (single token) order, in :class:`LlamaCppAttention`; any other
  attention context gets F16-rounded q/k/v but computes attention its own way.

Checked against llama.cpp's intermediate tensors op by op and end to end (logits identical on
SmolLM2 Q4_1 and on tiny models of every supported type; see ``docs/core-engine-model.md``).
It runs in fp32 at ~100x the exact path's prefill cost: an oracle tool, not a serving mode.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from torch import Tensor, nn

from core_engine.attention import DEFAULT, AttentionContext, ContiguousAttention, LayerAttention
from core_engine.model import ggml_ops as G
from core_engine.model.config import LlamaConfig
from core_engine.model.llama import LlamaDecoderLayer, LlamaModel

if TYPE_CHECKING:
    from core_engine.gguf_loader import GGUFFile

__all__ = [
    "NUMERICS",
    "LinearNumerics",
    "LlamaCppAttention",
    "LlamaCppDecoderLayer",
    "LlamaCppModel",
    "attach_llamacpp_numerics",
    "ggml_rope_tables",
]

#: Accepted values of ``load_model(..., numerics=)``.
NUMERICS = ("exact", "llamacpp")

#: ggml's ``vec_dot_type`` per weight type: the format the input activations are converted to.
VEC_DOT_TYPE: dict[Q, str] = {
    Q.F32: "f32", Q.F16: "f16", Q.BF16: "bf16", Q.Q8_0: "q8_0", Q.Q4_0: "q8_0", Q.Q4_1: "q8_1",
}
_BLOCK_BYTES = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}


def _round_f16(x: Tensor) -> Tensor:
    return x.to(torch.float16).to(x.dtype)


class _Segment:
    """Consecutive rows of a (fused) weight with one GGML type.

    For block types: ``lanes`` (K/width, width, rows) fp32 quants grouped as the kernel's
    lanes (Q4_0 already minus 8), ``scales`` and ``minimums`` (rows, K/32) fp16 values
    (``minimums`` only for Q4_1). ``lane_width`` is 4 for ggml's vec_dot/tinyBLAS kernels and
    32 for the repacked Q4_0 kernels llama.cpp uses for layer weights on AVX2 CPUs.
    """

    def __init__(
        self,
        rows: int,
        kind: str,
        lanes: Tensor | None = None,
        scales: Tensor | None = None,
        minimums: Tensor | None = None,
        lane_width: int = 4,
    ) -> None:
        self.rows, self.kind, self.lanes, self.scales, self.minimums = rows, kind, lanes, scales, minimums
        self.lane_width = lane_width


class LinearNumerics:
    """How llama.cpp multiplies by one (possibly fused) weight: one :class:`_Segment` per type."""

    def __init__(self, segments: list[_Segment]) -> None:
        self.segments = segments

    def __call__(self, x: Tensor, weight: Tensor) -> Tensor:
        """x (T, K) fp32 @ weight (N, K).T → (T, N) as ggml computes it."""
        outs: list[Tensor] = []
        quantized: dict[str, tuple[Tensor, Tensor, Tensor | None]] = {}
        start = 0
        for seg in self.segments:
            if seg.lanes is None:  # F32/F16/BF16 weights
                outs.append(_float_linear(x, weight[start : start + seg.rows], seg.kind))
            else:
                if seg.kind not in quantized:
                    quantized[seg.kind] = G.quantize_q8_blocks(x, with_sum=seg.kind == "q8_1")
                qx, dx, sx = quantized[seg.kind]
                assert seg.scales is not None
                outs.append(
                    G.q8_lane_dot(qx, dx, seg.lanes, seg.scales, sx=sx, mw=seg.minimums, lane_width=seg.lane_width)
                )
            start += seg.rows
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _float_linear(x: Tensor, weight: Tensor, kind: str) -> Tensor:
    """x (T, K) @ weight (N, K).T for F32/F16/BF16 weights in ggml's order.

    ggml rounds x to the weight's type, then tinyBLAS serves T >= 2 when N % 4 == 0 and
    K % 16 == 0, ``ggml_vec_dot_*`` the rest (emulated when K is a multiple of their width;
    otherwise torch's matmul, off by fp32 rounding).
    """
    num_tokens, k = x.shape
    xr = {"f16": _round_f16, "bf16": lambda t: t.to(torch.bfloat16).to(t.dtype)}.get(kind, lambda t: t)(x)
    if num_tokens >= 2 and weight.shape[0] % 4 == 0 and k % 16 == 0:
        return G.tinyblas_dot(xr, weight)
    if kind == "bf16" and k % 32 == 0:
        return G.vec_dot_bf16(xr, weight)
    if kind == "f16" or (kind == "f32" and k % 64 == 0):
        return G.vec_dot_4x16(xr, weight)
    return xr @ weight.t()


@cache
def _libm() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("m"))
    for fn in (lib.cosf, lib.sinf):
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return lib


def ggml_rope_tables(config: LlamaConfig, freq_factors: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin (positions, D/2) fp32 exactly as ggml's ``rope_cache_init`` computes them.

    ``theta = p``, multiplied by ``theta_scale = powf(base, -2/D)`` in fp32 for each pair,
    divided by the frequency factor, times ``1/factor`` for linear scaling; then the C
    library's ``cosf``/``sinf`` (numpy's and torch's differ from glibc in the last bit).
    """
    half = config.rope_dim // 2
    theta_scale = np.float32(np.float64(config.rope_theta) ** (-2.0 / config.rope_dim))  # correctly rounded powf
    freq_scale = np.float32(1.0) / np.float32(config.rope_scaling.factor) if config.rope_scaling else np.float32(1.0)
    factors = freq_factors.numpy().astype(np.float32) if freq_factors is not None else np.ones(half, np.float32)
    theta = np.arange(config.context_length, dtype=np.float32)
    angles = np.empty((config.context_length, half), dtype=np.float32)
    for i in range(half):
        angles[:, i] = freq_scale * (theta / factors[i])
        theta = theta * theta_scale
    libm = _libm()
    flat = angles.reshape(-1).tolist()
    cos = torch.tensor([libm.cosf(a) for a in flat], dtype=torch.float32).view(angles.shape)
    sin = torch.tensor([libm.sinf(a) for a in flat], dtype=torch.float32).view(angles.shape)
    return cos, sin


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """ggml's rotation with GCC's FMA contraction: ``fma(x0, c, -(x1 s))``, ``fma(x0, s, x1 c)``.

    x (T, n, D) in rotate-half order (pairs ``(i, i + D/2)``); cos/sin (T, 1, D/2).
    """
    x0, x1 = x.chunk(2, dim=-1)
    return torch.cat((G.fma(x0, cos, -(x1 * sin)), G.fma(x0, sin, x1 * cos)), dim=-1)


class LlamaCppDecoderLayer(LlamaDecoderLayer):
    """:class:`LlamaDecoderLayer` computing with ggml's bits (fp32 weights only)."""

    #: Set by :func:`attach_llamacpp_numerics`; a layer without them multiplies with torch.
    qkv_linear: LinearNumerics | None = None
    o_linear: LinearNumerics | None = None
    gate_up_linear: LinearNumerics | None = None
    down_linear: LinearNumerics | None = None

    @staticmethod
    def _linear(numerics: LinearNumerics | None, x: Tensor, weight: Tensor) -> Tensor:
        return x @ weight.t() if numerics is None else numerics(x, weight)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext, layer_idx: int
    ) -> Tensor:
        """x: (T, hidden) residual stream → (T, hidden); cos/sin: (T, 1, head_dim/2)."""
        num_tokens = x.shape[0]
        heads_qk = self.num_heads + self.num_kv_heads
        h = G.rms_norm(x, self.attn_norm, self.rms_eps)  # (T, hidden)
        qkv = self._linear(self.qkv_linear, h, self.qkv_proj)  # (T, q_size + 2 kv_size)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        qkv = qkv.view(num_tokens, heads_qk + self.num_kv_heads, self.head_dim)
        # F16 KV cache; ggml also converts q to F16 (the vec_dot type of the F16 K).
        qk = _round_f16(_rope(qkv[:, :heads_qk], cos, sin))  # (T, n_heads + n_kv_heads, head_dim)
        v = _round_f16(qkv[:, heads_qk:])
        out = attn.forward(layer_idx, qk[:, : self.num_heads], qk[:, self.num_heads :], v)
        x = x + self._linear(self.o_linear, out.reshape(num_tokens, self.q_size), self.o_proj)
        h = G.rms_norm(x, self.ffn_norm, self.rms_eps)
        gate, up = self._linear(self.gate_up_linear, h, self.gate_up_proj).chunk(2, dim=-1)  # (T, inter)
        return x + self._linear(self.down_linear, G.swiglu(gate, up), self.down_proj)  # (T, hidden)


class LlamaCppModel(LlamaModel):
    """:class:`LlamaModel` with llama.cpp's CPU numerics; build it with ``load_model(..., numerics="llamacpp")``.

    Same signature and outputs as :class:`LlamaModel`, so any attention context works, but only
    :class:`LlamaCppAttention` reproduces ggml's attention arithmetic.
    """

    decoder_layer_class = LlamaCppDecoderLayer
    layers: nn.ModuleList
    #: Set by :func:`attach_llamacpp_numerics`.
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
        x = G.rms_norm(x, self.norm, self.config.rms_eps)
        if self.lm_head_linear is None:
            return x @ self.lm_head.t()
        return self.lm_head_linear(x, self.lm_head)  # (N, vocab)


@cache
def _interleaved_order(head_dim: int, device: torch.device) -> Tensor:
    """Index map from GGUF order (pair members at ``2i, 2i+1``) to rotate-half (``i, i + D/2``)."""
    return torch.arange(head_dim, device=device).view(2, head_dim // 2).t().reshape(-1)


class LlamaCppAttention(ContiguousAttention):
    """:class:`ContiguousAttention` with ggml's attention arithmetic (flash attention off).

    ``softmax(scale * K q + mask)`` with ggml's softmax, the F16 V cache multiplied by the
    probabilities converted to F16; both products in tinyBLAS's 16-lane F16 order for a batch
    of tokens, in ``ggml_vec_dot_f16``'s order for a single token. q, k, v arrive rounded to
    F16 by :class:`LlamaCppModel`.
    """

    def forward(
        self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, spec: LayerAttention | None = None
    ) -> Tensor:
        """See :class:`~core_engine.attention.AttentionContext`; one cached sequence.

        Only Llama's attention (``spec`` None or the default): this emulates ggml's arithmetic
        for the ``llama`` arch, whose layers pass no spec.
        """
        if spec is not None and spec != DEFAULT:
            unsupported = [name for name in ("scale", "window", "softcap") if getattr(spec, name) is not None]
            raise NotImplementedError(f"LlamaCppAttention emulates Llama's attention only, not {', '.join(unsupported)}")
        num_new, num_heads, head_dim = q.shape
        keys, values = self._append(layer_idx, k, v)  # (S, n_kv_heads, head_dim)
        num_total, num_kv_heads = keys.shape[0], keys.shape[1]
        # llamafile's tinyBLAS serves batches of 2+ tokens, ggml_vec_dot_f16 single tokens;
        # the key axis is padded with masked cells (zeros change no sum) to their width.
        dot = G.tinyblas_dot if num_new > 1 else G.vec_dot_4x16
        padded = -(-num_total // 64) * 64
        group = num_heads // num_kv_heads
        # ggml sums q.k over head dims in the GGUF row order (rotation pairs adjacent): the
        # 16 lanes see different elements than in our rotate-half order.
        order = _interleaved_order(head_dim, q.device)
        k_ = F.pad(keys[..., order], (0, 0, 0, 0, 0, padded - num_total)).permute(1, 0, 2)  # (n_kv, Sp, D)
        v_ = F.pad(values, (0, 0, 0, 0, 0, padded - num_total)).permute(1, 2, 0)  # (n_kv, D, Sp)
        q_ = q[..., order].permute(1, 0, 2)  # (H, T, D)
        scores = dot(q_, k_.repeat_interleave(group, dim=0))  # (H, T, Sp)
        rows = torch.arange(num_new).unsqueeze(1) + (num_total - num_new)
        mask = torch.zeros(num_new, padded).masked_fill(torch.arange(padded).unsqueeze(0) > rows, float("-inf"))
        scale = float(np.float32(1.0) / np.sqrt(np.float32(head_dim)))  # 1.0f/sqrtf(head_dim)
        probs = _round_f16(G.soft_max(scores, scale, mask))
        out = dot(probs, v_.repeat_interleave(group, dim=0))  # (H, T, D)
        return out.permute(1, 0, 2)  # (T, H, D)


def _segment(
    gguf_file: GGUFFile, name: str, num_heads: int | None = None, *, repackable: bool = True
) -> _Segment:
    """Read tensor ``name``'s blocks (rows un-permuted like the loader's q/k rows).

    ``repackable``: llama.cpp may repack it (a matmul-only weight, not the token embedding).
    """
    from core_engine.gguf_loader import _unpermute_rope_rows

    qtype = gguf_file.tensor_type(name)
    tensor = gguf_file.tensor(name)
    rows = int(np.prod([int(n) for n in tensor.shape.tolist()[1:]]))  # GGUF lists ne0 (K) first
    if qtype not in _BLOCK_BYTES:
        return _Segment(rows, VEC_DOT_TYPE[qtype])
    raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
    blocks = torch.from_numpy(raw.copy()).view(rows, -1, _BLOCK_BYTES[qtype])  # (N, nb, bytes)
    scales = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)  # (N, nb)
    minimums = None
    if qtype == Q.Q8_0:
        quants = blocks[..., 2:].contiguous().view(torch.int8).float()
    else:
        qs = blocks[..., 4:] if qtype == Q.Q4_1 else blocks[..., 2:]
        quants = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()  # low nibbles = weights 0..15
        if qtype == Q.Q4_0:
            quants = quants - 8.0
        else:
            minimums = blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    if num_heads is not None:
        quants, scales = _unpermute_rope_rows(quants, num_heads), _unpermute_rope_rows(scales, num_heads)
        minimums = None if minimums is None else _unpermute_rope_rows(minimums, num_heads)
    # llama.cpp repacks Q4_0 matmul weights with a multiple of 8 rows into q4_0_8x8 blocks on
    # AVX2 CPUs; those kernels sum each block in integers (one lane of 32).
    width = 32 if qtype == Q.Q4_0 and repackable and rows % 8 == 0 else 4
    lanes = quants.reshape(rows, -1, width).permute(1, 2, 0).contiguous()  # (K/width, width, N)
    return _Segment(rows, VEC_DOT_TYPE[qtype], lanes, scales.contiguous(), minimums, width)


def _merge(segments: list[_Segment]) -> LinearNumerics:
    """Fuse adjacent segments of the same type (one kernel call instead of several)."""
    merged: list[_Segment] = []
    for seg in segments:
        prev = merged[-1] if merged else None
        if (
            prev is not None
            and (prev.kind, prev.lane_width) == (seg.kind, seg.lane_width)
            and (prev.lanes is None) == (seg.lanes is None)
        ):
            if seg.lanes is not None:
                assert prev.lanes is not None and prev.scales is not None and seg.scales is not None
                prev.lanes = torch.cat((prev.lanes, seg.lanes), dim=-1)
                prev.scales = torch.cat((prev.scales, seg.scales))
                if prev.minimums is not None and seg.minimums is not None:
                    prev.minimums = torch.cat((prev.minimums, seg.minimums))
            prev.rows += seg.rows
        else:
            merged.append(seg)
    return LinearNumerics(merged)


def attach_llamacpp_numerics(model: LlamaCppModel, gguf_file: GGUFFile) -> None:
    """Give a loaded :class:`LlamaCppModel` its file's blocks, formats and ggml's RoPE tables."""
    cfg = model.config
    freq_factors = gguf_file.dequantized("rope_freqs.weight") if gguf_file.has_tensor("rope_freqs.weight") else None
    cos, sin = ggml_rope_tables(cfg, freq_factors)
    model.rotary.cos.copy_(cos)
    model.rotary.sin.copy_(sin)
    head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    model.lm_head_linear = _merge([_segment(gguf_file, head, repackable=not cfg.tie_word_embeddings)])
    for idx, layer in enumerate(model.layers):
        assert isinstance(layer, LlamaCppDecoderLayer)
        p = f"blk.{idx}."
        layer.qkv_linear = _merge([
            _segment(gguf_file, p + "attn_q.weight", cfg.num_heads),
            _segment(gguf_file, p + "attn_k.weight", cfg.num_kv_heads),
            _segment(gguf_file, p + "attn_v.weight"),
        ])
        layer.o_linear = _merge([_segment(gguf_file, p + "attn_output.weight")])
        layer.gate_up_linear = _merge([_segment(gguf_file, p + "ffn_gate.weight"), _segment(gguf_file, p + "ffn_up.weight")])
        layer.down_linear = _merge([_segment(gguf_file, p + "ffn_down.weight")])

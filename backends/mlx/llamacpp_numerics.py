"""Opt-in ``numerics="llamacpp"``: MLX computing what llama.cpp's x86 CPU backend computes.

By default (``"exact"``) MLX multiplies the exactly dequantized weights by float32
activations. llama.cpp's CPU backend (ggml) does not: before each quantized matrix product
it rounds the *input activations* to 8-bit blocks (Q8_1 for Q4_1 weights, Q8_0 for Q8_0 and
Q4_0) and multiplies in integer blocks; it keeps the KV cache in float16 and feeds float16 q
and softmax probabilities to the attention products. With 8-bit activations the output is a
discontinuous function of the arithmetic: a 1-ulp difference moves some activation across a
rounding boundary, which perturbs the next layer by 1/127 of a block's range, which moves
many more, so rounding "like ggml" with MLX's own kernels drifts from llama.cpp as far as
exact arithmetic does. This mode therefore reproduces ggml's bits inside every layer, as the
core engine's torch oracle does (:mod:`core_engine.model.llamacpp_numerics`, whose
``ggml_ops`` document each kernel): RMSNorm, RoPE tables and rotation, the Q8 activation
blocks and the block dot products in the kernels' fp32 lane order (fused multiply-adds
emulated in float64), float16 q/k/v, ggml's softmax and ``expf``, and the attention products
in tinyBLAS's (several tokens) or ``ggml_vec_dot_f16``'s (one token) order. The LM head gets
the 8-bit input rounding but MLX's own sum order: nothing rounds after it, so its logits
differ from llama.cpp's by float32 rounding only.

It emulates ggml's x86 AVX512 kernels of llama-cpp-python 0.3.36 for Llama models with
Q4_0/Q4_1/Q8_0 matrices (any other float matrix is multiplied by MLX as in exact mode). It
computes in float32 and float64 on the CPU (Metal has no float64) and is several times
slower than exact mode: a tool for comparing with llama.cpp, not a fast path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGMLQuantizationType
from mlx_lm.models import llama

__all__ = ["NUMERICS", "Numerics", "use_llamacpp_numerics"]

#: Accepted values of ``numerics`` (``load_gguf_model``, the backend's option).
Numerics = Literal["exact", "llamacpp"]
NUMERICS: tuple[Numerics, ...] = ("exact", "llamacpp")

_F16, _F32, _F64 = mx.float16, mx.float32, mx.float64
_Method = TypeVar("_Method", bound=Callable[..., Any])
#: Elements of the float64 lane products computed at once (32 MiB).
_CHUNK_ELEMENTS = 1 << 22
#: Query rows whose attention is computed at once.
_QUERY_ROWS = 64


def _on_cpu(method: _Method) -> _Method:
    """Run ``method``'s MLX operations on the CPU: Metal has no float64."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with mx.stream(mx.cpu):
            return method(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _fma(a: mx.array, b: mx.array, c: mx.array) -> mx.array:
    """fp32 ``a*b + c`` with one rounding (``_mm*_fmadd_ps``): the product is exact in float64.

    Rounding the float64 sum to fp32 differs from one rounding only when it lands exactly on
    an fp32 midpoint (~2^-29 of the time).
    """
    return (a.astype(_F64) * b.astype(_F64) + c.astype(_F64)).astype(_F32)


def _round_f16(x: mx.array) -> mx.array:
    return x.astype(_F16).astype(_F32)


def _f32(value: float | str) -> mx.array:
    return mx.array(float.fromhex(value) if isinstance(value, str) else value, dtype=_F32)


# ggml_v_expf (vec.h, AVX512 path): Arm's optimized-routines expf.
_EXP_SHIFT = _f32("0x1.8p23")
_EXP_LOG2E = _f32("0x1.715476p+0")
_EXP_LN2_HI = _f32("0x1.62e4p-1")
_EXP_LN2_LO = _f32("0x1.7f7d1cp-20")
_EXP_C = [_f32(h) for h in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2")]
_EXP_C4 = _f32("0x1.ffffecp-1")
_ONE = _f32(1.0)
_TWO = mx.array(2.0, dtype=_F64)


def ggml_expf(x: mx.array) -> mx.array:
    """``ggml_v_expf`` bit for bit (fp32 in and out; overflow to inf, underflow to 0)."""
    z = _fma(x, _EXP_LOG2E, _EXP_SHIFT)
    n = z - _EXP_SHIFT
    b = _fma(-n, _EXP_LN2_LO, _fma(-n, _EXP_LN2_HI, x))  # fnmadd(a, b, c) = c - a*b
    u = b * b
    c0, c1, c2, c3 = _EXP_C
    j = _fma(_fma(_fma(c0, b, c1), u, _fma(c2, b, c3)), u, _fma(_EXP_C4, b, _ONE))
    res = (j.astype(_F64) * mx.power(_TWO, n.astype(_F64))).astype(_F32)  # scalef(j, n)
    # |n| > 192: 0 for large negative inputs (and -inf), inf for large positive ones.
    return mx.where(mx.abs(n) > 192, mx.where(n <= 0, 0.0, mx.inf), res)


def _reduce_add_16(acc: mx.array) -> mx.array:
    """``_mm512_reduce_add_ps`` over the last axis (16 lanes) as GCC expands it."""
    t = acc[..., 8:] + acc[..., :8]
    t = t[..., 4:] + t[..., :4]
    t = t[..., :2] + t[..., 2:]
    return t[..., 0] + t[..., 1]


def _hsum_8(acc: mx.array) -> mx.array:
    """``hsum_float_8`` over axis 0 (8 lanes): high + low half, then movehl, then movehdup."""
    r = acc[4:] + acc[:4]
    r = r[:2] + r[2:]
    return r[0] + r[1]


# -- norms and activations ----------------------------------------------------------------


class GGMLRMSNorm(nn.Module):
    """ggml's ``rms_norm`` then ``mul``: squares summed in float64, ``1.0f/sqrtf(mean + eps)``."""

    def __init__(self, norm: nn.RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    @_on_cpu
    def __call__(self, x: mx.array) -> mx.array:
        total = (x * x).astype(_F64).sum(axis=-1, keepdims=True)
        mean = (total / x.shape[-1]).astype(_F32)
        scale = 1.0 / mx.sqrt(mean + _f32(self.eps))  # IEEE sqrt and division, as in C
        return (x * scale) * self.weight


class GGMLMLP(nn.Module):
    """SwiGLU as ``ggml_vec_swiglu_f32``: ``gate / (1 + expf(-gate)) * up`` with ggml's expf."""

    def __init__(self, mlp: llama.MLP) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    @_on_cpu
    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_proj(x), self.up_proj(x)
        silu = gate / (ggml_expf(0.0 - gate) + _ONE)
        return self.down_proj(silu * up)


# -- quantized matrix products ------------------------------------------------------------


def quantize_q8_blocks(x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """ggml's x86 ``quantize_row_q8_1`` (Q8_0 is the same without the sums) over the last axis.

    x (..., K) fp32 → quants (..., K/32, 32) (exact small integers in fp32), the fp16 scale
    ``d = amax/127`` (..., K/32) and the Q8_1 block sums ``s = fp16(d_fp32 * sum(q))``.
    """
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = mx.abs(blocks).max(axis=-1)
    d = amax / 127.0
    inv = mx.where(amax != 0, 127.0 / amax, 0.0)
    q = mx.round(blocks * inv[..., None])  # half to even, like _mm256_round_ps
    return q, _round_f16(d), _round_f16(d * q.sum(axis=-1))


def _rounded_input_product(
    x: mx.array,
    product: Callable[[mx.array], mx.array],
    ggml_type: GGMLQuantizationType,
    minimums: mx.array,
) -> mx.array:
    """``product`` (MLX's own quantized matmul) of ``x`` rounded to ggml's 8-bit blocks.

    For Q4_1 weights ggml adds each block minimum times the stored Q8_1 sum ``s``, not times
    ``d * sum(q)`` as the dequantized product does: the difference is added back.
    """
    q, d, s = quantize_q8_blocks(x.astype(_F32))
    y = product((q * d[..., None]).reshape(x.shape))
    if ggml_type == GGMLQuantizationType.Q4_1:
        y = y + (s - d * q.sum(axis=-1)) @ minimums.T
    return y


#: ggml's stored quant = MLX's unsigned quant minus this, per weight type.
_QUANT_OFFSET = {
    GGMLQuantizationType.Q4_0: 8,
    GGMLQuantizationType.Q4_1: 0,
    GGMLQuantizationType.Q8_0: 128,
}


class GGMLQuantizedLinear(nn.QuantizedLinear):
    """A Q4_0/Q4_1/Q8_0 ``QuantizedLinear`` multiplying like ggml's block dot products.

    The input goes to Q8_1 (Q4_1 weights) or Q8_0 blocks; each output is then, as in
    ``ggml_vec_dot_q4_1_q8_1`` / ``q8_0_q8_0`` / ``q4_0_q8_0`` (AVX2 body), 8 fp32 lanes of
    4 integer products, ``acc = fma(d_w*d_x, lane, acc)`` block after block,
    ``hsum_float_8``, then for Q4_1 ``+ sum_b m_w*s_x`` accumulated in block order. Q4_0
    weights with a multiple of 8 rows are the ones llama.cpp repacks into ``q4_0_8x8``
    blocks, whose kernels sum each block in integers first (one lane of 32).

    ``exact_order=False`` (the LM head) keeps the 8-bit input rounding but lets MLX sum the
    dequantized products: its logits then differ by fp32 rounding only, for a fraction of
    the cost.
    """

    def __init__(
        self,
        layer: nn.QuantizedLinear,
        ggml_type: GGMLQuantizationType,
        *,
        exact_order: bool = True,
    ) -> None:
        # Adopt ``layer``'s packed weights rather than QuantizedLinear's random ones.
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = layer.group_size, layer.bits, layer.mode
        self.weight, self.scales, self.biases = layer.weight, layer.scales, layer.biases
        if "bias" in layer:
            self.bias = layer.bias
        self.ggml_type = ggml_type
        self.exact_order = exact_order
        rows = self.scales.shape[0]
        repacked = ggml_type == GGMLQuantizationType.Q4_0 and rows % 8 == 0
        self.lane_width = 32 if repacked else 4
        if exact_order:
            # ggml's integer quants by block and lane: (K/32, 32/lane_width, lane_width, N).
            ones, zeros = mx.ones_like(self.scales), mx.zeros_like(self.scales)
            unsigned = mx.dequantize(
                self.weight, ones, zeros, group_size=self.group_size, bits=self.bits
            )
            quants = (unsigned - _QUANT_OFFSET[ggml_type]).astype(mx.int8)
            lanes = quants.reshape(rows, -1, 32 // self.lane_width, self.lane_width)
            self._lanes = lanes.transpose(1, 2, 3, 0)
            mx.eval(self._lanes)  # now, not during the first request
        self.freeze()

    @_on_cpu
    def __call__(self, x: mx.array) -> mx.array:
        if not self.exact_order:
            return _rounded_input_product(x, super().__call__, self.ggml_type, self["biases"])
        q, d, s = quantize_q8_blocks(x.astype(_F32))
        y = self._block_dot(q.reshape(-1, *q.shape[-2:]), d.reshape(-1, d.shape[-1]), s)
        if "bias" in self:
            y = y + self["bias"]
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _block_dot(self, q: mx.array, d: mx.array, s: mx.array) -> mx.array:
        """q (T, nb, 32) quants, d (T, nb) scales, s its Q8_1 sums → (T, N) in ggml's order."""
        num_tokens, num_blocks, _ = q.shape
        rows = self.scales.shape[0]
        lanes_per_block = 32 // self.lane_width
        x_lanes = q.reshape(num_tokens, num_blocks, lanes_per_block, self.lane_width)
        x_lanes = x_lanes.transpose(1, 2, 0, 3)  # (nb, lanes, T, lane_width)
        w_lanes = self._lanes.astype(_F32)  # (nb, lanes, lane_width, N)
        scales = (d.T[:, :, None] * self.scales.T[:, None, :]).astype(_F64)  # (nb, T, N), exact
        # The integer lane sums of a few blocks at a time (a big prompt: one block), times
        # d_w*d_x: exact in float64. Then acc = fma(d_w*d_x, lane, acc) in block order.
        step = max(1, _CHUNK_ELEMENTS // (lanes_per_block * num_tokens * rows))
        acc = mx.zeros((lanes_per_block, num_tokens, rows), dtype=_F32)
        for b0 in range(0, num_blocks, step):
            b1 = min(b0 + step, num_blocks)
            sums = (x_lanes[b0:b1] @ w_lanes[b0:b1]).astype(_F64)  # (nbc, lanes, T, N)
            products = sums * scales[b0:b1, None]
            for i in range(b1 - b0):
                acc = (acc + products[i]).astype(_F32)
        out = _hsum_8(acc) if lanes_per_block == 8 else acc[0]
        if self.ggml_type == GGMLQuantizationType.Q4_1:
            # + sum_b m*s (exact fp32 products) added in block order: MLX's CPU scan is sequential.
            ms = s.reshape(num_tokens, num_blocks)[:, :, None] * self["biases"].T[None]
            out = out + mx.cumsum(ms, axis=1)[:, -1]
        return out


class GGMLQuantizedEmbedding(nn.QuantizedEmbedding):
    """A tied token embedding whose LM-head product rounds its input to 8-bit blocks first.

    Lookups dequantize exactly (``d * q`` is exact in fp32), as ggml's ``get_rows`` does.
    """

    def __init__(self, embedding: nn.QuantizedEmbedding, ggml_type: GGMLQuantizationType):
        nn.Module.__init__(self)  # adopt the loaded weights, see GGMLQuantizedLinear
        self.group_size, self.bits, self.mode = embedding.group_size, embedding.bits, embedding.mode
        self.weight, self.scales, self.biases = embedding.weight, embedding.scales, embedding.biases
        self.num_embeddings, self.dims = embedding.num_embeddings, embedding.dims
        self.ggml_type = ggml_type
        self.freeze()

    @_on_cpu
    def as_linear(self, x: mx.array) -> mx.array:
        return _rounded_input_product(x, super().as_linear, self.ggml_type, self["biases"])


# -- attention ----------------------------------------------------------------------------


@functools.cache
def _libm() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("m"))
    for fn in (lib.cosf, lib.sinf):
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return lib


class GGMLRoPETables:
    """cos/sin per (position, pair) exactly as ggml's ``rope_cache_init`` computes them.

    ``theta = p``, times ``theta_scale = powf(base, -2/D)`` in fp32 for each pair, divided by
    the pair's frequency factor, times the linear-scaling ``freq_scale``; then the C library's
    ``cosf``/``sinf`` (numpy's differ in the last bit). Grown on demand to the positions used.
    """

    def __init__(
        self, dims: int, base: float, freq_scale: float, factors: np.ndarray | None
    ) -> None:
        exponent = np.float64(np.float32(-2.0) / np.float32(dims))
        self._theta_scale = np.float32(np.float64(base) ** exponent)  # correctly rounded powf
        self._freq_scale = np.float32(freq_scale)
        half = dims // 2
        self._factors = np.ones(half, np.float32) if factors is None else factors.astype(np.float32)
        self._cos = mx.zeros((0, half), dtype=_F32)
        self._sin = mx.zeros((0, half), dtype=_F32)

    def lookup(self, offset: int, length: int) -> tuple[mx.array, mx.array]:
        """cos, sin (length, D/2) for positions ``offset .. offset + length - 1``."""
        end = offset + length
        if end > self._cos.shape[0]:
            self._grow(max(end, 2 * self._cos.shape[0], 256))
        return self._cos[offset:end], self._sin[offset:end]

    def _grow(self, num_positions: int) -> None:
        theta = np.arange(num_positions, dtype=np.float32)
        angles = np.empty((num_positions, self._factors.shape[0]), dtype=np.float32)
        for i, factor in enumerate(self._factors):
            angles[:, i] = self._freq_scale * (theta / factor)
            theta = theta * self._theta_scale
        libm = _libm()
        flat = angles.reshape(-1).tolist()
        cos = np.array([libm.cosf(a) for a in flat], dtype=np.float32).reshape(angles.shape)
        sin = np.array([libm.sinf(a) for a in flat], dtype=np.float32).reshape(angles.shape)
        self._cos, self._sin = mx.array(cos), mx.array(sin)


def _tinyblas_dot(a: mx.array, b: mx.array) -> mx.array:
    """llamafile's tinyBLAS F16 GEMM (AVX512): out[..., i, j] = sum_k a[..., i, k] b[..., j, k].

    a, b hold fp16 values (fp32 arrays), K a multiple of 16: 16 fp32 lanes (k mod 16)
    accumulate over k in steps of 16 (the products of fp16 values are exact in fp32, so
    the FMA is one fp32 addition), then ``_mm512_reduce_add_ps``.
    """
    acc = mx.zeros((*a.shape[:-1], b.shape[-2], 16), dtype=_F32)
    for k in range(0, a.shape[-1], 16):
        acc = acc + a[..., :, None, k : k + 16] * b[..., None, :, k : k + 16]
    return _reduce_add_16(acc)


def _vec_dot_f16(a: mx.array, b: mx.array) -> mx.array:
    """``ggml_vec_dot_f16`` (AVX512) for every pair, as ggml runs single-token products.

    4 accumulators of 16 lanes (k mod 64) over k in steps of 64, then ``acc0+acc2``,
    ``acc1+acc3``, their sum, ``_mm512_reduce_add_ps``; the last K mod 64 products are added
    one by one in double.
    """
    k = a.shape[-1]
    main = k - k % 64
    acc = mx.zeros((*a.shape[:-1], b.shape[-2], 4, 16), dtype=_F32)
    for start in range(0, main, 64):
        a_ = a[..., :, None, start : start + 64].reshape(*a.shape[:-1], 1, 4, 16)
        b_ = b[..., None, :, start : start + 64].reshape(*b.shape[:-2], 1, b.shape[-2], 4, 16)
        acc = acc + a_ * b_
    out = _reduce_add_16((acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :]))
    if main == k:
        return out
    total = out.astype(_F64)
    for i in range(main, k):
        total = total + (a[..., :, None, i] * b[..., None, :, i]).astype(_F64)
    return total.astype(_F32)


def _soft_max(scores: mx.array, scale: float, mask: mx.array) -> mx.array:
    """``ggml_compute_forward_soft_max_f32`` along the last axis (a multiple of 16 long).

    ``x*scale + mask``, the max, ggml's expf of ``x - max``, 16-wide chunk sums
    (``reduce_add``) accumulated in double, times ``(float)(1.0/sum)``.
    """
    w = scores * _f32(scale) + mask
    e = ggml_expf(w - w.max(axis=-1, keepdims=True))
    chunks = _reduce_add_16(e.reshape(*e.shape[:-1], -1, 16)).astype(_F64)
    inv = (1.0 / chunks.sum(axis=-1, keepdims=True)).astype(_F32)
    return e * inv


class GGMLAttention(nn.Module):
    """mlx-lm's Llama attention with ggml's arithmetic (flash attention off, F16 KV cache).

    q/k rotated with ggml's RoPE tables and FMA-contracted rotation
    (``fma(x0, c, -(x1 s))``, ``fma(x0, s, x1 c)`` on adjacent pairs, the GGUF layout); q, k,
    v rounded to F16 and k/v cached as float16; ``K·q`` and ``V·p`` in tinyBLAS's order for
    several new tokens, ``ggml_vec_dot_f16``'s for one; ggml's softmax with F16 probabilities.
    The key axis is padded to a multiple of 64 with masked cells (zeros change no sum).
    """

    def __init__(self, attention: llama.Attention, rope: GGMLRoPETables) -> None:
        super().__init__()
        self.n_heads = attention.n_heads
        self.n_kv_heads = cast(int, attention.n_kv_heads)  # set by ModelArgs.__post_init__
        self.head_dim = attention.head_dim
        self.q_proj, self.k_proj = attention.q_proj, attention.k_proj
        self.v_proj, self.o_proj = attention.v_proj, attention.o_proj
        self.rope = rope
        # 1.0f/sqrtf(head_dim), as llama.cpp computes the KQ scale.
        self.scale = float(np.float32(1.0) / np.sqrt(np.float32(self.head_dim)))

    def _rotate(self, x: mx.array, offset: int) -> mx.array:
        cos, sin = self.rope.lookup(offset, x.shape[2])  # (T, D/2)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = mx.stack([_fma(x0, cos, -(x1 * sin)), _fma(x0, sin, x1 * cos)], axis=-1)
        return out.reshape(x.shape)

    @_on_cpu
    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if mask is not None and not isinstance(mask, str):
            raise NotImplementedError("numerics='llamacpp' supports causal attention masks only")
        batch, num_new, _ = x.shape
        shape = (batch, num_new, -1, self.head_dim)
        queries = self.q_proj(x).reshape(shape).transpose(0, 2, 1, 3)  # (B, H, T, D)
        keys = self.k_proj(x).reshape(shape).transpose(0, 2, 1, 3)  # (B, H_kv, T, D)
        values = self.v_proj(x).reshape(shape).transpose(0, 2, 1, 3).astype(_F16)
        offset = cache.offset if cache is not None else 0
        queries = _round_f16(self._rotate(queries, offset))
        keys = self._rotate(keys, offset).astype(_F16)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        out = self._attend(queries, keys.astype(_F32), values.astype(_F32))  # (B, H, T, D)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, num_new, -1))

    def _attend(self, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        num_new, num_total = q.shape[2], k.shape[2]
        padded = -(-num_total // 64) * 64
        pad = [(0, 0), (0, 0), (0, padded - num_total), (0, 0)]
        group = self.n_heads // self.n_kv_heads
        k = mx.repeat(mx.pad(k, pad), group, axis=1)  # (B, H, S, D)
        v = mx.repeat(mx.pad(v, pad), group, axis=1).transpose(0, 1, 3, 2)  # (B, H, D, S)
        # Query i sits at position num_total - num_new + i and sees keys up to it.
        rows = mx.arange(num_new)[:, None] + (num_total - num_new)
        mask = mx.where(mx.arange(padded)[None] > rows, -mx.inf, 0.0).astype(_F32)
        dot = _tinyblas_dot if num_new > 1 else _vec_dot_f16
        outs = []
        for start in range(0, num_new, _QUERY_ROWS):  # bounds the (T, S, 16) lane tensors
            end = min(start + _QUERY_ROWS, num_new)
            scores = dot(q[:, :, start:end], k)
            probs = _round_f16(_soft_max(scores, self.scale, mask[start:end]))
            outs.append(dot(probs, v))
        return mx.concatenate(outs, axis=2)


# -- the model ----------------------------------------------------------------------------


def use_llamacpp_numerics(
    model: llama.Model,
    ggml_types: Mapping[str, GGMLQuantizationType],
    rope: GGMLRoPETables,
) -> None:
    """Swap a loaded Llama model's norms, attention, MLPs and quantized products for ggml's.

    ``ggml_types``: the file's tensor type per module path (``model.layers.0.mlp.up_proj``).
    Float matrices (types MLX did not keep quantized) stay MLX's.
    """

    def linear(module: Any, path: str, *, exact_order: bool = True) -> Any:
        if not isinstance(module, nn.QuantizedLinear):
            return module
        return GGMLQuantizedLinear(module, ggml_types[path], exact_order=exact_order)

    inner = model.model
    for index, layer in enumerate(inner.layers):
        prefix = f"model.layers.{index}."
        attention, mlp = layer.self_attn, layer.mlp
        attention.update_modules(
            {
                name: linear(attention[name], f"{prefix}self_attn.{name}")
                for name in ("q_proj", "k_proj", "v_proj", "o_proj")
            }
        )
        mlp.update_modules(
            {
                name: linear(mlp[name], f"{prefix}mlp.{name}")
                for name in ("gate_proj", "up_proj", "down_proj")
            }
        )
        layer.update_modules(
            {
                "self_attn": GGMLAttention(attention, rope),
                "mlp": GGMLMLP(mlp),
                "input_layernorm": GGMLRMSNorm(layer.input_layernorm),
                "post_attention_layernorm": GGMLRMSNorm(layer.post_attention_layernorm),
            }
        )
    inner.update_modules({"norm": GGMLRMSNorm(inner.norm)})
    if "lm_head" in model:
        model.update_modules({"lm_head": linear(model["lm_head"], "lm_head", exact_order=False)})
    elif isinstance(inner.embed_tokens, nn.QuantizedEmbedding):
        embedding = GGMLQuantizedEmbedding(inner.embed_tokens, ggml_types["model.embed_tokens"])
        inner.update_modules({"embed_tokens": embedding})

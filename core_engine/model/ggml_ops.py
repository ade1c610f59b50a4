"""Bit-exact torch emulations of the ggml CPU kernels llama.cpp runs on x86 (AVX2/AVX512).

With 8-bit activations a model's output is a *discontinuous* function of its arithmetic: a
1-ulp difference anywhere upstream moves some activation across a Q8 rounding boundary, that
flip perturbs the next layers by ~1/127 of a block's range, which flips many more, and within
a few layers the run has drifted as far from llama.cpp as exact fp32 arithmetic is. Matching
llama.cpp therefore needs the same bits, not just the same formulas: the same fp32 summation
order in every dot product, the same FMA contractions, the same ``expf`` polynomial. These
functions reproduce them (checked against ggml's own kernels, see
``tests/core_engine/test_oracle_llamacpp_numerics.py``).

Fused multiply-adds are emulated in float64: ``a*b`` of two fp32 is exact there and the sum
is rounded twice (to fp64, then fp32), which differs from one rounding only when the fp64
result lands exactly on an fp32 midpoint (~2^-29 of the time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "div",
    "fma",
    "gelu",
    "ggml_expf",
    "q8_lane_dot",
    "quantize_q8_blocks",
    "reduce_add_16",
    "rms_norm",
    "soft_max",
    "swiglu",
    "tinyblas_dot",
    "vec_dot_4x16",
    "vec_dot_bf16",
]

_F32 = torch.float32
_F64 = torch.float64


def fma(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """fp32 ``a*b + c`` with one rounding (as ``_mm*_fmadd_ps``), via float64."""
    return (a.to(_F64) * b.to(_F64) + c.to(_F64)).to(_F32)


def div(a: Tensor | float, b: Tensor | float) -> Tensor:
    """IEEE fp32 division. ``tensor / python_scalar`` in torch multiplies by a rounded
    reciprocal instead, which differs in the last bit."""
    ta = a if isinstance(a, Tensor) else torch.tensor(a, dtype=_F32)
    tb = b if isinstance(b, Tensor) else torch.tensor(b, dtype=_F32)
    ta, tb = torch.broadcast_tensors(ta, tb)
    return torch.div(ta.contiguous(), tb.contiguous())


def _f32(value: float) -> Tensor:
    return torch.tensor(value, dtype=_F32)


# ggml_v_expf (vec.h, AVX512 path): Arm's optimized-routines expf, max error 1.45 ulp.
_EXP_SHIFT = _f32(float.fromhex("0x1.8p23"))
_EXP_LOG2E = _f32(float.fromhex("0x1.715476p+0"))
_EXP_LN2_HI = _f32(float.fromhex("0x1.62e4p-1"))
_EXP_LN2_LO = _f32(float.fromhex("0x1.7f7d1cp-20"))
_EXP_C = [_f32(float.fromhex(h)) for h in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1")]
_ONE = _f32(1.0)


def ggml_expf(x: Tensor) -> Tensor:
    """``ggml_v_expf`` bit for bit (fp32 in, fp32 out; -inf → 0, overflow → inf)."""
    z = fma(x, _EXP_LOG2E, _EXP_SHIFT)
    n = z - _EXP_SHIFT
    b = fma(-n, _EXP_LN2_LO, fma(-n, _EXP_LN2_HI, x))  # fnmadd(a, b, c) = c - a*b
    u = b * b
    c0, c1, c2, c3, c4 = _EXP_C
    j = fma(fma(fma(c0, b, c1), u, fma(c2, b, c3)), u, fma(c4, b, _ONE))
    res = (j.to(_F64) * torch.exp2(n.to(_F64).nan_to_num(0.0, 0.0, 0.0))).to(_F32)  # scalef(j, n)
    big = n.abs() > 192  # NaN (from -inf inputs) compares False, like _CMP_GT_OQ
    huge = torch.where(n <= 0, torch.zeros_like(res), torch.full_like(res, float("inf")))
    res = torch.where(big, huge, res)
    return torch.where(torch.isneginf(x), torch.zeros_like(res), res)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``ggml_vec_swiglu_f32``: ``gate / (1 + expf(-gate)) * up`` with ggml's expf."""
    e = ggml_expf(torch.zeros_like(gate) - gate)
    return div(gate, e + 1.0) * up


def gelu(x: Tensor) -> Tensor:
    """ggml's CPU GELU (``GGML_GELU_FP16``, on by default): the input rounded to fp16 and
    looked up in a table of fp16 GELU(tanh) values; 0 at and below -10, ``x`` from 10 up.
    Against exact fp32 GELU it moves a tiny Gemma's logits by ~2e-3."""
    table = F.gelu(x.half().float(), approximate="tanh").half().to(x.dtype)
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, table))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rms_norm`` then ``mul``: fp32 squares summed in float64, ``1/sqrtf(mean + eps)``."""
    sq = (x * x).to(_F64)  # ggml squares in fp32, accumulates in double, in order
    total = sq.cumsum(dim=-1)[..., -1:]  # a sequential sum (torch's sum() is pairwise)
    mean = torch.div(total, torch.full_like(total, x.shape[-1])).to(_F32)
    # torch's fp32 sqrt is not always correctly rounded; fp64 sqrt rounded to fp32 is.
    scale = div(1.0, torch.sqrt((mean + _f32(eps)).to(_F64)).to(_F32))
    return (x * scale) * weight


def reduce_add_16(acc: Tensor) -> Tensor:
    """``_mm512_reduce_add_ps`` over the last dim (16 lanes) as GCC expands it."""
    t = acc[..., 8:] + acc[..., :8]
    t = t[..., 4:] + t[..., :4]
    t = t[..., :2] + t[..., 2:]
    return t[..., 0] + t[..., 1]


def _hsum_8(acc: Tensor) -> Tensor:
    """``hsum_float_8`` over dim 0 (8 lanes): (hi + lo), then movehl, then movehdup."""
    r = acc[4:] + acc[:4]
    r = r[:2] + r[2:]
    return r[0] + r[1]


def q8_lane_dot(
    qx: Tensor,
    dx: Tensor,
    w_lanes: Tensor,
    dw: Tensor,
    *,
    sx: Tensor | None = None,
    mw: Tensor | None = None,
    lane_width: int = 4,
    chunk_elements: int = 1 << 19,
) -> Tensor:
    """ggml's x86 ``vec_dot_q4_1_q8_1`` / ``q8_0_q8_0`` / ``q4_0_q8_0`` for every (token, row).

    qx (T, nb, 32) activation quants and dx (T, nb) their fp16 scales; w_lanes (nb*8, 4, N)
    the weight quants of each row grouped in lanes of 4 consecutive values (Q4_0 already
    minus 8) and dw (N, nb) their fp16 scales; for Q4_1 also sx (T, nb), the Q8_1 sums, and
    mw (N, nb), the block minimums. All fp32 tensors holding exact values.
    Order: 8 fp32 lanes of 4 products each, ``acc = fma(dw*dx, lane, acc)`` block after
    block, ``hsum_float_8``, then ``+ sum_b m*s`` accumulated in block order.
    ``lane_width=32`` is the order of ggml's repacked Q4_0 GEMM/GEMV (``q4_0_8x8``): one
    integer sum per block, ``acc = fma(sum, dw*dx, acc)``. w_lanes is then (nb, 32, N).
    Returns (T, N) fp32.
    """
    num_tokens, nb, _ = qx.shape
    n_rows = w_lanes.shape[-1]
    n_lanes = 32 // lane_width
    # Tiles of (tokens x rows) small enough for the per-block passes to stay in cache.
    row_step = min(n_rows, max(64, chunk_elements // (8 * nb)))
    tok_step = max(1, chunk_elements // (8 * nb * row_step))
    x_lanes = qx.reshape(num_tokens, nb * n_lanes, lane_width).transpose(0, 1)  # (G, T, width)
    out = torch.empty(num_tokens, n_rows, dtype=_F32)
    for n0 in range(0, n_rows, row_step):
        n1 = min(n_rows, n0 + row_step)
        w = w_lanes[..., n0:n1]
        for t0 in range(0, num_tokens, tok_step):
            t1 = min(num_tokens, t0 + tok_step)
            lanes = torch.bmm(x_lanes[:, t0:t1], w).to(_F64).view(nb, n_lanes, t1 - t0, n1 - n0)  # exact ints
            scales = (dx[t0:t1, :, None] * dw[None, n0:n1, :].transpose(1, 2)).to(_F64)  # (Tc, nb, Nc) exact
            acc = torch.zeros(n_lanes, t1 - t0, n1 - n0, dtype=_F64)
            acc32 = torch.empty(n_lanes, t1 - t0, n1 - n0, dtype=_F32)
            for b in range(nb):  # fma: the product is exact in fp64; round the sum to fp32
                torch.addcmul(acc, lanes[b], scales[:, b], out=acc)
                acc32.copy_(acc)
                acc.copy_(acc32)
            res = _hsum_8(acc32) if n_lanes == 8 else acc32[0]
            if mw is not None:
                assert sx is not None
                ms = sx[t0:t1, :, None] * mw[None, n0:n1, :].transpose(1, 2)  # (Tc, nb, Nc) m*s exact
                summs = torch.zeros(t1 - t0, n1 - n0, dtype=_F32)
                for b in range(nb):
                    summs = summs + ms[:, b]
                res = res + summs
            out[t0:t1, n0:n1] = res
    return out


def tinyblas_dot(a: Tensor, b: Tensor) -> Tensor:
    """llamafile's tinyBLAS F32/F16 GEMM (AVX512): C[..., i, j] = sum_k a[..., i, k] b[..., j, k].

    ggml hands it products with two or more columns (prompt batches) and a row count that is a
    multiple of 4; see :func:`vec_dot_4x16` for the rest. a (..., M, K), b (..., N, K) hold
    fp32 (or fp16) values; 16 fp32 lanes (k mod 16) accumulate with FMA over k in steps of
    16, then ``_mm512_reduce_add_ps``. K must be a multiple of 16.
    """
    k = a.shape[-1]
    assert k % 16 == 0, k
    a5 = a.unflatten(-1, (k // 16, 16)).to(_F64)  # (..., M, S, 16)
    b5 = b.unflatten(-1, (k // 16, 16)).to(_F64)  # (..., N, S, 16)
    acc = torch.zeros((*a.shape[:-1], b.shape[-2], 16), dtype=_F64)  # (..., M, N, 16)
    for s in range(k // 16):
        prod = a5[..., :, None, s, :] * b5[..., None, :, s, :]  # exact in fp64
        acc = (prod + acc).to(_F32).to(_F64)
    return reduce_add_16(acc.to(_F32))


def vec_dot_4x16(a: Tensor, b: Tensor) -> Tensor:
    """``ggml_vec_dot_f16`` (AVX512) for every pair: C[..., i, j] = sum_k a[..., i, k] b[..., j, k].

    ggml uses it instead of tinyBLAS for single-column products (one new token): 4
    accumulators of 16 lanes (k mod 64) FMA over k in steps of 64, then ``acc0+acc2``,
    ``acc1+acc3``, their sum, ``_mm512_reduce_add_ps``; the last K mod 64 products are added
    one by one in double. ``ggml_vec_dot_f32`` has the same order when K is a multiple of 64.
    """
    k = a.shape[-1]
    main = k - k % 64
    a6 = a[..., :main].unflatten(-1, (main // 64, 4, 16)).to(_F64)
    b6 = b[..., :main].unflatten(-1, (main // 64, 4, 16)).to(_F64)
    acc = torch.zeros((*a.shape[:-1], b.shape[-2], 4, 16), dtype=_F64)  # (..., M, N, 4, 16)
    for s in range(main // 64):
        acc = (a6[..., :, None, s, :, :] * b6[..., None, :, s, :, :] + acc).to(_F32).to(_F64)
    x = acc.to(_F32)
    out = reduce_add_16((x[..., 0, :] + x[..., 2, :]) + (x[..., 1, :] + x[..., 3, :]))
    if main == k:
        return out
    total = out.to(_F64)
    for i in range(main, k):  # fp16 products are exact in fp32
        total = total + (a[..., :, None, i] * b[..., None, :, i]).to(_F64)
    return total.to(_F32)


def vec_dot_bf16(a: Tensor, b: Tensor) -> Tensor:
    """``ggml_vec_dot_bf16`` on AVX512F without BF16 instructions: sum_k a[..., i, k] b[..., j, k].

    Two accumulators of 16 lanes (k mod 32) over k in steps of 32 (bf16 products are exact in
    fp32), each ``_mm512_reduce_add_ps``'d and summed in double. K must be a multiple of 32.
    """
    k = a.shape[-1]
    assert k % 32 == 0, k
    a5 = a.unflatten(-1, (k // 32, 2, 16)).to(_F64)
    b5 = b.unflatten(-1, (k // 32, 2, 16)).to(_F64)
    acc = torch.zeros((*a.shape[:-1], b.shape[-2], 2, 16), dtype=_F64)
    for s in range(k // 32):
        acc = (a5[..., :, None, s, :, :] * b5[..., None, :, s, :, :] + acc).to(_F32).to(_F64)
    x = acc.to(_F32)
    return (reduce_add_16(x[..., 0, :]).to(_F64) + reduce_add_16(x[..., 1, :]).to(_F64)).to(_F32)


def soft_max(scores: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    """``ggml_compute_forward_soft_max_f32`` along the last dim (length a multiple of 16).

    ``x*scale + mask``, max, ggml's expf of ``x - max`` in 16-wide chunks whose
    ``reduce_add`` is summed in double, then multiplied by ``(float)(1.0/sum)``.
    """
    n = scores.shape[-1]
    assert n % 16 == 0, n
    w = scores * _f32(scale)
    if mask is not None:
        w = w + mask
    mx = w.amax(dim=-1, keepdim=True)
    e = ggml_expf(w - mx)
    chunk_sums = reduce_add_16(e.unflatten(-1, (n // 16, 16))).to(_F64)  # (..., n/16)
    total = chunk_sums.cumsum(dim=-1)[..., -1:]  # summed in order, in double
    inv = torch.div(torch.ones_like(total), total).to(_F32)
    return e * inv


def quantize_q8_blocks(x: Tensor, *, with_sum: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """ggml's x86 ``quantize_row_q8_0`` (``with_sum=False``) / ``quantize_row_q8_1``.

    x (T, K) fp32 → quants (T, K/32, 32) (exact small integers in fp32), the fp16 scale
    ``d`` (T, K/32) and, for Q8_1, ``s = fp16(d_fp32 * sum(q))`` (T, K/32).
    """
    num_tokens, k = x.shape
    blocks = x.reshape(num_tokens, k // 32, 32)
    amax = blocks.abs().amax(dim=-1)  # (T, nb)
    d = div(amax, 127.0)
    inv = torch.where(amax != 0, div(127.0, amax), torch.zeros_like(amax))
    q = torch.round(blocks * inv.unsqueeze(-1))  # round half to even, like _mm256_round_ps
    d16 = d.to(torch.float16).to(_F32)
    s16 = (d * q.sum(dim=-1)).to(torch.float16).to(_F32) if with_sum else None
    return q, d16, s16

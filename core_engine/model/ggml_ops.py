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
from torch import Tensor

__all__ = [
    "div",
    "f16_dot_lanes",
    "fma",
    "ggml_expf",
    "q8_lane_dot",
    "reduce_add_16",
    "rms_norm",
    "soft_max",
    "swiglu",
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


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rms_norm`` then ``mul``: fp32 squares summed in float64, ``1/sqrtf(mean + eps)``."""
    sq = (x * x).to(_F64)  # ggml squares in fp32, accumulates in double
    mean = (sq.sum(dim=-1, keepdim=True) / x.shape[-1]).to(_F32)
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
    chunk_elements: int = 1 << 23,
) -> Tensor:
    """ggml's x86 ``vec_dot_q4_1_q8_1`` / ``q8_0_q8_0`` / ``q4_0_q8_0`` for every (token, row).

    qx (T, nb, 32) activation quants and dx (T, nb) their fp16 scales; w_lanes (nb*8, 4, N)
    the weight quants of each row grouped in lanes of 4 consecutive values (Q4_0 already
    minus 8) and dw (N, nb) their fp16 scales; for Q4_1 also sx (T, nb), the Q8_1 sums, and
    mw (N, nb), the block minimums. All fp32 tensors holding exact values.
    Order: 8 fp32 lanes of 4 products each, ``acc = fma(dw*dx, lane, acc)`` block after
    block, ``hsum_float_8``, then ``+ sum_b m*s`` accumulated in block order.
    Returns (T, N) fp32.
    """
    num_tokens, nb, _ = qx.shape
    n_rows = w_lanes.shape[-1]
    step = max(1, chunk_elements // max(1, nb * 8 * n_rows))
    out = torch.empty(num_tokens, n_rows, dtype=_F32)
    for t0 in range(0, num_tokens, step):
        t1 = min(num_tokens, t0 + step)
        x_lanes = qx[t0:t1].reshape(t1 - t0, nb * 8, 4).transpose(0, 1)  # (G, Tc, 4)
        lanes = torch.bmm(x_lanes, w_lanes).view(nb, 8, t1 - t0, n_rows)  # exact integers
        acc = torch.zeros(8, t1 - t0, n_rows, dtype=_F64)
        for b in range(nb):
            scale = torch.outer(dx[t0:t1, b], dw[:, b]).to(_F64)  # exact: fp16 x fp16
            acc = (scale * lanes[b].to(_F64) + acc).to(_F32).to(_F64)
        res = _hsum_8(acc.to(_F32))
        if mw is not None:
            assert sx is not None
            summs = torch.zeros(t1 - t0, n_rows, dtype=_F32)
            for b in range(nb):
                summs = summs + torch.outer(sx[t0:t1, b], mw[:, b])  # m*s exact in fp32
            res = res + summs
        out[t0:t1] = res
    return out


def f16_dot_lanes(a: Tensor, b: Tensor) -> Tensor:
    """tinyBLAS F16 GEMM (AVX512): C[..., i, j] = sum_k a[..., i, k] b[..., j, k].

    a (..., M, K), b (..., N, K) hold fp16 values; 16 fp32 lanes (k mod 16) accumulate with
    FMA over k in steps of 16, then ``_mm512_reduce_add_ps``. K must be a multiple of 16.
    """
    k = a.shape[-1]
    assert k % 16 == 0, k
    a5 = a.unflatten(-1, (k // 16, 16)).to(_F64)  # (..., M, S, 16)
    b5 = b.unflatten(-1, (k // 16, 16)).to(_F64)  # (..., N, S, 16)
    acc = torch.zeros((*a.shape[:-1], b.shape[-2], 16), dtype=_F64)  # (..., M, N, 16)
    for s in range(k // 16):
        prod = a5[..., :, None, s, :] * b5[..., None, :, s, :]  # exact: fp16 x fp16
        acc = (prod + acc).to(_F32).to(_F64)
    return reduce_add_16(acc.to(_F32))


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
    total = torch.zeros(chunk_sums.shape[:-1], dtype=_F64)
    for c in range(n // 16):
        total = total + chunk_sums[..., c]
    inv = (1.0 / total).to(_F32).unsqueeze(-1)
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

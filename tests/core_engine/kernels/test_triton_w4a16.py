"""W4A16 matmul: the int4 layout against its definition and gguf's Q4_1, the reference against a
plain dequantise-then-matmul, the Triton kernel against the reference, argument checks."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from kernel_case import assert_close
from torch import Tensor

from core_engine.kernels import (
    unpack_int4,
    w4a16_matmul,
    w4a16_matmul_reference,
)
from core_engine.kernels.triton_ops.w4a16 import w4a16_matmul_triton


def _int4_weight(n: int, k: int, device: torch.device, seed: int = 0) -> tuple[Tensor, ...]:
    """Random codes, scales and minima packed by the layout's definition, and the W they mean.

    Returns ``(qweight, scales, mins, weight)``; ``weight`` (N, K) fp32 is computed element by
    element in float64 (exact) and rounded once.
    """
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.15).half()
    group = torch.arange(k) // 32  # (K,) block of each weight
    weight = (d.double()[:, group] * q.double() + m.double()[:, group]).float()  # (N, K)
    qweight = torch.empty((n, k // 2), dtype=torch.uint8)
    for b in range(k // 32):
        for j in range(16):  # byte j of block b: weight 32b + j low, 32b + j + 16 high
            qweight[:, 16 * b + j] = q[:, 32 * b + j] | (q[:, 32 * b + j + 16] << 4)
    return qweight.to(device), d.to(device), m.to(device), weight.to(device)


def _activations(m: int, k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.randn((m, k), generator=torch.Generator().manual_seed(m + k)).to(dtype).to(device)


def _bias(n: int, device: torch.device) -> Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device)


def test_unpack_int4_returns_the_weight_it_was_built_from(device: torch.device) -> None:
    qweight, scales, mins, weight = _int4_weight(5, 96, device)
    unpacked = unpack_int4(qweight, scales, mins)
    assert unpacked.dtype == torch.float32 and unpacked.shape == (5, 96)
    assert torch.equal(unpacked, weight)


def test_unpack_int4_agrees_with_gguf_q4_1_bit_for_bit(device: torch.device) -> None:
    n, k = 6, 128
    dense = np.random.default_rng(3).standard_normal((n, k)).astype(np.float32)
    packed = quants.quantize(dense, GGMLQuantizationType.Q4_1)  # (N, K/32 * 20) bytes
    expected = quants.dequantize(packed, GGMLQuantizationType.Q4_1)  # (N, K) fp32
    blocks = packed.reshape(-1, 20)  # d f16 | m f16 | qs u8[16]
    scales = torch.from_numpy(blocks[:, 0:2].copy().view(np.float16).reshape(n, k // 32))
    mins = torch.from_numpy(blocks[:, 2:4].copy().view(np.float16).reshape(n, k // 32))
    qweight = torch.from_numpy(blocks[:, 4:].copy().reshape(n, k // 2))
    unpacked = unpack_int4(qweight.to(device), scales.to(device), mins.to(device))
    assert torch.equal(unpacked.cpu(), torch.from_numpy(expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_reference_is_dequantise_then_matmul(
    device: torch.device, dtype: torch.dtype, with_bias: bool
) -> None:
    qweight, scales, mins, weight = _int4_weight(24, 64, device)
    x = _activations(3, 64, dtype, device)
    bias = _bias(24, device) if with_bias else None
    out = w4a16_matmul_reference(x, qweight, scales, mins, bias)
    expected = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    assert out.shape == (3, 24) and out.dtype == dtype
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (24, 96)])  # N: a partial tile over N
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_reference(
    device: torch.device, dtype: torch.dtype, m: int, n: int, k: int, with_bias: bool
) -> None:
    qweight, scales, mins, _ = _int4_weight(n, k, device, seed=m)
    x = _activations(m, k, dtype, device)
    bias = _bias(n, device).to(dtype) if with_bias else None
    out = w4a16_matmul_triton(x, qweight, scales, mins, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close(out, w4a16_matmul_reference(x, qweight, scales, mins, bias), dtype)
    assert torch.equal(w4a16_matmul(x, qweight, scales, mins, bias), out)


@pytest.mark.parametrize(
    ("block_m", "block_n", "block_k"),
    [(16, 16, 32), (16, 16, 64), (32, 16, 128)],  # several tiles on every axis; 1-4 blocks a step
)
def test_kernel_tiles_and_strided_x(
    device: torch.device, block_m: int, block_n: int, block_k: int
) -> None:
    m, n, k = 33, 40, 128
    qweight, scales, mins, _ = _int4_weight(n, k, device, seed=7)
    x = _activations(k, m, torch.float16, device).t()  # (M, K) with stride (1, M)
    out = w4a16_matmul_triton(
        x, qweight, scales, mins, block_m=block_m, block_n=block_n, block_k=block_k
    )
    assert_close(out, w4a16_matmul_reference(x, qweight, scales, mins), torch.float16)


def test_kernel_with_no_rows(device: torch.device) -> None:
    qweight, scales, mins, _ = _int4_weight(8, 32, device)
    x = torch.empty((0, 32), dtype=torch.float16, device=device)
    assert w4a16_matmul(x, qweight, scales, mins).shape == (0, 8)


def _good_args(device: torch.device) -> dict[str, Tensor]:
    qweight, scales, mins, _ = _int4_weight(8, 64, device)
    x = _activations(2, 64, torch.float16, device)
    return {"x": x, "qweight": qweight, "scales": scales, "mins": mins, "bias": _bias(8, device)}


# case -> (the argument it breaks, how)
_BAD_ARGUMENTS: dict[str, tuple[str, Callable[[dict[str, Tensor]], Tensor]]] = {
    "x-1d": ("x", lambda a: a["x"][0]),
    "x-int": ("x", lambda a: a["x"].to(torch.int32)),
    "x-k-not-a-multiple-of-32": ("x", lambda a: a["x"][:, :48]),
    "qweight-int8": ("qweight", lambda a: a["qweight"].view(torch.int8)),
    "qweight-k-differs-from-x": ("qweight", lambda a: a["qweight"][:, :16]),
    "scales-shape": ("scales", lambda a: a["scales"][:, :1]),
    "scales-fp32": ("scales", lambda a: a["scales"].float()),
    "mins-shape": ("mins", lambda a: a["mins"][:4]),
    "bias-shape": ("bias", lambda a: a["bias"][:5]),
}


@pytest.mark.parametrize("case", sorted(_BAD_ARGUMENTS))
def test_bad_arguments_raise_value_error_naming_the_argument(
    device: torch.device, case: str
) -> None:
    name, breaks = _BAD_ARGUMENTS[case]
    args = _good_args(device)
    args[name] = breaks(args)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        w4a16_matmul(**args)

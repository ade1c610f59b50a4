"""Triton RMSNorm (plain and fused with the residual add) against the torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_case import assert_close

from core_engine.kernels import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from core_engine.kernels.triton_ops.rms_norm import fused_add_rms_norm_triton, rms_norm_triton


def _inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(11)
    x, residual = (torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(2))
    weight = torch.rand(shape[-1], generator=gen).to(dtype).to(device)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 72])  # 72: the row is padded inside the kernel
def test_rms_norm(device: torch.device, dtype: torch.dtype, hidden: int) -> None:
    x, _, weight = _inputs((2, 3, hidden), dtype, device)
    out = rms_norm_triton(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, rms_norm_reference(x, weight, 1e-5), dtype)
    assert torch.equal(rms_norm(x, weight, 1e-5), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_add_rms_norm(device: torch.device, dtype: torch.dtype) -> None:
    x, residual, weight = _inputs((5, 72), dtype, device)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    expected_normed, expected_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert_close(new_residual, expected_residual, dtype)
    assert_close(normed, expected_normed, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), (
        "inputs were modified"
    )
    assert torch.equal(fused_add_rms_norm(x, residual, weight, 1e-6)[0], normed)


def test_rows_of_a_strided_view(device: torch.device) -> None:
    # Rows taken from a wider buffer (every other row), as a model slicing its hidden states does.
    x, _, weight = _inputs((8, 64), torch.float32, device)
    view = x[::2]
    assert_close(
        rms_norm_triton(view, weight, 1e-5), rms_norm_reference(view, weight, 1e-5), torch.float32
    )

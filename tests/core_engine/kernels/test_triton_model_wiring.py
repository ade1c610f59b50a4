"""The model's RMSNorm and RoPE run the Triton kernels where Triton runs (CUDA, or the
interpreter), and agree with the torch ops they stand in for."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from kernel_case import assert_close

from core_engine.model.norm import rms_norm
from core_engine.model.rope import apply_rotary

# The modules (the packages re-export functions of the same names).
triton_rms_norm = importlib.import_module("core_engine.kernels.triton_ops.rms_norm")
triton_rotary = importlib.import_module("core_engine.kernels.triton_ops.rotary")


def _count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    calls: list[int] = []
    launcher = getattr(module, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return launcher(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_rms_norm_runs_the_kernel_and_matches_f_rms_norm(
    device: torch.device, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(4, 5, 16, generator=gen).to(dtype).to(device)  # (T, heads, head_dim)
    weight = torch.rand(16, generator=gen).to(dtype).to(device)
    calls = _count_calls(monkeypatch, triton_rms_norm, "rms_norm_triton")
    x = qkv[:, :3]  # a strided view, as Qwen3's q-norm gets
    out = rms_norm(x, weight, 1e-6)
    assert calls == [1]
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, F.rms_norm(x, (16,), weight, 1e-6), dtype)


@pytest.mark.parametrize("num_heads", [2, 5])  # q+k of a fused QKV split evenly, and not
def test_the_model_rotary_runs_the_kernel_and_matches_the_torch_formula(
    device: torch.device, num_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(4)
    tokens, head_dim = 3, 8
    fused = torch.randn(tokens, num_heads + 1, head_dim, generator=gen).to(device)
    x = fused[:, :num_heads]  # the rotated heads of a fused QKV view
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 6.0
    cos, sin = angles.cos().to(device), angles.sin().to(device)  # (T, 1, D/2), as looked up
    before = fused.clone()
    calls = _count_calls(monkeypatch, triton_rotary, "apply_rotary_embedding_triton")
    out = apply_rotary(x, cos, sin)
    assert calls == [1]
    assert torch.equal(fused, before), "apply_rotary must not rotate its input in place"
    monkeypatch.setenv("INFERMUX_KERNELS", "torch")
    expected = apply_rotary(x, cos, sin)
    assert calls == [1]  # the torch formula this time
    assert_close(out, expected, torch.float32)

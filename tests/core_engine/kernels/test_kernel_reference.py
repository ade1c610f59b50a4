"""The torch references (the CPU path, and the yardstick of the Triton kernels) against plain
formulas, plus the dispatch rule."""

from __future__ import annotations

import pytest
import torch
from kernel_case import dense_decode_attention, make_paged_kv, quantize_paged_kv

from core_engine.kernels import (
    apply_rotary_embedding,
    apply_rotary_embedding_reference,
    fused_add_rms_norm_reference,
    paged_attention_decode,
    paged_attention_decode_reference,
    reshape_and_cache_reference,
    rms_norm_reference,
    rotary_cos_sin,
    use_triton,
)
from core_engine.kernels.dispatch import interpreter_enabled


@pytest.mark.parametrize("group", [1, 2, 4])
def test_paged_reference_equals_dense_attention_on_ragged_batch(
    device: torch.device, group: int
) -> None:
    # Lengths cover one token, a partial block, exactly full blocks and several blocks.
    lens = [1, 3, 8, 13]
    n_kv, head_dim = 2, 16
    paged = make_paged_kv(
        lens, block_size=4, n_kv_heads=n_kv, head_dim=head_dim, dtype=torch.float32, device=device
    )
    q = torch.randn(
        len(lens), n_kv * group, head_dim, generator=torch.Generator().manual_seed(1)
    ).to(device)
    scale = head_dim**-0.5
    out = paged_attention_decode_reference(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, scale
    )
    expected = dense_decode_attention(q, paged.keys, paged.values, scale)
    assert out.shape == (len(lens), n_kv * group, head_dim)
    assert not out.isnan().any(), "NaN from an unused cache slot leaked into the output"
    torch.testing.assert_close(out.double().cpu(), expected.cpu(), atol=1e-5, rtol=1e-5)


def test_paged_reference_keeps_bf16_and_matches_dense(device: torch.device) -> None:
    lens = [5, 11]
    paged = make_paged_kv(
        lens, block_size=4, n_kv_heads=1, head_dim=8, dtype=torch.bfloat16, device=device
    )
    q = (
        torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(2))
        .to(torch.bfloat16)
        .to(device)
    )
    out = paged_attention_decode(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.35
    )
    assert out.dtype == torch.bfloat16
    expected = dense_decode_attention(q, paged.keys, paged.values, 0.35)
    torch.testing.assert_close(out.double().cpu(), expected.cpu(), atol=2e-2, rtol=2e-2)


def test_paged_attention_names_the_bad_argument(device: torch.device) -> None:
    paged = make_paged_kv(
        [3], block_size=4, n_kv_heads=2, head_dim=8, dtype=torch.float32, device=device
    )
    q = torch.zeros(1, 3, 8, device=device)  # 3 heads cannot be grouped over 2 kv heads
    with pytest.raises(ValueError, match="kv heads"):
        paged_attention_decode(
            q, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 1.0
        )
    with pytest.raises(ValueError, match="context_lens"):
        paged_attention_decode(
            q[:, :2], paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens[:0], 1.0
        )


@pytest.mark.parametrize("code_dtype", [torch.int8, torch.float8_e4m3fn])
def test_paged_reference_dequantizes_codes_with_their_block_scales(
    device: torch.device, code_dtype: torch.dtype
) -> None:
    lens = [2, 7, 13]
    paged = make_paged_kv(
        lens, block_size=4, n_kv_heads=2, head_dim=16, dtype=torch.float32, device=device
    )
    quant = quantize_paged_kv(paged, code_dtype)
    q = torch.randn(len(lens), 4, 16, generator=torch.Generator().manual_seed(3)).to(device)
    out = paged_attention_decode(
        q, quant.k_codes, quant.v_codes, paged.block_tables, paged.context_lens, 0.25,
        k_scale=quant.k_scale, v_scale=quant.v_scale,
    )
    assert not out.isnan().any(), "a NaN scale of an unowned block leaked into the output"
    expected = dense_decode_attention(q, quant.keys, quant.values, 0.25)
    torch.testing.assert_close(out.double().cpu(), expected.cpu(), atol=1e-5, rtol=1e-5)
    # The codes are close to the exact cache (int8 ~1%, e4m3 ~6% of each block's range).
    exact = dense_decode_attention(q, paged.keys, paged.values, 0.25)
    tolerance = 0.03 if code_dtype == torch.int8 else 0.15
    assert (out.double().cpu() - exact.cpu()).abs().max() < tolerance


def test_paged_attention_asks_for_the_scales_of_a_code_cache(device: torch.device) -> None:
    paged = make_paged_kv(
        [3], block_size=4, n_kv_heads=1, head_dim=8, dtype=torch.float32, device=device
    )
    quant = quantize_paged_kv(paged, torch.int8)
    q = torch.zeros(1, 1, 8, device=device)
    args = (q, quant.k_codes, quant.v_codes, paged.block_tables, paged.context_lens, 1.0)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        paged_attention_decode(*args)
    with pytest.raises(ValueError, match="k_scale must be"):
        paged_attention_decode(*args, k_scale=quant.k_scale[:1, :0], v_scale=quant.v_scale)


def test_reshape_and_cache_reference_writes_only_the_given_slots(device: torch.device) -> None:
    num_blocks, block_size, n_kv, head_dim = 4, 4, 2, 8
    qkv = torch.randn(3, 4 * head_dim + 2 * n_kv * head_dim, device=device)
    key = qkv[:, 4 * head_dim : 6 * head_dim].view(
        3, n_kv, head_dim
    )  # strided views of a fused output
    value = qkv[:, 6 * head_dim :].view(3, n_kv, head_dim)
    k_cache = torch.zeros(num_blocks, block_size, n_kv, head_dim, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor(
        [5, 0, 15], device=device
    )  # block 1 offset 1, block 0 offset 0, block 3 offset 3
    reshape_and_cache_reference(key, value, k_cache, v_cache, slots)
    for t, (block, offset) in enumerate([(1, 1), (0, 0), (3, 3)]):
        assert torch.equal(k_cache[block, offset], key[t])
        assert torch.equal(v_cache[block, offset], value[t])
    assert int((k_cache.abs().sum(dim=(2, 3)) > 0).sum()) == 3, (
        "a slot outside slot_mapping was written"
    )


def test_rms_norm_reference_is_the_formula(device: torch.device) -> None:
    x = torch.randn(3, 7, 40, device=device, dtype=torch.float64)
    weight = torch.randn(40, device=device, dtype=torch.float64)
    expected = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + 1e-5) * weight
    out = rms_norm_reference(x.float(), weight.float(), 1e-5)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_fused_add_rms_norm_reference_returns_norm_of_sum_and_the_sum(device: torch.device) -> None:
    x = torch.randn(5, 32, device=device).to(torch.bfloat16)
    residual = torch.randn(5, 32, device=device).to(torch.bfloat16)
    weight = torch.rand(32, device=device).to(torch.bfloat16)
    normed, new_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(normed, rms_norm_reference(x + residual, weight, 1e-6))


def _rotate_complex(
    x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, base: float, is_neox: bool
) -> torch.Tensor:
    # Independent formulation: each pair is a complex number multiplied by e^(i * p * theta_j).
    half = rotary_dim // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)  # (R/2,)
    phase = torch.polar(
        torch.ones(len(positions), 1, half, dtype=torch.float64),
        positions.double()[:, None, None] * theta,
    )
    xd = x.double()
    if is_neox:
        z = torch.complex(xd[..., :half], xd[..., half:rotary_dim]) * phase
        rotated = torch.cat((z.real, z.imag), dim=-1)
    else:
        z = torch.complex(xd[..., 0:rotary_dim:2], xd[..., 1:rotary_dim:2]) * phase
        rotated = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    return torch.cat((rotated, xd[..., rotary_dim:]), dim=-1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rotary_reference_is_a_complex_rotation(
    device: torch.device, is_neox: bool, rotary_dim: int
) -> None:
    q = torch.randn(5, 4, 16, device=device)
    k = torch.randn(5, 2, 16, device=device)
    positions = torch.tensor([0, 1, 7, 30, 2], device=device)
    cos, sin = rotary_cos_sin(rotary_dim, 32)
    q_out, k_out = apply_rotary_embedding_reference(
        q, k, positions, cos.to(device), sin.to(device), is_neox=is_neox
    )
    pos = positions.cpu()
    torch.testing.assert_close(
        q_out.double().cpu(),
        _rotate_complex(q.cpu(), pos, rotary_dim, 10000.0, is_neox),
        atol=1e-5,
        rtol=1e-5,
    )
    torch.testing.assert_close(
        k_out.double().cpu(),
        _rotate_complex(k.cpu(), pos, rotary_dim, 10000.0, is_neox),
        atol=1e-5,
        rtol=1e-5,
    )


def test_rotary_makes_attention_scores_depend_on_relative_position_only(
    device: torch.device,
) -> None:
    cos, sin = rotary_cos_sin(16, 64)
    cos, sin = cos.to(device), sin.to(device)
    q = torch.randn(1, 1, 16, device=device).expand(2, 1, 16).contiguous()
    k = torch.randn(1, 1, 16, device=device).expand(2, 1, 16).contiguous()
    # (q at 10, k at 3) and (q at 40, k at 33): same distance, same score.
    q_rot, _ = apply_rotary_embedding(q, k, torch.tensor([10, 40], device=device), cos, sin)
    _, k_rot = apply_rotary_embedding(q, k, torch.tensor([3, 33], device=device), cos, sin)
    scores = (q_rot * k_rot).sum(dim=-1).flatten()
    torch.testing.assert_close(scores[0], scores[1], atol=1e-4, rtol=1e-4)


def test_rotary_inplace_rotates_views_of_a_fused_projection(device: torch.device) -> None:
    qkv = torch.randn(3, (4 + 2 + 2) * 8, device=device)
    before = qkv.clone()
    q, k = qkv[:, :32].view(3, 4, 8), qkv[:, 32:48].view(3, 2, 8)
    cos, sin = rotary_cos_sin(8, 16)
    positions = torch.tensor([1, 2, 3], device=device)
    expected_q, expected_k = apply_rotary_embedding(q, k, positions, cos.to(device), sin.to(device))
    assert torch.equal(qkv, before), "out-of-place rotary changed its inputs"
    apply_rotary_embedding(q, k, positions, cos.to(device), sin.to(device), inplace=True)
    assert torch.equal(qkv[:, :32].view(3, 4, 8), expected_q)
    assert torch.equal(qkv[:, 32:48].view(3, 2, 8), expected_k)
    assert torch.equal(qkv[:, 48:], before[:, 48:]), "rotary touched the value slice"


def test_dispatch_uses_torch_on_cpu_unless_the_interpreter_is_on(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = torch.device("cpu")
    assert use_triton(cpu) == interpreter_enabled()
    monkeypatch.setenv("INFERMUX_KERNELS", "torch")
    assert not use_triton(cpu) and not use_triton(torch.device("cuda"))
    monkeypatch.setenv("INFERMUX_KERNELS", "fastest")
    with pytest.raises(ValueError, match="INFERMUX_KERNELS"):
        use_triton(cpu)


def test_the_model_norm_and_rope_keep_their_torch_ops_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The Triton wiring must not change the CPU path: F.rms_norm and the rotate-half formula,
    # bit for bit, and no kernel dispatcher called (under the interpreter it is, by design).
    import importlib

    import torch.nn.functional as F

    from core_engine.model.norm import rms_norm as model_rms_norm
    from core_engine.model.rope import apply_rotary

    # The modules themselves: core_engine.kernels re-exports functions of the same names.
    rms_norm_module = importlib.import_module("core_engine.kernels.rms_norm")
    rotary_module = importlib.import_module("core_engine.kernels.rotary")
    calls: list[str] = []
    for module, name in ((rms_norm_module, "rms_norm"), (rotary_module, "apply_rotary_embedding")):
        original = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k)
        )
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 8, generator=gen).to(torch.bfloat16)
    weight = torch.rand(8, generator=gen).to(torch.bfloat16)
    cos, sin = (t.to(torch.bfloat16) for t in torch.rand(2, 3, 1, 4, generator=gen))
    normed = model_rms_norm(x, weight, 1e-5)
    rotated = apply_rotary(x, cos, sin)
    if interpreter_enabled():
        assert calls == ["rms_norm", "apply_rotary_embedding"]
        return
    assert calls == []
    assert torch.equal(normed, F.rms_norm(x, (8,), weight, 1e-5))
    x1, x2 = x.chunk(2, dim=-1)
    assert torch.equal(rotated, torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))

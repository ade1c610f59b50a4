"""Every Triton kernel compiles for NVIDIA Hopper (sm_90, the H100/H200) on this machine.

The interpreter runs kernels as Python, so it never sees what only the GPU compiler rejects
(dot shapes, loop-carried types, constexpr use). Triton compiles ahead of time without a GPU:
each kernel is compiled to PTX and a cubin here, with the constexprs its launcher picks for
real model shapes. Not collected under ``TRITON_INTERPRET=1`` (the kernels are interpreted
objects there).
"""

from __future__ import annotations

from typing import Any

import pytest

triton = pytest.importorskip("triton", reason="the dev extra installs triton; the kernels need it")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from core_engine.kernels.triton_ops import (  # noqa: E402
    cache_write,
    paged_attention,
    rms_norm,
    rotary,
    w4a16,
)

HOPPER = GPUTarget("cuda", 90, 32)
AMPERE = GPUTarget("cuda", 80, 32)


def _compile(kernel: Any, *, target: GPUTarget = HOPPER, num_warps: int = 4, **spec: Any) -> Any:
    """Compile ``kernel``: ``*_ptr`` args take their pointer type from ``spec`` (default
    ``*fp32``), upper-case args are constexprs from ``spec``, other names listed in ``spec``
    get that scalar type, the rest are i32."""
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for name in kernel.arg_names:
        if name.isupper():
            constexprs[name] = spec[name]
            signature[name] = "constexpr"
        else:
            signature[name] = spec.get(name, "*fp32" if name.endswith("_ptr") else "i32")
    source = ASTSource(kernel, signature, constexprs)
    compiled = triton.compile(source, target=target, options={"num_warps": num_warps})
    # What compiling proves: an entry point for this kernel in PTX for the asked GPU, and a
    # cubin ptxas assembled from it.
    ptx = compiled.asm["ptx"]
    assert f".entry {kernel.__name__}" in ptx
    assert f".target sm_{target.arch}" in ptx
    assert len(compiled.asm["cubin"]) > 0
    return compiled


PAGED_CASES = {
    # SmolLM2-135M in bf16: 9 heads over 3 kv heads, tensor-core dots, one split.
    "smollm2-bf16": dict(
        dtype="*bf16", GROUP=3, HEAD_DIM=64, BLOCK_SIZE=16, IS_SPLIT=False, DOT_FP32=False
    ),
    # The same over an int8 KV cache (scales per block and kv head), and fp8 e4m3 with splits.
    "smollm2-bf16-int8-kv": dict(
        dtype="*bf16", cache="*i8", GROUP=3, HEAD_DIM=64, BLOCK_SIZE=16, IS_SPLIT=False,
        DOT_FP32=False, QUANTIZED=True,
    ),
    "llama8b-fp16-fp8-kv-split": dict(
        dtype="*fp16", cache="*fp8e4nv", GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, IS_SPLIT=True,
        DOT_FP32=False, QUANTIZED=True,
    ),
    # Llama-8B-like fp16, flash-decoding splits.
    "llama8b-fp16-split": dict(
        dtype="*fp16", GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, IS_SPLIT=True, DOT_FP32=False
    ),
    # fp32 model: exact fp32 dots; an odd block size and head dim.
    "fp32-odd": dict(
        dtype="*fp32", GROUP=1, HEAD_DIM=80, BLOCK_SIZE=6, IS_SPLIT=True, DOT_FP32=True
    ),
}


@pytest.mark.parametrize("case", sorted(PAGED_CASES))
def test_paged_decode_kernel_compiles(case: str) -> None:
    c = PAGED_CASES[case]
    io = {name: c["dtype"] for name in ("out_ptr", "q_ptr")}
    io.update({name: c.get("cache", c["dtype"]) for name in ("k_cache_ptr", "v_cache_ptr")})
    kernel = _compile(
        paged_attention._paged_decode_kernel,
        **io,
        block_tables_ptr="*i32",
        context_lens_ptr="*i32",
        qk_scale="fp32",
        GROUP=c["GROUP"],
        GROUP_PAD=max(16, triton.next_power_of_2(c["GROUP"])),
        HEAD_DIM=c["HEAD_DIM"],
        HEAD_DIM_PAD=triton.next_power_of_2(c["HEAD_DIM"]),
        BLOCK_SIZE=c["BLOCK_SIZE"],
        BLOCK_N=64,
        IS_SPLIT=c["IS_SPLIT"],
        DOT_FP32=c["DOT_FP32"],
        QUANTIZED=c.get("QUANTIZED", False),
    )
    assert ".entry _paged_decode_kernel" in kernel.asm["ptx"]
    if c["IS_SPLIT"]:
        _compile(
            paged_attention._paged_decode_merge_kernel,
            out_ptr=c["dtype"],
            HEAD_DIM=c["HEAD_DIM"],
            HEAD_DIM_PAD=triton.next_power_of_2(c["HEAD_DIM"]),
            NUM_SPLITS_PAD=8,
        )


def test_paged_decode_kernel_compiles_for_ampere() -> None:
    _compile(
        paged_attention._paged_decode_kernel,
        target=AMPERE,
        out_ptr="*bf16",
        q_ptr="*bf16",
        k_cache_ptr="*bf16",
        v_cache_ptr="*bf16",
        block_tables_ptr="*i32",
        context_lens_ptr="*i32",
        qk_scale="fp32",
        GROUP=8,
        GROUP_PAD=16,
        HEAD_DIM=128,
        HEAD_DIM_PAD=128,
        BLOCK_SIZE=16,
        BLOCK_N=64,
        IS_SPLIT=False,
        DOT_FP32=False,
        QUANTIZED=False,
    )


@pytest.mark.parametrize("has_residual", [False, True])
def test_rms_norm_kernel_compiles(has_residual: bool) -> None:
    _compile(
        rms_norm._rms_norm_kernel,
        num_warps=16,
        out_ptr="*bf16",
        new_residual_ptr="*bf16",
        x_ptr="*bf16",
        residual_ptr="*bf16",
        weight_ptr="*bf16",
        eps="fp32",
        HAS_RESIDUAL=has_residual,
        BLOCK=4096,
    )


def test_rotary_and_cache_write_kernels_compile() -> None:
    for is_neox in (True, False):
        _compile(
            rotary._rotary_kernel,
            q_ptr="*bf16",
            k_ptr="*bf16",
            positions_ptr="*i64",
            cos_ptr="*bf16",
            sin_ptr="*bf16",
            HALF=64,
            HALF_PAD=64,
            Q_HEADS_PAD=32,
            K_HEADS_PAD=8,
            IS_NEOX=is_neox,
        )
    _compile(
        cache_write._reshape_and_cache_kernel,
        key_ptr="*bf16",
        value_ptr="*bf16",
        k_cache_ptr="*bf16",
        v_cache_ptr="*bf16",
        slot_mapping_ptr="*i64",
        BLOCK_SIZE=16,
        HEAD_DIM=128,
        HEAD_DIM_PAD=128,
        HEADS_PAD=8,
    )


W4A16_CASES = {
    # (activation dtype, M, K, bias): Llama-8B decode and prefill in fp16/bf16, an fp32 model.
    "decode-fp16": ("*fp16", 1, 4096, False),
    "decode-bf16-bias": ("*bf16", 8, 4096, True),
    "mid-bf16": ("*bf16", 24, 14336, False),
    "prefill-fp16": ("*fp16", 512, 4096, False),
    "fp32-k96": ("*fp32", 3, 96, True),
}


@pytest.mark.parametrize("case", sorted(W4A16_CASES))
def test_w4a16_kernel_compiles(case: str) -> None:
    dtype, m, k, has_bias = W4A16_CASES[case]
    block_m, block_n, block_k = w4a16._default_tiles(m, k)
    for target in (HOPPER, AMPERE) if case == "decode-bf16-bias" else (HOPPER,):
        kernel = _compile(
            w4a16._w4a16_matmul_kernel,
            target=target,
            out_ptr=dtype,
            x_ptr=dtype,
            qweight_ptr="*u8",
            scales_ptr="*fp16",
            mins_ptr="*fp16",
            bias_ptr=dtype,
            HAS_BIAS=has_bias,
            DOT_FP32=dtype == "*fp32",
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
        assert ".entry _w4a16_matmul_kernel" in kernel.asm["ptx"]

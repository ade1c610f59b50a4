"""Per-layer attention variants (:class:`~core_engine.attention.LayerAttention`): a sliding
window, a softmax scale and logit soft-capping, in every attention context and the C++ decode
kernel, against a plain fp32 reference (``kernel_case.reference_attention``). The Triton
kernel's side: ``kernels/test_triton_attention_variants.py``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from core_engine.attention import DEFAULT, ContiguousAttention, LayerAttention
from core_engine.kernels.cpu.paged_decode import paged_decode
from core_engine.paged_attention import KVCache, PagedAttention, build_attention_metadata
from tests.core_engine.kernels.kernel_case import (
    make_paged_kv,
    quantize_paged_kv,
    reference_attention,
)

CPU = torch.device("cpu")
N_HEADS, N_KV, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 4
#: Windows inside one block, across blocks, none; a cap of 1.0 bends scores of std ~1 (head_dim
#: 16 at the default scale 0.25) and ~0.4 (scale 0.1).
SPECS = [
    LayerAttention(scale=scale, window=window, softcap=softcap)
    for window, softcap, scale in itertools.product([None, 3, 8], [None, 1.0], [None, 0.1])
]
#: (compute dtype, kv_cache_dtype) of the pools, and how close they come to the fp32 reference.
POOLS = {
    "float32": (torch.float32, "auto", 1e-5),
    "bfloat16": (torch.bfloat16, "auto", 2e-2),
    "int8": (torch.float32, "int8", 3e-2),
}


def _spec_id(spec: LayerAttention) -> str:
    return f"scale={spec.scale}-window={spec.window}-softcap={spec.softcap}"


def _randn(*shape: int, gen: torch.Generator) -> Tensor:
    return torch.randn(*shape, generator=gen)


# ContiguousAttention ------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_contiguous_attention_prefill_then_decodes_match_the_reference(spec: LayerAttention) -> None:
    gen = torch.Generator().manual_seed(0)
    total, prompt = 25, 20
    q, k, v = _randn(total, N_HEADS, HEAD_DIM, gen=gen), _randn(total, N_KV, HEAD_DIM, gen=gen), _randn(total, N_KV, HEAD_DIM, gen=gen)
    attn = ContiguousAttention(num_layers=1)
    got = [attn.forward(0, q[:prompt], k[:prompt], v[:prompt], spec)]
    for p in range(prompt, total):
        got.append(attn.forward(0, q[p : p + 1], k[p : p + 1], v[p : p + 1], spec))
    want = reference_attention(q, k, v, torch.arange(total), spec)
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-5)


def test_contiguous_attention_default_spec_is_todays_attention() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = _randn(9, N_HEADS, HEAD_DIM, gen=gen), _randn(9, N_KV, HEAD_DIM, gen=gen), _randn(9, N_KV, HEAD_DIM, gen=gen)
    outs = []
    for spec in (None, DEFAULT, LayerAttention()):
        attn = ContiguousAttention(num_layers=1)
        outs.append(torch.cat([attn.forward(0, q[:6], k[:6], v[:6], spec), attn.forward(0, q[6:], k[6:], v[6:], spec)]))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_layer_attention_rejects_values_that_name_no_attention() -> None:
    for kwargs, name in (({"window": 0}, "window"), ({"softcap": 0.0}, "softcap"), ({"scale": -1.0}, "scale")):
        with pytest.raises(ValueError, match=name):
            LayerAttention(**kwargs)  # type: ignore[arg-type]


# PagedAttention -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Seq:
    """One sequence of a paged step: ``num_cached`` tokens before it, ``num_new`` in it."""

    num_cached: int
    num_new: int
    blocks: list[int]
    is_decode: bool


#: Decodes first (as the engine lays a step out), at positions inside and past the windows;
#: a prefill chunk with no prefix and one over a prefix that crosses blocks.
MIXED_STEP = [
    Seq(13, 1, [3, 8, 1, 12], is_decode=True),
    Seq(6, 1, [0, 5], is_decode=True),
    Seq(0, 7, [2, 7], is_decode=False),
    Seq(9, 5, [4, 9, 10, 11], is_decode=False),
]
#: A speculative (3-token) decode next to a single-token one, and a prefill over a prefix.
MULTI_TOKEN_STEP = [
    Seq(11, 3, [3, 8, 1, 12], is_decode=True),
    Seq(6, 1, [0, 5], is_decode=True),
    Seq(9, 5, [4, 9, 10, 11], is_decode=False),
]
NUM_BLOCKS = 14


def _paged_step(
    seqs: list[Seq], spec: LayerAttention, pool: str, *, torch_path: bool, lazy_gather: bool = False
) -> tuple[Tensor, Tensor]:
    """(got, want): one PagedAttention step over ``seqs`` after their cached tokens were
    written, and the reference, both (T, n_heads, hd) float32. ``lazy_gather``: build the
    metadata without the torch path's gather, as for a decode kernel."""
    dtype, cache_dtype, _ = POOLS[pool]
    gen = torch.Generator().manual_seed(2)
    cache = KVCache(
        num_layers=1, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=N_KV, head_dim=HEAD_DIM,
        dtype=dtype, cache_dtype=cache_dtype,
    )
    attn = PagedAttention(cache, num_heads=N_HEADS)
    assert attn.uses_cpu_kernel != torch_path
    kv = []
    for seq in seqs:
        n = seq.num_cached + seq.num_new
        k, v = _randn(n, N_KV, HEAD_DIM, gen=gen).to(dtype), _randn(n, N_KV, HEAD_DIM, gen=gen).to(dtype)
        kv.append((k, v))
        if seq.num_cached:  # the history, written by an earlier prefill
            attn.prepare(build_attention_metadata(
                block_size=BLOCK_SIZE, decodes=[], prefills=[(0, seq.num_cached, seq.blocks)], device=CPU,
                use_kernel=False,
            ))
            attn.forward(0, torch.zeros(seq.num_cached, N_HEADS, HEAD_DIM, dtype=dtype), k[: seq.num_cached], v[: seq.num_cached], spec)
    decodes = [
        (s.num_cached, s.blocks) if s.num_new == 1 else (s.num_cached, s.blocks, s.num_new) for s in seqs if s.is_decode
    ]
    prefills = [(s.num_cached, s.num_new, s.blocks) for s in seqs if not s.is_decode]
    attn.prepare(build_attention_metadata(
        block_size=BLOCK_SIZE, decodes=decodes, prefills=prefills, device=CPU, use_kernel=False,
        decode_gather=not (lazy_gather or attn.uses_cpu_kernel),
    ))
    if lazy_gather:
        assert attn.metadata is not None and attn.metadata.decode_slots is None
    num_tokens = sum(s.num_new for s in seqs)
    q = _randn(num_tokens, N_HEADS, HEAD_DIM, gen=gen).to(dtype)
    new_k = torch.cat([k[s.num_cached :] for s, (k, _) in zip(seqs, kv, strict=True)])
    new_v = torch.cat([v[s.num_cached :] for s, (_, v) in zip(seqs, kv, strict=True)])
    got = attn.forward(0, q, new_k, new_v, spec)
    want, row = [], 0
    for seq, (k, v) in zip(seqs, kv, strict=True):
        positions = torch.arange(seq.num_cached, seq.num_cached + seq.num_new)
        want.append(reference_attention(q[row : row + seq.num_new], k, v, positions, spec))
        row += seq.num_new
    return got.float(), torch.cat(want)


@pytest.fixture(params=["cpp", "torch"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The decode path: the C++ kernel (the CPU default) or ``INFERMUX_KERNELS=torch``."""
    if request.param == "torch":
        monkeypatch.setenv("INFERMUX_KERNELS", "torch")
    else:
        monkeypatch.delenv("INFERMUX_KERNELS", raising=False)
    return str(request.param)


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_paged_attention_mixed_step_matches_the_reference(spec: LayerAttention, pool: str, kernel_path: str) -> None:
    got, want = _paged_step(MIXED_STEP, spec, pool, torch_path=kernel_path == "torch")
    atol = POOLS[pool][2]
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.window is not None or s.softcap is not None], ids=_spec_id)
def test_torch_decode_path_builds_the_gather_a_kernel_left_out(spec: LayerAttention, monkeypatch: pytest.MonkeyPatch) -> None:
    # Metadata built for the Triton kernel has no decode_slots/decode_mask; a windowed or
    # soft-capped layer, which that kernel cannot run, decodes on the torch path anyway.
    monkeypatch.setenv("INFERMUX_KERNELS", "torch")
    got, want = _paged_step(MIXED_STEP, spec, "float32", torch_path=True, lazy_gather=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pool", ["float32", "int8"])
@pytest.mark.parametrize("spec", [s for s in SPECS if s.window is not None], ids=_spec_id)
def test_paged_attention_multi_token_decodes_honour_the_window(spec: LayerAttention, pool: str) -> None:
    got, want = _paged_step(MULTI_TOKEN_STEP, spec, pool, torch_path=False)
    atol = POOLS[pool][2]
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)


# The C++ decode kernel ----------------------------------------------------------------------


def _kernel_case(cache: str, head_dim: int = HEAD_DIM) -> tuple[tuple[Tensor, ...], dict[str, Tensor | None], list[Tensor], list[Tensor]]:
    """(q, k_cache, v_cache, block_tables, context_lens), scales, and each sequence's dense
    keys and values (dequantized for int8)."""
    lens = [1, 4, 5, 11, 23]
    paged = make_paged_kv(lens, block_size=BLOCK_SIZE, n_kv_heads=N_KV, head_dim=head_dim, dtype=torch.float32, device=CPU, seed=5)
    q = torch.randn(len(lens), N_HEADS, head_dim, generator=torch.Generator().manual_seed(6))
    k_cache, v_cache, scales = paged.k_cache, paged.v_cache, {"k_scale": None, "v_scale": None}
    keys, values = list(paged.keys), list(paged.values)
    if cache == "int8":
        quantized = quantize_paged_kv(paged, torch.int8)
        k_cache, v_cache = quantized.k_codes, quantized.v_codes
        scales = {"k_scale": quantized.k_scale, "v_scale": quantized.v_scale}
        keys, values = quantized.keys, quantized.values
    return (q, k_cache, v_cache, paged.block_tables, paged.context_lens), scales, keys, values


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 12])  # the AVX2 loops and the portable ones
@pytest.mark.parametrize("cache", ["float32", "int8"])
@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_cpp_kernel_matches_the_reference(spec: LayerAttention, cache: str, head_dim: int) -> None:
    args, scales, keys, values = _kernel_case(cache, head_dim)
    scale = head_dim**-0.5 if spec.scale is None else spec.scale
    got = paged_decode(*args, scale, **scales, window=spec.window, softcap=spec.softcap)
    for s, (k, v) in enumerate(zip(keys, values, strict=True)):
        want = reference_attention(args[0][s : s + 1], k, v, torch.tensor([k.shape[0] - 1]), spec)
        torch.testing.assert_close(got[s : s + 1], want, atol=1e-5, rtol=1e-5)


def test_cpp_kernel_window_wider_than_the_context_is_no_window() -> None:
    args, scales, _, _ = _kernel_case("float32")
    plain = paged_decode(*args, 0.25, **scales)
    assert torch.equal(paged_decode(*args, 0.25, **scales, window=23), plain)
    assert torch.equal(paged_decode(*args, 0.25, **scales, window=1000), plain)
    assert not torch.equal(paged_decode(*args, 0.25, **scales, window=22), plain)


def test_cpp_kernel_window_of_one_returns_the_last_value() -> None:
    (q, k_cache, v_cache, tables, lens), scales, _, values = _kernel_case("float32")
    got = paged_decode(q, k_cache, v_cache, tables, lens, 0.25, **scales, window=1, softcap=5.0)
    last = torch.stack([v[-1] for v in values]).repeat_interleave(N_HEADS // N_KV, dim=1)  # (S, H, hd)
    torch.testing.assert_close(got, last, atol=1e-6, rtol=0)


def test_cpp_kernel_reads_nothing_before_the_window() -> None:
    # NaN in every key and value before the window: a kernel that reads them returns NaN.
    (q, k_cache, v_cache, tables, lens), scales, keys, values = _kernel_case("float32")
    window = 6
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    for s, n in enumerate(lens.tolist()):
        for j in range(max(0, n - window)):
            block = int(tables[s, j // BLOCK_SIZE])
            k_cache[block, j % BLOCK_SIZE] = v_cache[block, j % BLOCK_SIZE] = float("nan")
    got = paged_decode(q, k_cache, v_cache, tables, lens, 0.25, window=window)
    spec = LayerAttention(scale=0.25, window=window)
    for s, (k, v) in enumerate(zip(keys, values, strict=True)):
        want = reference_attention(q[s : s + 1], k, v, torch.tensor([k.shape[0] - 1]), spec)
        torch.testing.assert_close(got[s : s + 1], want, atol=1e-5, rtol=1e-5)


def test_cpp_kernel_rejects_a_window_or_softcap_that_names_no_attention() -> None:
    args, scales, _, _ = _kernel_case("float32")
    with pytest.raises(ValueError, match="window"):
        paged_decode(*args, 0.25, **scales, window=0)
    with pytest.raises(ValueError, match="softcap"):
        paged_decode(*args, 0.25, **scales, softcap=-1.0)

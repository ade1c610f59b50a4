"""The C++ CPU decode attention (core_engine/kernels/cpu/paged_decode.cpp): against the torch
reference on random paged caches, and the engine on it against the engine on the torch path."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from backends.default_model import default_model_path
from core_engine.kernels.cpu import cpu_extension
from core_engine.kernels.cpu.paged_decode import paged_decode
from core_engine.kernels.paged_attention import paged_attention_decode_reference
from core_engine.llm_engine import LLMEngine
from core_engine.sampling_params import SamplingParams
from tests.core_engine.engine_util import engine_like, make_engine, run_all
from tests.core_engine.kernels.kernel_case import make_paged_kv, quantize_paged_kv

BLOCK_SIZE = 16
#: A lone token, exactly one block, one token into the second block, several blocks.
CONTEXT_LENS = [1, BLOCK_SIZE, BLOCK_SIZE + 1, 100]
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

Kernel = Callable[..., Tensor]


def _case(
    cache_dtype: torch.dtype, query_dtype: torch.dtype, group: int, head_dim: int, seed: int = 0
) -> tuple[tuple[Tensor, ...], dict[str, Tensor | None]]:
    """(q, k_cache, v_cache, block_tables, context_lens) and the scales, for 3 kv heads.

    Slots nobody wrote are NaN (int8: the largest code, unowned blocks a NaN scale), so a
    kernel that reads past a sequence's end shows it.
    """
    n_kv = 3
    plain = torch.float32 if cache_dtype == torch.int8 else cache_dtype
    paged = make_paged_kv(
        CONTEXT_LENS, block_size=BLOCK_SIZE, n_kv_heads=n_kv, head_dim=head_dim, dtype=plain,
        device=torch.device("cpu"), seed=seed,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn((len(CONTEXT_LENS), n_kv * group, head_dim), generator=gen).to(query_dtype)
    scales: dict[str, Tensor | None] = {"k_scale": None, "v_scale": None}
    k_cache, v_cache = paged.k_cache, paged.v_cache
    if cache_dtype == torch.int8:
        quantized = quantize_paged_kv(paged, torch.int8)
        k_cache, v_cache = quantized.k_codes, quantized.v_codes
        scales = {"k_scale": quantized.k_scale, "v_scale": quantized.v_scale}
    return (q, k_cache, v_cache, paged.block_tables, paged.context_lens), scales


def _assert_matches_reference(kernel: Kernel, cache_dtype: torch.dtype, query_dtype: torch.dtype, group: int,
                              head_dim: int) -> None:
    args, scales = _case(cache_dtype, query_dtype, group, head_dim)
    scale = head_dim**-0.5
    got = kernel(*args, scale, **scales)
    want = paged_attention_decode_reference(*args, scale, **scales)
    assert got.dtype == query_dtype and got.shape == want.shape
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL[query_dtype], rtol=ATOL[query_dtype])


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize(
    ("cache_dtype", "query_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.int8, torch.float32),
        (torch.int8, torch.bfloat16),
    ],
    ids=["fp32", "bf16", "bf16-cache-fp32-q", "int8", "int8-bf16-q"],
)
def test_kernel_matches_the_reference(cache_dtype: torch.dtype, query_dtype: torch.dtype, group: int) -> None:
    _assert_matches_reference(paged_decode, cache_dtype, query_dtype, group, head_dim=64)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_head_dims_off_the_vector_width_take_the_portable_loops(cache_dtype: torch.dtype) -> None:
    query_dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    _assert_matches_reference(paged_decode, cache_dtype, query_dtype, group=3, head_dim=20)


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_the_build_without_avx_matches_the_reference(cache_dtype: torch.dtype) -> None:
    kernel = cpu_extension("paged_decode", march="x86-64").paged_decode
    query_dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    _assert_matches_reference(kernel, cache_dtype, query_dtype, group=3, head_dim=64)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_one_long_sequence_is_split_over_threads_by_kv_head(cache_dtype: torch.dtype) -> None:
    # One sequence, two threads: two tasks of 2 and 1 kv heads (3000 rows, past the grain).
    plain = torch.float32
    paged = make_paged_kv([1000], block_size=BLOCK_SIZE, n_kv_heads=3, head_dim=64, dtype=plain,
                          device=torch.device("cpu"), seed=3)
    k_cache, v_cache, scales = paged.k_cache, paged.v_cache, {"k_scale": None, "v_scale": None}
    if cache_dtype == torch.int8:
        quantized = quantize_paged_kv(paged, torch.int8)
        k_cache, v_cache = quantized.k_codes, quantized.v_codes
        scales = {"k_scale": quantized.k_scale, "v_scale": quantized.v_scale}
    q = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(4))
    args = (q, k_cache, v_cache, paged.block_tables, paged.context_lens, 0.125)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = paged_decode(*args, **scales)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, paged_attention_decode_reference(*args, **scales), atol=1e-5, rtol=1e-5)


def test_query_rows_are_read_in_place_from_a_wider_tensor() -> None:
    (q, *rest), scales = _case(torch.float32, torch.float32, group=3, head_dim=64)
    # As the model passes them: q is the first n_heads of a (T, n_heads + n_kv, hd) tensor.
    qk = torch.cat([q, torch.randn(q.shape[0], 3, q.shape[2])], dim=1)
    strided = qk[:, : q.shape[1]]
    assert not strided.is_contiguous()
    torch.testing.assert_close(paged_decode(strided, *rest, 0.125), paged_decode(q, *rest, 0.125), atol=0, rtol=0)


def test_bad_arguments_raise_value_errors_that_name_them() -> None:
    (q, k_cache, v_cache, tables, lens), _ = _case(torch.float32, torch.float32, group=3, head_dim=64)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode(q, k_cache, v_cache, tables, lens.clone().fill_(tables.shape[1] * BLOCK_SIZE + 1), 0.125)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode(q, k_cache, v_cache, tables.clone().fill_(k_cache.shape[0]), lens, 0.125)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode(q, k_cache.to(torch.int8), v_cache.to(torch.int8), tables, lens, 0.125)
    if hasattr(torch, "float8_e4m3fn"):
        codes = torch.zeros(k_cache.shape, dtype=torch.float8_e4m3fn)
        scale = torch.ones(k_cache.shape[0], k_cache.shape[2])
        with pytest.raises(ValueError, match="k_cache"):
            paged_decode(q, codes, codes, tables, lens, 0.125, scale, scale)


# -- the engine on the C++ path vs the torch path ------------------------------------------

PROMPTS = {
    "france": "The capital of France is",
    "code": "def fibonacci(n):\n",
    "story": "Once upon a time, in a small village,",
    "long": "The history of the city begins in the early twelfth century, when a small group of "
    "farmers settled along the river. Over the next two hundred years the settlement grew into "
    "a busy market town, and merchants came from the surrounding villages to sell grain and wool. "
    "By the time the first stone bridge was built,",
}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engines() -> tuple[LLMEngine, LLMEngine]:
    """The default model on the C++ decode attention, and a second engine over the same
    weights on the torch path (``INFERMUX_KERNELS=torch``); the chunk budget makes prompts
    prefill over several steps while others decode. Dense fp32 weights: the block formats'
    8-bit activations would turn the two paths' ~1e-7 differences into the odd near-tie flip."""
    cpp = make_engine(default_model_path(), weight_format="dense", max_num_batched_tokens=32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("INFERMUX_KERNELS", "torch")
        torch_path = engine_like(cpp)
    assert cpp.model_runner.attn.uses_cpu_kernel
    assert not torch_path.model_runner.attn.uses_cpu_kernel
    return cpp, torch_path


@pytest.mark.slow
def test_engine_on_the_cpu_kernel_decodes_like_the_torch_path_one_request_at_a_time(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    cpp, torch_path = engines
    for req_id, prompt in PROMPTS.items():
        got = run_all(cpp, {req_id: prompt}, GREEDY)[req_id]["token_ids"]
        want = run_all(torch_path, {req_id: prompt}, GREEDY)[req_id]["token_ids"]
        assert got == want, req_id


@pytest.mark.slow
def test_engine_on_the_cpu_kernel_decodes_like_the_torch_path_four_at_a_time(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    cpp, torch_path = engines
    got, want = run_all(cpp, PROMPTS, GREEDY), run_all(torch_path, PROMPTS, GREEDY)
    for req_id in PROMPTS:
        assert got[req_id]["token_ids"] == want[req_id]["token_ids"], req_id
    assert "Paris" in str(got["france"]["text"])

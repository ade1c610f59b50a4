"""Matmul weight storage: fp16-packed weights give the dense model's answers; int8 weights stay
as close to the exact model as llama.cpp's own 8-bit arithmetic.

``EngineConfig.weight_format="fp16"`` stores every projection and the LM head as fp16 for
fbgemm (CPU, fp32 compute). The file's weights are 4-bit blocks with fp16 scales, so the fp16 copy is within 2^-11 of each weight: the logits must stay within a small
fraction of their spread and greedy decoding must not change.

``weight_format="int8"`` (opt-in) requantises each projection to int8 rows and multiplies
16-bit fixed-point activations in int8 GEMMs (the compiled kernel of
``core_engine.kernels.cpu``); the LM head's top logits are recomputed exactly. It is lossy, so
it is held to the yardstick llama.cpp sets on the same file: the mean KL divergence from the
exact model's next-token distribution may not exceed twice llama.cpp's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from backends.default_model import default_model_path
from core_engine.attention import ContiguousAttention
from core_engine.gguf_loader import load_model
from core_engine.model.linear import (
    DenseLinear,
    Fp16Linear,
    Int8Linear,
    TopKRefinedLinear,
    resolve_weight_format,
)
from core_engine.sampling_params import SamplingParams
from tests.core_engine.engine_util import make_engine, reference_greedy, run_all
from tests.core_engine.gguf_factory import write_llama_gguf

TEXT = (
    "The history of the city begins in the early twelfth century, when a small group of farmers "
    "settled along the river. Over the next two hundred years the settlement grew into a busy "
    "market town, and merchants came from the surrounding villages to sell grain and wool."
)
PROMPTS = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), ContiguousAttention(model.config.num_layers))


def test_fp16_linear_matches_dense_product_of_fp16_rounded_weights() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(7, 80, generator=gen)
    packed = Fp16Linear(weight, bias)
    expected = torch.nn.functional.linear(x, weight.half().float(), bias)
    torch.testing.assert_close(packed(x), expected, atol=1e-4, rtol=1e-4)
    residual = torch.randn(7, 96, generator=gen)
    torch.testing.assert_close(Fp16Linear(weight).add_to(residual, x), residual + expected - bias, atol=1e-4, rtol=1e-4)
    assert packed.nbytes == 96 * 80 * 2 + 96 * 4
    assert DenseLinear(weight, bias).nbytes == 96 * 80 * 4 + 96 * 4


def test_weight_format_is_validated() -> None:
    assert resolve_weight_format("auto", dtype=torch.float32, device="cpu") == "dense"
    assert resolve_weight_format("fp16", dtype=torch.float32, device="cpu") == "fp16"
    assert resolve_weight_format("auto", dtype=torch.bfloat16, device="cpu") == "dense"
    assert resolve_weight_format("int8", dtype=torch.float32, device="cpu") == "int8"
    with pytest.raises(ValueError, match="weight_format must be one of auto, dense, fp16, int8; got 'int3'"):
        resolve_weight_format("int3", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="weight_format='fp16' needs fp32 compute"):
        resolve_weight_format("fp16", dtype=torch.bfloat16, device="cpu")


def test_packing_frees_the_dense_weights_and_keeps_the_outputs(tmp_path) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf")
    model, config, tok = load_model(path, dtype=torch.float32, show_progress=False)
    ids = tok.encode(TEXT)
    dense = _logits(model, ids)
    dense_bytes = model.matmul_weight_bytes()
    assert model.set_weight_format("fp16") == "fp16"
    assert model.layers[0].qkv_proj is None and model.layers[0].gate_up_proj is None
    assert model.matmul_weight_bytes() == dense_bytes // 2
    packed = _logits(model, ids)
    # The tiny model's weights are arbitrary fp32 values, each rounded by up to 2^-11 relative.
    assert (packed - dense).abs().max() <= 5e-3 * dense.abs().max()
    assert model.set_weight_format("fp16") == "fp16"  # idempotent
    with pytest.raises(ValueError, match="already packed"):
        model.set_weight_format("dense")


def test_smollm2_fp16_weights_decode_like_dense_fp32() -> None:
    path = default_model_path()
    dense = make_engine(path, weight_format="dense")
    packed = make_engine(path, weight_format="fp16")
    assert dense.model_runner.model.weight_format == "dense"
    assert packed.model_runner.model.weight_format == "fp16"
    tok = dense.tokenizer
    ids = tok.encode(TEXT)
    a, b = _logits(dense.model_runner.model, ids), _logits(packed.model_runner.model, ids)
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.99
    assert (a - b).abs().max() <= 0.01 * a.abs().max()
    for prompt in PROMPTS:
        prompt_ids = tok.encode(prompt)
        assert reference_greedy(packed, prompt_ids, 24) == reference_greedy(dense, prompt_ids, 24), prompt


def test_int8_linear_is_the_product_of_its_int8_weights_with_16_bit_activations() -> None:
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    lin = Int8Linear(weight, bias)
    assert lin.nbytes == 200 * 96 + 200 * 4 + 200 * 4
    dequantized = lin._weight.float() * lin._scale[:, None]
    assert (dequantized - weight).abs().max() <= lin._scale.max() / 2 + 1e-6  # one int8 step
    for rows in (1, 5, 64):
        x = torch.randn(rows, 96, generator=gen) * 3
        expected = torch.nn.functional.linear(x, dequantized, bias)
        # 16-bit activations: each term off by <= max|x| / 2^15 (8-bit ones would be ~250x
        # further off: ~0.5 here).
        torch.testing.assert_close(lin(x), expected, atol=1e-2, rtol=1e-4)
        residual = torch.randn(rows, 200, generator=gen)
        torch.testing.assert_close(lin.add_to(residual, x), residual + expected, atol=1e-2, rtol=1e-4)
    precise = Int8Linear(weight, precise=True)
    x = torch.randn(4, 96, generator=gen)
    torch.testing.assert_close(precise(x), x @ weight.T, atol=1e-2, rtol=1e-3)
    zeros = torch.zeros(3, 96)  # an all-zero row has no scale to take: must not divide by zero
    assert torch.equal(Int8Linear(weight)(zeros), torch.zeros(3, 200))


def test_topk_refined_head_makes_the_top_logits_exact() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(500, 64, generator=gen)
    x = torch.randn(6, 64, generator=gen)
    exact = x @ weight.T
    head = TopKRefinedLinear(Int8Linear(weight), weight, k=8)
    refined = head(x)
    assert head(x[:0]).shape == (0, 500)  # a prefill chunk that samples nothing
    top = exact.topk(8, dim=-1).indices
    torch.testing.assert_close(refined.gather(1, top), exact.gather(1, top), atol=1e-5, rtol=1e-5)
    assert torch.equal(refined.argmax(-1), exact.argmax(-1))
    assert (refined - exact).abs().max() < 0.5  # the rest: one-digit int8 products


def test_smollm2_int8_weights_stay_as_close_to_exact_as_llamacpp() -> None:
    import llama_cpp
    import numpy as np

    path = default_model_path()
    dense = make_engine(path, weight_format="dense")
    packed = make_engine(path, weight_format="int8")
    model = packed.model_runner.model
    assert model.weight_format == "int8"
    assert model.matmul_weight_bytes() < dense.model_runner.model.matmul_weight_bytes() / 3.5
    ids = dense.tokenizer.encode(TEXT * 3)
    exact = _logits(dense.model_runner.model, ids)
    ours = _logits(model, ids)
    llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=1, logits_all=True, verbose=False)
    try:
        llm.eval(ids)
        theirs = torch.from_numpy(np.array(llm.scores[: len(ids)]))
    finally:
        llm.close()

    def kl_from_exact(logits: torch.Tensor) -> float:
        p = exact.log_softmax(-1)
        return float((p.exp() * (p - logits.float().log_softmax(-1))).sum(-1).mean())

    ours_kl, llama_kl = kl_from_exact(ours), kl_from_exact(theirs)
    assert ours_kl <= 2 * llama_kl, f"int8 KL {ours_kl:.5f} vs llama.cpp's {llama_kl:.5f}"
    assert float((ours.argmax(-1) == exact.argmax(-1)).float().mean()) >= 0.9
    # Rows are quantised one by one: a request's tokens do not depend on what it is batched with.
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = {f"p{i}": prompt for i, prompt in enumerate(PROMPTS)}
    together = run_all(packed, prompts, greedy)
    for key, prompt in prompts.items():
        alone = run_all(packed, {key: prompt}, greedy)[key]
        assert alone["token_ids"] == together[key]["token_ids"], prompt

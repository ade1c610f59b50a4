"""Matmul weight storage: fp16-packed weights (the CPU default) give the dense model's answers.

``EngineConfig.weight_format="auto"`` stores every projection and the LM head as fp16 for
fbgemm when the engine computes in fp32 on a CPU. The file's weights are 4-bit blocks with fp16
scales, so the fp16 copy is within 2^-11 of each weight: the logits must stay within a small
fraction of their spread and greedy decoding must not change.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from backends.default_model import default_model_path
from core_engine.attention import ContiguousAttention
from core_engine.gguf_loader import load_model
from core_engine.model.linear import DenseLinear, Fp16Linear, resolve_weight_format
from tests.core_engine.engine_util import make_engine, reference_greedy
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
    assert resolve_weight_format("auto", dtype=torch.float32, device="cpu") == "fp16"
    assert resolve_weight_format("auto", dtype=torch.bfloat16, device="cpu") == "dense"
    with pytest.raises(ValueError, match="weight_format must be one of auto, dense, fp16; got 'int3'"):
        resolve_weight_format("int3", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="weight_format='fp16' needs fp32 compute"):
        resolve_weight_format("fp16", dtype=torch.bfloat16, device="cpu")


def test_packing_frees_the_dense_weights_and_keeps_the_outputs(tmp_path) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf")
    model, config, tok = load_model(path, dtype=torch.float32, show_progress=False)
    ids = tok.encode(TEXT)
    dense = _logits(model, ids)
    dense_bytes = model.matmul_weight_bytes()
    assert model.set_weight_format("auto") == "fp16"
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
    packed = make_engine(path, weight_format="auto")
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

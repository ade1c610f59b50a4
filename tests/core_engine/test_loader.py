"""GGUF loading: metadata → config, exact dequantisation, clear errors for files we cannot run."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from backends.default_model import default_model_path
from core_engine.gguf_loader import GGUFFile, GGUFLoadError, load_model
from core_engine.model.quant import UnsupportedTensorTypeError, dequantize
from tests.core_engine.gguf_factory import TinyLlamaSpec, write_llama_gguf


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_dequantize_is_bit_exact_with_ggml_reference(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    weights = (rng.standard_normal((96, 256)) * rng.uniform(0.01, 3.0, (96, 1))).astype(np.float32)
    weights[3, :32] = 0.0  # an all-zero block (scale 0)
    data = weights.astype(np.float16) if qtype == Q.F16 else gguf.quants.quantize(weights, qtype)
    reference = gguf.quants.dequantize(data, qtype)  # ggml's formulas, in numpy
    ours = dequantize(data, qtype, (96, 256))
    assert ours.dtype == torch.float32 and ours.shape == (96, 256)
    assert np.array_equal(ours.numpy(), reference)


def test_unsupported_tensor_type_names_it() -> None:
    with pytest.raises(UnsupportedTensorTypeError, match="IQ2_XXS.*supported: .*Q4_K.*Q6_K"):
        dequantize(np.zeros(66, np.uint8), Q.IQ2_XXS, (256,), name="blk.0.ffn_down.weight")


def test_smollm2_config_from_metadata() -> None:
    config = GGUFFile(default_model_path()).llama_config()
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.context_length == 8192
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.tie_word_embeddings  # SmolLM2 has no output.weight
    assert config.rms_eps == pytest.approx(1e-5)


def test_load_builds_fused_weights_and_logs_progress(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf")
    with caplog.at_level(logging.INFO, logger="core_engine.gguf_loader"):
        model, config, tokenizer = load_model(path, dtype=torch.float32, show_progress=False)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("loading tiny.gguf") for m in messages)
    assert any(m.startswith("loaded tiny.gguf") for m in messages)
    layer = model.layers[0]
    assert layer.qkv_proj.shape == (config.q_size + 2 * config.kv_size, config.hidden_size)
    assert layer.gate_up_proj.shape == (2 * config.intermediate_size, config.hidden_size)
    assert not config.tie_word_embeddings and model.lm_head is not model.embed_tokens
    assert tokenizer.vocab_size == config.vocab_size
    assert all(not p.requires_grad for p in model.parameters())


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "tied.gguf", spec=TinyLlamaSpec(tie_embeddings=True))
    model, config, _ = load_model(path, dtype=torch.float32, show_progress=False)
    assert config.tie_word_embeddings and model.lm_head is model.embed_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    path = write_llama_gguf(tmp_path / "tiny.gguf", weight_type=Q.Q4_1)
    model, _, _ = load_model(path, dtype=dtype, show_progress=False)
    assert {p.dtype for p in model.parameters()} == {dtype}


def test_linear_rope_scaling_is_read(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "lin.gguf", spec=TinyLlamaSpec(rope_scaling=("linear", 4.0)))
    scaling = GGUFFile(path).llama_config().rope_scaling
    assert scaling is not None and (scaling.kind, scaling.factor) == ("linear", 4.0)


def test_yarn_rope_scaling_is_refused(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "yarn.gguf", spec=TinyLlamaSpec(rope_scaling=("yarn", 4.0)))
    with pytest.raises(GGUFLoadError, match="yarn"):
        GGUFFile(path).llama_config()


def test_other_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "falcon.gguf", spec=TinyLlamaSpec(architecture="falcon"))
    with pytest.raises(
        GGUFLoadError, match=r"architecture 'falcon' is not supported \(supported: gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe\)"
    ):
        load_model(path, show_progress=False)


def test_a_tensor_the_architecture_needs_is_named_when_missing(tmp_path: Path) -> None:
    # A phi3 file must hold the fused attn_qkv tensor (the llama-style q/k/v are not read).
    path = write_llama_gguf(tmp_path / "phi.gguf", spec=TinyLlamaSpec(architecture="phi3"))
    with pytest.raises(GGUFLoadError, match="blk.0.attn_qkv.weight is missing"):
        load_model(path, show_progress=False)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "broken.gguf", omit=frozenset({"blk.1.ffn_down.weight"}))
    with pytest.raises(GGUFLoadError, match=r"blk\.1\.ffn_down\.weight"):
        load_model(path, show_progress=False)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_text("definitely not a gguf file")
    with pytest.raises(GGUFLoadError, match="not a readable GGUF"):
        GGUFFile(path)
    with pytest.raises(FileNotFoundError):
        GGUFFile(tmp_path / "missing.gguf")

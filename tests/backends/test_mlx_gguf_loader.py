"""GGUF files into mlx-lm's Llama model: tiny random-weight files checked against llama.cpp.

With float32 weights and a float32 KV cache llama.cpp computes in plain float32, so the two
engines must give the same logits; that pins down the tensor mapping, grouped-query heads,
and the RoPE layout of GGUF's permuted q/k rows. Quantized files check that Q4_0/Q4_1/Q8_0
stay quantized and decode to exactly what GGML's formats mean, and that the logits track
llama.cpp's (which rounds activations to 8 bits and keeps a float16 KV cache) within
tolerances that hold whichever kernels llama.cpp picks for the CPU, prompt and decode steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import llama_cpp
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType
from mlx_lm.models.cache import make_prompt_cache

from backends.mlx.gguf_loader import GGUFLoadError, load_gguf_model
from core_engine.tokenizer.byte_level import BYTE_TO_CHAR

Q4_0, Q4_1, Q5_0, Q8_0 = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q8_0,
)
TOKENS = list(range(100, 400, 7))  # 43 positions


#: Largest logit difference to llama.cpp on a quantized tiny model, relative to its largest
#: logit: its 8-bit activation blocks and float16 KV cache against MLX's exact products.
QUANTIZED_TOLERANCE = 0.1


def write_tiny_gguf(
    path: Path,
    *,
    linear_type: GGMLQuantizationType | None = None,
    tied: bool = True,
    rope_factors: bool = False,
    architecture: str = "llama",
) -> Path:
    """A 2-layer Llama (dim 64, 4 query / 2 KV heads) with a 512-token byte-level vocabulary."""
    rng = np.random.default_rng(0)
    dim, ffn, num_heads, num_kv_heads, num_layers = 64, 128, 4, 2, 2
    head_dim = dim // num_heads
    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_context_length(256)
    writer.add_embedding_length(dim)
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    # llama.cpp needs a tokenizer to load a model: the 256 byte tokens, a few words, BOS/EOS.
    tokens = [*BYTE_TO_CHAR, "Ġw", *(f"Ġw{i}" for i in range(253)), "<s>", "</s>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])  # NORMAL..., CONTROL, CONTROL
    writer.add_token_merges(["Ġ w"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    vocab = len(tokens)

    def add(name: str, shape: tuple[int, int], qtype: GGMLQuantizationType | None, std: float):
        values = (rng.standard_normal(shape) * std).astype(np.float32)
        if qtype is None:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    embedding_type = Q8_0 if linear_type is not None else None
    add("token_embd.weight", (vocab, dim), embedding_type, 1.0)
    for layer in range(num_layers):
        block = f"blk.{layer}."
        for norm in ("attn_norm", "ffn_norm"):
            weight = 1.0 + 0.1 * rng.standard_normal(dim)
            writer.add_tensor(block + norm + ".weight", weight.astype(np.float32))
        add(block + "attn_q.weight", (dim, dim), linear_type, 0.1)
        add(block + "attn_k.weight", (num_kv_heads * head_dim, dim), linear_type, 0.1)
        add(block + "attn_v.weight", (num_kv_heads * head_dim, dim), linear_type, 0.1)
        add(block + "attn_output.weight", (dim, dim), linear_type, 0.1)
        add(block + "ffn_gate.weight", (ffn, dim), linear_type, 0.1)
        add(block + "ffn_up.weight", (ffn, dim), linear_type, 0.1)
        add(block + "ffn_down.weight", (dim, ffn), embedding_type, 0.1)
    writer.add_tensor("output_norm.weight", np.ones(dim, dtype=np.float32))
    if not tied:
        add("output.weight", (vocab, dim), embedding_type, 0.5)
    if rope_factors:  # Llama 3 style per-frequency divisors
        writer.add_tensor("rope_freqs.weight", np.linspace(1, 8, head_dim // 2, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def mlx_logits(path: Path) -> np.ndarray:
    model = load_gguf_model(path).model
    return np.array(model(mx.array(TOKENS)[None])[0])  # (T, vocab)


def llamacpp_logits(path: Path, *, float_kv: bool = True) -> np.ndarray:
    """llama.cpp's logits of TOKENS; ``float_kv``: a float32 KV cache, else its default F16."""
    kv_types = {"type_k": 0, "type_v": 0} if float_kv else {}  # GGML type 0 is F32
    llm = llama_cpp.Llama(
        str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=1, **kv_types
    )
    try:
        llm.eval(TOKENS)
        return np.array(llm.scores[: len(TOKENS)])
    finally:
        llm.close()


@pytest.mark.parametrize(
    "variant",
    [{}, {"tied": False}, {"rope_factors": True}],
    ids=["tied-embeddings", "separate-output", "rope-factors"],
)
def test_float_weights_give_llamacpps_logits(tmp_path: Path, variant: dict[str, bool]) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", **variant)
    ours, theirs = mlx_logits(path), llamacpp_logits(path)
    assert np.abs(ours - theirs).max() < 1e-3 * np.abs(theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.parametrize("linear_type", [Q4_0, Q4_1], ids=["q4_0", "q4_1"])
def test_quantized_weights_stay_quantized_and_decode_like_ggml(
    tmp_path: Path, linear_type: GGMLQuantizationType
) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", linear_type=linear_type)
    model = load_gguf_model(path).model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear)
    assert (layer.self_attn.q_proj.bits, layer.self_attn.q_proj.group_size) == (4, 32)
    assert layer.mlp.down_proj.bits == 8  # Q8_0
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    # Each packed matrix decodes to exactly GGML's dequantization of the same blocks.
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: t for t in reader.tensors}["blk.0.attn_q.weight"]
    expected = gguf.quants.dequantize(stored.data, stored.tensor_type).reshape(64, 64)
    q_proj = layer.self_attn.q_proj
    decoded = mx.dequantize(
        q_proj.weight, q_proj.scales, q_proj.biases, group_size=32, bits=4
    )  # (out, in)
    np.testing.assert_allclose(np.array(decoded), expected, rtol=1e-6, atol=1e-6)
    # llama.cpp rounds activations to 8 bits for quantized matmuls: close, not equal.
    ours, theirs = mlx_logits(path), llamacpp_logits(path)
    assert np.abs(ours - theirs).max() < 0.1 * np.abs(theirs).max()


@pytest.mark.parametrize(
    "variant",
    [
        {"linear_type": Q4_0},
        {"linear_type": Q4_1, "tied": False},
        {"linear_type": Q4_1, "rope_factors": True},
    ],
    ids=["q4_0-repacked", "q4_1-separate-output", "q4_1-rope-factors"],
)
def test_quantized_files_track_llamacpp_with_its_float16_kv_cache(tmp_path: Path, variant: dict[str, Any]) -> None:
    """Q4_0 (repacked by llama.cpp), Q4_1 and Q8_0 products, llama.cpp's default KV cache."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", **variant)
    ours, theirs = mlx_logits(path), llamacpp_logits(path, float_kv=False)
    largest = np.abs(ours - theirs).max() / np.abs(theirs).max()
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    assert largest < QUANTIZED_TOLERANCE and top1 >= 0.9, f"relative {largest:.3f}, top-1 {top1:.0%}"


def test_decode_steps_track_llamacpps(tmp_path: Path) -> None:
    """One token at a time through the KV cache: single-token products, RoPE offsets."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", linear_type=Q4_1)
    prompt, steps = TOKENS[:20], TOKENS[20:28]
    llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=1)
    try:
        llm.eval(prompt)
        for token in steps:
            llm.eval([token])
        theirs = np.array(llm.scores[len(prompt) - 1 : len(prompt) + len(steps)])
    finally:
        llm.close()
    model = load_gguf_model(path).model
    cache = make_prompt_cache(model)
    ours = [model(mx.array(prompt)[None], cache=cache)[0, -1]]
    ours += [model(mx.array([[token]]), cache=cache)[0, -1] for token in steps]
    decoded = np.array(mx.stack(ours))
    largest = np.abs(decoded - theirs).max() / np.abs(theirs).max()
    assert largest < QUANTIZED_TOLERANCE, largest
    assert (decoded.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9


def test_formats_mlx_cannot_read_are_dequantized(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", linear_type=Q5_0)
    model = load_gguf_model(path).model
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)  # floats now
    ours, theirs = mlx_logits(path), llamacpp_logits(path)
    assert np.abs(ours - theirs).max() < 0.1 * np.abs(theirs).max()


def test_other_architectures_are_refused_with_advice(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", architecture="gemma")
    with pytest.raises(GGUFLoadError, match="architecture 'gemma'.*mlx_lm.convert"):
        load_gguf_model(path)

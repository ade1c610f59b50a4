"""Loading a Llama-family GGUF file into mlx-lm's Llama model.

MLX reads GGUF natively (``mx.load(path, return_metadata=True)``) and keeps the three block
formats it can run as they are: Q4_0 and Q4_1 become 4-bit and Q8_0 8-bit affine-quantized
weights with group size 32 (``weight``/``scales``/``biases``, exactly GGML's ``d * q + m``),
so those layers are built as ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` with the bits
each tensor has. F32/F16/BF16 tensors load as floats. A file holding any other type (K-quants,
Q5_x...) is read with gguf-py instead and dequantized to floats: MLX has no kernel for those
formats.

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` so that GGML's interleaved
("normal") RoPE equals Hugging Face's rotate-half RoPE on the original weights. Instead of
undoing the permutation (which would also have to reorder quantized rows), the model runs
MLX's interleaved RoPE (``rope_traditional=True``) on the weights as stored: the same
attention scores, no weight rewriting.

Agreement with llama.cpp on the same file is judged by tolerances (top-1, greedy text), not by
reproducing its roundings (``tests/backends/test_mlx_agreement.py``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama

__all__ = ["GGUFLoadError", "GGUFModel", "load_gguf_model", "read_gguf"]

logger = logging.getLogger(__name__)

#: GGUF tensor name (inside ``blk.N.``) -> mlx-lm Llama module path (inside ``model.layers.N.``).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(?P<layer>\d+)\.(?P<name>\w+)")
#: Architectures whose tensors and hyper-parameters follow llama.cpp's LLAMA layout.
_LLAMA_ARCHITECTURES = ("llama",)


class GGUFLoadError(ValueError):
    """The file is not a GGUF this loader can serve (the message says what is missing)."""


class GGUFModel:
    """A loaded model: the mlx-lm module, its arguments and the file's metadata."""

    def __init__(self, model: nn.Module, args: llama.ModelArgs, metadata: dict[str, Any]):
        self.model = model
        self.args = args
        #: GGUF key/values with MLX scalars turned into Python values.
        self.metadata = metadata

    @property
    def context_length(self) -> int | None:
        return self.args.max_position_embeddings


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any], bool]:
    """Tensors and metadata of ``path``; the flag says whether the gguf-py fallback was used."""
    try:
        loaded: Any = mx.load(str(path), return_metadata=True)
    except RuntimeError as exc:
        # MLX refuses the whole file when one tensor has a type it cannot read.
        logger.warning(
            "MLX cannot read every tensor of %s (%s): dequantizing with gguf-py", path, exc
        )
        tensors, metadata = _read_with_gguf_py(path)
        return tensors, metadata, True
    tensors, raw_metadata = loaded
    return tensors, {key: _python_value(value) for key, value in raw_metadata.items()}, False


def load_gguf_model(path: Path, *, dtype: mx.Dtype = mx.float32) -> GGUFModel:
    """Build mlx-lm's Llama model from ``path``; floats (and quantization scales) in ``dtype``.

    Raises :class:`GGUFLoadError` for architectures or tensor layouts it does not know.
    """
    tensors, metadata, _ = read_gguf(path)
    architecture = metadata.get("general.architecture")
    if architecture not in _LLAMA_ARCHITECTURES:
        raise GGUFLoadError(
            f"{path.name}: GGUF architecture {architecture!r} is not supported by the MLX "
            f"backend's GGUF loader (supported: {', '.join(_LLAMA_ARCHITECTURES)}); convert "
            "the original model with `mlx_lm.convert` and point model_path at that directory"
        )
    args = _model_args(metadata, tensors, architecture)
    weights = _rename(tensors, dtype)
    model = llama.Model(args)
    if "rope_freqs.weight" in tensors:
        _use_rope_factors(model, args, tensors["rope_freqs.weight"])
    nn.quantize(model, class_predicate=lambda p, m: _quantization_of(p, m, weights))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise GGUFLoadError(f"{path.name}: tensors do not fit a Llama model: {exc}") from exc
    model.eval()
    mx.eval(model.parameters())
    return GGUFModel(model, args, metadata)


def _model_args(
    metadata: Mapping[str, Any], tensors: Mapping[str, mx.array], arch: str
) -> llama.ModelArgs:
    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFLoadError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden_size // num_heads)
    rope_dims = metadata.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise GGUFLoadError(
            f"partial rotary embeddings ({arch}.rope.dimension_count={rope_dims}, head "
            f"dimension {head_dim}) are not supported"
        )
    rope_scaling: dict[str, float | str] | None = None
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise GGUFLoadError(f"RoPE scaling {scaling_type!r} is not supported")
    embedding = tensors["token_embd.weight"]
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden_size,
        num_hidden_layers=int(get("block_count")),
        intermediate_size=int(get("feed_forward_length")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(metadata.get(f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        vocab_size=int(embedding.shape[0]),
        max_position_embeddings=int(get("context_length", 2048)),
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        # GGML's interleaved RoPE on the permuted q/k rows (see the module docstring).
        rope_traditional=True,
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensors,
    )


def _module_name(key: str) -> str:
    """The mlx-lm module path of GGUF tensor ``key`` without its suffix (``blk.0.attn_q``)."""
    if key in _TOP_NAMES:
        return _TOP_NAMES[key]
    match = _BLOCK.fullmatch(key)
    if match is None or match["name"] not in _LAYER_NAMES:
        raise GGUFLoadError(f"unexpected tensor {key!r} for a Llama model")
    return f"model.layers.{match['layer']}.{_LAYER_NAMES[match['name']]}"


def _rename(tensors: Mapping[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for key, value in tensors.items():
        base, _, suffix = key.rpartition(".")
        if base == "rope_freqs":
            continue  # folded into the RoPE modules
        name = _module_name(base)
        if mx.issubdtype(value.dtype, mx.floating):
            # Norms, float weights and the quantization scales/biases compute in ``dtype``.
            value = value.astype(dtype)
        weights[f"{name}.{suffix}"] = value
    return weights


def _quantization_of(path: str, module: nn.Module, weights: Mapping[str, mx.array]) -> Any:
    """``to_quantized`` arguments for a module stored quantized, else False."""
    scales = weights.get(f"{path}.scales")
    if scales is None or not hasattr(module, "to_quantized"):
        return False
    packed = weights[f"{path}.weight"]  # (out, in * bits / 32) uint32
    in_features = module.weight.shape[1]  # Linear (out, in) and Embedding (vocab, dim) alike
    bits = packed.shape[-1] * 32 // in_features
    group_size = in_features // scales.shape[-1]
    return {"group_size": group_size, "bits": bits}


class _FactorRoPE(nn.Module):
    """Interleaved RoPE with per-frequency divisors (GGUF ``rope_freqs``, e.g. Llama 3)."""

    def __init__(self, dims: int, base: float, factors: mx.array) -> None:
        super().__init__()
        self.dims = dims
        # mx.fast.rope takes periods: angle_i = position / freqs_i.
        exponents = mx.arange(0, dims, 2, dtype=mx.float32) / dims  # (dims / 2,)
        self._freqs = (base**exponents) * factors.astype(mx.float32)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=True, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )


def _use_rope_factors(model: nn.Module, args: llama.ModelArgs, factors: mx.array) -> None:
    head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
    rope = _FactorRoPE(head_dim, args.rope_theta, factors)
    for layer in model.model.layers:
        layer.self_attn.rope = rope


def _python_value(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _read_with_gguf_py(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = field.contents()
    tensors: dict[str, mx.array] = {}
    kinds: set[str] = set()
    for tensor in reader.tensors:
        shape = [int(n) for n in reversed(tensor.shape)]  # GGUF lists dimensions fastest-first
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        tensors[tensor.name] = mx.array(values)
        kinds.add(tensor.tensor_type.name)
    logger.info("%s: dequantized tensors of types %s to floats", path.name, sorted(kinds))
    return tensors, metadata

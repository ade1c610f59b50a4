"""Load a GGUF file of a Llama-family architecture (``llama``, ``qwen2``, ``qwen3``, ``gemma2``...;
:mod:`core_engine.model.architectures`) into a :class:`~core_engine.model.llama.LlamaModel`.

Weights of every supported type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K ... Q6_K;
:mod:`core_engine.model.quant`) are dequantised once at load into the compute dtype (bf16 on
CPUs with native bf16 and on CUDA, fp32 otherwise); the engine then stores each product in its
weight format (:meth:`LlamaModel.set_weight_format`: Q4_0/Q4_1/Q4_K and Q8_0 blocks as stored,
other types requantised from their values).

For ``llama`` files, llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` so that
its "normal" RoPE can rotate adjacent pairs ``(2i, 2i+1)``. The loader undoes that permutation, which moves pair
members to ``(i, i + head_dim/2)`` — the rotate-half layout the model uses. q and k get the same
permutation, so attention scores are unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import Tensor
from tqdm import tqdm

from core_engine.cpu_features import cpu_flags
from core_engine.gguf_reader import TensorRecord, read_gguf
from core_engine.model.architecture import Architecture
from core_engine.model.architectures import architecture, architectures, decoder_layer_class
from core_engine.model.block_weights import (
    BlockWeight,
    concat_rows,
    from_gguf_blocks,
    is_exact,
    quantize_dense,
)
from core_engine.model.config import LlamaConfig, RopeScaling
from core_engine.model.llama import LlamaModel
from core_engine.model.quant import dequantize
from core_engine.model.rope import longrope_freq_factors
from core_engine.tokenizer import Tokenizer, tokenizer_from_gguf_metadata

__all__ = ["GGUFBlockSource", "GGUFFile", "GGUFLoadError", "file_type_name", "load_model", "preferred_dtype"]

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = frozenset(architectures())


class GGUFLoadError(ValueError):
    """The file is not a GGUF this engine can run (message names the key or tensor at fault)."""


def _cpu_has_native_bf16() -> bool:
    return not {"avx512_bf16", "amx_bf16"}.isdisjoint(cpu_flags())


def preferred_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 where the hardware computes it natively (CUDA, AVX512-BF16/AMX CPUs), else fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32


def file_type_name(value: object) -> str | None:
    """``general.file_type`` as its name without ``MOSTLY_`` ("Q4_1", "F16"...), or None."""
    if value is None:
        return None
    try:
        from gguf import LlamaFileType

        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_")  # type: ignore[call-overload]
    except (ValueError, TypeError):
        return str(value)


class GGUFFile:
    """Metadata and tensors of one GGUF file (memory-mapped; tensors read on demand)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"model file not found: {self.path}")
        try:
            self._index = read_gguf(self.path)
        except (ValueError, OSError) as exc:
            raise GGUFLoadError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        self._tensors: dict[str, TensorRecord] = {t.name: t for t in self._index.tensors}

    @property
    def tensors(self) -> list[TensorRecord]:
        """Every tensor record, in file order."""
        return self._index.tensors

    @property
    def metadata(self) -> dict[str, Any]:
        """All key/values, decoded to Python values (strings, numbers, lists)."""
        return self._index.metadata

    @property
    def file_type(self) -> str | None:
        """The file's weight type ("Q4_1", "F16"...; see :func:`file_type_name`)."""
        return file_type_name(self.metadata.get("general.file_type"))

    @property
    def architecture(self) -> str:
        """``general.architecture`` (e.g. ``"llama"``)."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFLoadError(f"{self.path}: general.architecture is missing")
        return arch

    def _arch_key(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        full = f"{self.architecture}.{key}"
        value = self.metadata.get(full, default)
        if value is None and required:
            raise GGUFLoadError(f"{self.path}: metadata key {full} is missing")
        return value

    def has_tensor(self, name: str) -> bool:
        """True when the file holds a tensor called ``name``."""
        return name in self._tensors

    def tensor(self, name: str) -> TensorRecord:
        """The raw record of tensor ``name`` (GGUF shape order, undecoded data)."""
        return self._require(name)

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        """GGML type of tensor ``name``."""
        return GGMLQuantizationType(self._require(name).tensor_type)

    def _require(self, name: str) -> TensorRecord:
        try:
            return self._tensors[name]
        except KeyError:
            raise GGUFLoadError(f"{self.path}: tensor {name} is missing") from None

    def dequantized(self, name: str) -> Tensor:
        """Tensor ``name`` as fp32, torch layout (rows first: a weight is (out, in))."""
        tensor = self._require(name)
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists ne0 first
        return dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type), shape, name=name)

    @property
    def arch_spec(self) -> Architecture:
        """The file's :class:`Architecture`; GGUFLoadError naming it if the engine has none."""
        spec = architecture(self.architecture)
        if spec is None:
            raise GGUFLoadError(
                f"{self.path}: architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        return spec

    def llama_config(self) -> LlamaConfig:
        """Hyper-parameters for :class:`LlamaModel`, validated against what the engine supports."""
        arch = self.arch_spec.name
        hidden = int(self._arch_key("embedding_length", required=True))
        num_heads = int(self._arch_key("attention.head_count", required=True))
        num_kv_heads = int(self._arch_key("attention.head_count_kv", num_heads))
        head_dim = int(self._arch_key("attention.key_length", hidden // num_heads))
        rope_dim = int(self._arch_key("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise GGUFLoadError(f"{self.path}: partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
        if num_heads % num_kv_heads:
            raise GGUFLoadError(f"{self.path}: {num_heads} heads do not divide into {num_kv_heads} kv heads")
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        embed_rows = int(self._require("token_embd.weight").shape[-1])
        vocab_size = int(self._arch_key("vocab_size", len(tokens) if tokens else embed_rows))
        if vocab_size != embed_rows:
            raise GGUFLoadError(f"{self.path}: vocab_size {vocab_size} != token_embd rows {embed_rows}")
        moe: dict[str, Any] = {}
        if self.arch_spec.moe or self._arch_key("expert_count"):  # qwen3moe; llama files with experts (Mixtral)
            expert_ff = self._arch_key("expert_feed_forward_length") or self._arch_key("feed_forward_length", required=True)
            moe = {
                "num_experts": int(self._arch_key("expert_count", required=True)),
                "num_experts_used": int(self._arch_key("expert_used_count", required=True)),
                "expert_intermediate_size": int(expert_ff),
            }
        inter = self._arch_key("feed_forward_length", moe.get("expert_intermediate_size"), required=not moe)
        config = LlamaConfig(
            **moe,
            architecture=arch,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(inter),
            num_layers=int(self._arch_key("block_count", required=True)),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_dim=rope_dim,
            rope_theta=float(self._arch_key("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(),
            rms_eps=float(self._arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
            qk_norm=self.arch_spec.qk_norm,
            context_length=int(self._arch_key("context_length", 4096)),
            tie_word_embeddings=not self.has_tensor("output.weight"),
            bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.metadata.get("tokenizer.ggml.eos_token_id"),
            name=self.metadata.get("general.name"),
        )
        own = self.arch_spec.gguf_hparams
        return config if own is None else msgspec.structs.replace(config, **own(self._arch_key, config))

    def _rope_scaling(self) -> RopeScaling | None:
        kind = self._arch_key("rope.scaling.type")
        factor = self._arch_key("rope.scaling.factor")
        if self.has_tensor("rope_factors_long.weight") or self.has_tensor("rope_factors_short.weight"):
            return self._longrope_scaling(kind, factor)
        if kind is None and self._arch_key("rope.scale_linear") is not None:
            kind, factor = "linear", self._arch_key("rope.scale_linear")
        if kind in (None, "none") or factor in (None, 0.0, 1.0):
            return None
        if kind != "linear":
            raise GGUFLoadError(f"{self.path}: RoPE scaling {kind!r} is not supported (only linear)")
        return RopeScaling(kind="linear", factor=float(factor))

    def _longrope_scaling(self, kind: str | None, factor: float | None) -> RopeScaling:
        """Phi-3's LongRoPE as llama.cpp's converter writes it: both factor tensors, the original
        context and the attention factor (llama.cpp's defaults where a key is missing)."""
        if not (self.has_tensor("rope_factors_long.weight") and self.has_tensor("rope_factors_short.weight")):
            raise GGUFLoadError(f"{self.path}: LongRoPE needs both rope_factors_long and rope_factors_short")
        if kind not in (None, "none", "linear") or factor not in (None, 0.0, 1.0):
            raise GGUFLoadError(f"{self.path}: LongRoPE with RoPE scaling {kind!r} x{factor} is not supported")
        context = int(self._arch_key("context_length", 4096))
        original = int(self._arch_key("rope.scaling.original_context_length", context))
        return RopeScaling(
            kind="longrope", factor=context / original, original_context=original,
            attention_factor=float(self._arch_key("rope.scaling.attn_factor", 1.0)),
        )

    def rope_freq_factors(self, config: LlamaConfig, max_model_len: int | None = None) -> Tensor | None:
        """The per-pair RoPE divisors the model runs with: ``rope_freqs.weight`` (Llama 3.x), or
        LongRoPE's long or short set for the engine's context window (see
        :func:`~core_engine.model.rope.longrope_freq_factors`); None when the file has neither."""
        if self.has_tensor("rope_freqs.weight"):
            return self.dequantized("rope_freqs.weight")
        scaling = config.rope_scaling
        if scaling is None or scaling.kind != "longrope":
            return None
        assert scaling.original_context is not None
        return longrope_freq_factors(
            self.dequantized("rope_factors_short.weight"), self.dequantized("rope_factors_long.weight"),
            context_window=config.context_window(max_model_len), original_context=scaling.original_context,
        )

    def tokenizer(self) -> Tokenizer:
        """The file's tokenizer (``tokenizer.ggml.*`` metadata)."""
        return tokenizer_from_gguf_metadata(self.metadata)


def _unpermute_rope_rows(weight: Tensor, num_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation: (out, ...) rows per head go from pairs to halves."""
    out = weight.shape[0]
    head_dim = out // num_heads
    # GGUF row h*D + 2j + s holds HF row h*D + s*D/2 + j.
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class GGUFBlockSource:
    """The products of a loaded GGUF in block form, for the int4/int8 weight formats.

    Tensors whose block type matches the format are taken as stored (see
    :mod:`core_engine.model.block_weights`); the others are quantised from their values, and
    :attr:`requantized` names them.
    """

    def __init__(self, gguf_file: GGUFFile, config: LlamaConfig) -> None:
        self.gguf_file = gguf_file
        self.config = config
        self.requantized: list[str] = []

    def parts(self, name: str) -> list[tuple[str, int | None]]:
        """GGUF tensors of product ``name``, in row order, with the head count of the q/k
        rows whose RoPE permutation the loader undoes (None: rows as stored)."""
        cfg = self.config
        permuted = self.gguf_file.arch_spec.permuted_qk_rows
        if name == "head":
            head: list[tuple[str, int | None]] = [
                ("output.weight" if self.gguf_file.has_tensor("output.weight") else "token_embd.weight", None)
            ]
            return head
        _, idx, product = name.split(".")
        prefix = f"blk.{idx}."
        if product == "experts_gate_up":  # stacked (experts, rows, cols): interleaved per expert
            return [(prefix + "ffn_gate_exps.weight", None), (prefix + "ffn_up_exps.weight", None)]
        if product == "experts_down":
            return [(prefix + "ffn_down_exps.weight", None)]
        if self.gguf_file.arch_spec.fused_projections:
            fused: dict[str, list[tuple[str, int | None]]] = {
                "qkv": [(prefix + "attn_qkv.weight", None)], "o": [(prefix + "attn_output.weight", None)],
                "gate_up": [(prefix + "ffn_up.weight", None)], "down": [(prefix + "ffn_down.weight", None)],
            }
            return fused[product]
        split: dict[str, list[tuple[str, int | None]]] = {
            "qkv": [(prefix + "attn_q.weight", cfg.num_heads if permuted else None),
                    (prefix + "attn_k.weight", cfg.num_kv_heads if permuted else None), (prefix + "attn_v.weight", None)],
            "o": [(prefix + "attn_output.weight", None)],
            "gate_up": [(prefix + "ffn_gate.weight", None), (prefix + "ffn_up.weight", None)],
            "down": [(prefix + "ffn_down.weight", None)],
        }
        return split[product]

    def natural_format(self, name: str) -> str:
        """What ``weight_format = "auto"`` stores product ``name`` as: int4 when all its
        tensors are 4-bit blocks, else int8 (8-bit blocks, or a requantised 16/32-bit tensor)."""
        types = {GGMLQuantizationType(self.gguf_file.tensor(t).tensor_type) for t, _ in self.parts(name)}
        return "int4" if all(is_exact("int4", t) for t in types) else "int8"

    def block_weight(self, name: str, weight_format: str) -> BlockWeight:
        """Product ``name`` in ``weight_format``'s arrays; an experts product's rows are
        expert-major (expert ``e``'s gate then up rows for ``experts_gate_up``)."""
        parts = []
        experts = 1
        for tensor_name, heads in self.parts(name):
            record = self.gguf_file.tensor(tensor_name)
            qtype = GGMLQuantizationType(record.tensor_type)
            shape = [int(n) for n in record.shape.tolist()]  # ne0 (cols) first; experts last
            cols, rows = shape[0], int(np.prod(shape[1:]))
            experts = shape[2] if len(shape) == 3 else 1
            if is_exact(weight_format, qtype):
                blocks = from_gguf_blocks(record.data, qtype, rows, cols)
            else:
                self.requantized.append(f"{tensor_name} ({qtype.name} -> {weight_format})")
                blocks = quantize_dense(self.gguf_file.dequantized(tensor_name).reshape(rows, cols), weight_format)
            if heads is not None:
                blocks = tuple(None if t is None else _unpermute_rope_rows(t, heads) for t in blocks)  # type: ignore[assignment]
            parts.append(blocks)
        # Experts: gate | up of each expert, expert after expert.
        return parts[0] if len(parts) == 1 else concat_rows(parts, groups=experts)


def _fill_layer(model: LlamaModel, gguf_file: GGUFFile, idx: int, *, products: bool = True) -> None:
    """Layer ``idx``'s weights from the file; ``products=False`` leaves the matmul products
    (q/k/v/o, gate/up/down, experts) unread, for a model that packs them from the file's blocks."""
    cfg = model.config
    layer = model.layers[idx]
    prefix = f"blk.{idx}."

    def qk_rows(name: str, heads: int) -> Tensor:
        t = gguf_file.dequantized(name)
        return _unpermute_rope_rows(t, heads) if gguf_file.arch_spec.permuted_qk_rows else t

    fused = gguf_file.arch_spec.fused_projections
    if products and fused:  # Phi-3: q|k|v in one tensor, in Hugging Face's row order
        layer.qkv_proj.copy_(gguf_file.dequantized(prefix + "attn_qkv.weight"))
    elif products:
        q = qk_rows(prefix + "attn_q.weight", cfg.num_heads)
        k = qk_rows(prefix + "attn_k.weight", cfg.num_kv_heads)
        v = gguf_file.dequantized(prefix + "attn_v.weight")
        layer.qkv_proj.copy_(torch.cat((q, k, v)))  # (q_size + 2 kv_size, hidden)
        del q, k, v
    if layer.qkv_bias is not None:
        bq = qk_rows(prefix + "attn_q.bias", cfg.num_heads)
        bk = qk_rows(prefix + "attn_k.bias", cfg.num_kv_heads)
        layer.qkv_bias.copy_(torch.cat((bq, bk, gguf_file.dequantized(prefix + "attn_v.bias"))))
    if cfg.qk_norm:  # Qwen3: one norm weight per head_dim, shared by the heads
        layer.q_norm.copy_(gguf_file.dequantized(prefix + "attn_q_norm.weight"))
        layer.k_norm.copy_(gguf_file.dequantized(prefix + "attn_k_norm.weight"))
    if products:
        layer.o_proj.copy_(gguf_file.dequantized(prefix + "attn_output.weight"))
    layer.attn_norm.copy_(gguf_file.dequantized(prefix + "attn_norm.weight"))
    layer.ffn_norm.copy_(gguf_file.dequantized(prefix + "ffn_norm.weight"))
    if hasattr(layer, "post_attn_norm"):  # Gemma: norms after attention and after the FFN too
        layer.post_attn_norm.copy_(gguf_file.dequantized(prefix + "post_attention_norm.weight"))
        layer.post_ffn_norm.copy_(gguf_file.dequantized(prefix + "post_ffw_norm.weight"))
    inter = cfg.intermediate_size
    if cfg.num_experts:  # mixture of experts: the router, then (below) the stacked experts
        layer.router.copy_(gguf_file.dequantized(prefix + "ffn_gate_inp.weight"))
    if not products:
        return
    if cfg.num_experts:
        layer.experts_gate_up_proj.copy_(torch.cat(
            (gguf_file.dequantized(prefix + "ffn_gate_exps.weight"), gguf_file.dequantized(prefix + "ffn_up_exps.weight")),
            dim=1,
        ))
        layer.experts_down_proj.copy_(gguf_file.dequantized(prefix + "ffn_down_exps.weight"))
    elif fused:  # gate|up in one tensor
        layer.gate_up_proj.copy_(gguf_file.dequantized(prefix + "ffn_up.weight"))
    else:
        layer.gate_up_proj[:inter].copy_(gguf_file.dequantized(prefix + "ffn_gate.weight"))
        layer.gate_up_proj[inter:].copy_(gguf_file.dequantized(prefix + "ffn_up.weight"))
    if not cfg.num_experts:
        layer.down_proj.copy_(gguf_file.dequantized(prefix + "ffn_down.weight"))


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    show_progress: bool | None = None,
    max_model_len: int | None = None,
    packs_from_blocks: Callable[[str | None], bool] | None = None,
) -> tuple[LlamaModel, LlamaConfig, Tokenizer]:
    """Read ``path`` (a GGUF file, or a Hugging Face checkpoint directory:
    :mod:`core_engine.hf_loader`) and build the model, its config and its tokenizer.

    ``dtype``: compute/storage dtype of the weights (``None``: :func:`preferred_dtype`).
    ``show_progress``: a tqdm bar per layer (``None``: only on a terminal); the start and the
    end of the load are logged either way.
    ``max_model_len``: the engine's context window (None: the trained context length, as
    :class:`~core_engine.config.EngineConfig` takes it); LongRoPE models choose their long or
    short factors by it.
    ``packs_from_blocks``: given the file's type (``general.file_type``), whether the caller
    will store every matmul product in a block format from the file's own blocks
    (:meth:`LlamaModel.set_weight_format` with this file's :class:`GGUFBlockSource`); then the
    dense products are never dequantised (most of a quantised file's load time) and the model
    refuses any other format (``products_unread``).
    """
    from core_engine.hf_loader import is_hf_checkpoint, load_hf_model

    if is_hf_checkpoint(path):  # a Hugging Face checkpoint directory instead of a GGUF file
        return load_hf_model(  # type: ignore[return-value]
            path, dtype=dtype or preferred_dtype(device), device=device, max_model_len=max_model_len
        )
    started = time.perf_counter()
    gguf_file = GGUFFile(path)
    config = gguf_file.llama_config()
    tokenizer = gguf_file.tokenizer()
    dtype = dtype or preferred_dtype(device)
    logger.info(
        "loading %s (%s, %d layers, hidden %d) as %s on %s",
        gguf_file.path.name, config.name or config.architecture, config.num_layers,
        config.hidden_size, dtype, device,
    )
    freq_factors = gguf_file.rope_freq_factors(config, max_model_len)
    products = packs_from_blocks is None or not packs_from_blocks(gguf_file.file_type)
    with torch.no_grad():
        model = LlamaModel(
            config,
            dtype=dtype,
            device=device,
            qkv_bias=gguf_file.has_tensor("blk.0.attn_q.bias"),
            rope_freq_factors=freq_factors,
            layer_class=decoder_layer_class(config),
        )
        steps = tqdm(
            total=config.num_layers + 1, desc=f"loading {gguf_file.path.name}", unit="layer",
            disable=(not show_progress) if show_progress is not None else None,
        )
        with steps:
            model.embed_tokens.copy_(gguf_file.dequantized("token_embd.weight"))
            model.norm.copy_(gguf_file.dequantized("output_norm.weight"))
            if not config.tie_word_embeddings and products:
                model.lm_head.copy_(gguf_file.dequantized("output.weight"))
            steps.update(1)
            for idx in range(config.num_layers):
                _fill_layer(model, gguf_file, idx, products=products)
                steps.update(1)
    model.eval()
    model.products_unread = not products
    model.block_source = GGUFBlockSource(gguf_file, config)
    logger.info("loaded %s in %.1f s", gguf_file.path.name, time.perf_counter() - started)
    return model, config, tokenizer


def read_metadata(path: str | Path) -> Mapping[str, Any]:
    """All GGUF key/values of ``path`` (handy for tools and tests)."""
    return GGUFFile(path).metadata

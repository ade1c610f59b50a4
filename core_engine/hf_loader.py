"""Load a Hugging Face checkpoint directory (``config.json``, ``*.safetensors``,
``tokenizer.json``) into a :class:`~core_engine.model.llama.LlamaModel`.

The architectures are the GGUF loader's (:mod:`core_engine.model.architectures`, by
``config.json``'s ``model_type``); Hugging Face keeps q/k rows in rotate-half order, so nothing
is permuted. Weights are read with ``safetensors`` (memory-mapped) and copied once into the
compute dtype; the engine then stores the products in its weight format (int4/int8 quantised
from these values by ``gguf.quants``). The tokenizer is ``tokenizers``' (:class:`HFTokenizer`).
Nothing is downloaded: ``model_path`` names a directory on disk.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, cast

import msgspec
import torch
from torch import Tensor

from core_engine.model.architectures import architecture, architectures, decoder_layer_class
from core_engine.model.config import LlamaConfig, RopeScaling
from core_engine.model.llama import LlamaModel
from core_engine.tokenizer.hf import HFTokenizer

__all__ = ["HFLoadError", "hf_config", "is_hf_checkpoint", "load_hf_model"]

logger = logging.getLogger(__name__)


class HFLoadError(ValueError):
    """The directory is not a checkpoint this engine can run (message names what is wrong)."""


def is_hf_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory with a ``config.json`` (a Hugging Face checkpoint)."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file()


class _Tensors:
    """Every tensor of the directory's ``*.safetensors`` files, by name (read on demand)."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise HFLoadError(f"{directory}: no *.safetensors files (other weight formats are not read)")
        self._handles = [safe_open(str(f), framework="pt") for f in files]  # type: ignore[no-untyped-call]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> Tensor:
        handle = self._where.get(name)
        if handle is None:
            raise HFLoadError(f"tensor {name!r} is missing from the checkpoint")
        return handle.get_tensor(name).float()


def _config_json(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HFLoadError(f"{directory}/config.json is not readable JSON: {exc}") from exc


#: config.json model_type -> the architecture's (GGUF) name where they differ.
_HF_MODEL_TYPES = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "mistral": "llama", "gemma3_text": "gemma3"}


def _sliding_window(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The window and its layers of a config.json outside Gemma's own (``layer_types`` where
    transformers writes them; Mistral and Mixtral: every layer; Qwen2: the layers from
    ``max_window_layers`` on, when ``use_sliding_window``)."""
    window, types = cfg.get("sliding_window"), cfg.get("layer_types")
    if cfg.get("model_type") == "qwen2" and not cfg.get("use_sliding_window"):
        window = None
    if not window:
        return {}
    if types:
        local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif cfg.get("model_type") == "qwen2":
        local = tuple(range(int(cfg.get("max_window_layers", num_layers)), num_layers))
    else:
        local = tuple(range(num_layers))
    return {"sliding_window": int(window), "local_layers": local} if local else {}


def hf_config(directory: str | Path, tensors: _Tensors | None = None) -> LlamaConfig:
    """:class:`LlamaConfig` from ``config.json``; HFLoadError naming an unsupported field."""
    directory = Path(directory)
    cfg = _config_json(directory)
    model_type = cfg.get("model_type")
    spec = architecture(_HF_MODEL_TYPES.get(str(model_type), str(model_type)))
    if spec is None:
        raise HFLoadError(
            f"{directory}: model_type {model_type!r} is not supported (supported: {', '.join(sorted(architectures()))})"
        )

    def need(key: str) -> Any:
        if key not in cfg:
            raise HFLoadError(f"{directory}/config.json lacks {key!r}")
        return cfg[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rope = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    scaling_cfg = cfg.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
    scaling = None
    if scaling_cfg:
        kind = scaling_cfg.get("rope_type") or scaling_cfg.get("type")
        if kind == "linear":
            scaling = RopeScaling(kind="linear", factor=float(scaling_cfg["factor"]))
        elif kind in ("longrope", "su"):  # Phi-3's; "su" its older name
            scaling = _longrope_scaling(cfg, scaling_cfg)
        elif kind not in (None, "default", "llama3"):  # llama3: per-pair factors, see _freq_factors
            raise HFLoadError(f"{directory}: RoPE scaling {kind!r} is not supported (linear, llama3 and longrope are)")
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFLoadError(f"{directory}: partial RoPE is not supported")
    moe: dict[str, Any] = {}
    if spec.moe or model_type == "mixtral":
        if not cfg.get("norm_topk_prob", True) or cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise HFLoadError(f"{directory}: only MoE checkpoints with experts in every layer and norm_topk_prob are supported")
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 writes the latter
        if not experts:
            raise HFLoadError(f"{directory}/config.json lacks 'num_experts'")
        moe = {"num_experts": int(experts), "num_experts_used": int(need("num_experts_per_tok")),
               "expert_intermediate_size": int(cfg.get("moe_intermediate_size") or need("intermediate_size"))}
    tied = bool(cfg.get("tie_word_embeddings", False)) or (tensors is not None and "lm_head.weight" not in tensors)
    eos = cfg.get("eos_token_id")
    config = LlamaConfig(
        **moe,
        architecture=spec.name,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qk_norm=spec.qk_norm,
        context_length=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=tied,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        name=directory.name,
    )
    try:
        own = spec.hf_hparams(cfg, config) if spec.hf_hparams is not None else _sliding_window(cfg, config.num_layers)
    except ValueError as exc:
        raise HFLoadError(f"{directory}: {exc}") from exc
    return msgspec.structs.replace(config, **own)


def _longrope_scaling(cfg: dict[str, Any], scaling_cfg: dict[str, Any]) -> RopeScaling:
    """LongRoPE's parameters as ``transformers`` reads them: Phi-3's top-level
    ``original_max_position_embeddings`` first; ``factor`` the trained over the original
    context; ``attention_factor`` from it unless given."""
    from core_engine.model.rope import longrope_attention_factor

    trained = int(cfg.get("max_position_embeddings", 4096))
    original = int(cfg.get("original_max_position_embeddings") or scaling_cfg.get("original_max_position_embeddings") or trained)
    factor = float(scaling_cfg.get("factor") or trained / original)
    attention = scaling_cfg.get("attention_factor")
    return RopeScaling(
        kind="longrope", factor=factor, original_context=original,
        attention_factor=float(attention) if attention is not None else longrope_attention_factor(factor, original),
    )


def _freq_factors(directory: Path, config: LlamaConfig, max_model_len: int | None = None) -> Tensor | None:
    """Per-pair RoPE divisors from config.json's ``rope_scaling``: Llama 3.1's, or LongRoPE's
    long or short set for the engine's context window (None otherwise)."""
    from core_engine.model.rope import llama3_freq_factors, longrope_freq_factors

    cfg = _config_json(directory)
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if config.rope_scaling is not None and config.rope_scaling.kind == "longrope":
        assert config.rope_scaling.original_context is not None
        return longrope_freq_factors(
            torch.tensor(scaling["short_factor"], dtype=torch.float32), torch.tensor(scaling["long_factor"], dtype=torch.float32),
            context_window=config.context_window(max_model_len), original_context=config.rope_scaling.original_context,
        )
    if (scaling.get("rope_type") or scaling.get("type")) != "llama3":
        return None
    return llama3_freq_factors(
        config.rope_dim, config.rope_theta, factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_context=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def load_hf_model(
    path: str | Path, *, dtype: torch.dtype, device: torch.device | str = "cpu", max_model_len: int | None = None
) -> tuple[LlamaModel, LlamaConfig, HFTokenizer]:
    """The model, config and tokenizer of the checkpoint directory ``path`` (``max_model_len``:
    the engine's context window, which picks LongRoPE's factors; None: the trained length)."""
    started = time.perf_counter()
    directory = Path(path)
    tensors = _Tensors(directory)
    config = hf_config(directory, tensors)
    tokenizer = HFTokenizer(directory)
    logger.info("loading %s (%s, %d layers, hidden %d) as %s on %s", directory.name, config.architecture,
                config.num_layers, config.hidden_size, dtype, device)
    offset = architecture(config.architecture).hf_norm_offset  # type: ignore[union-attr]

    def norm(name: str) -> Tensor:
        """A norm weight; Gemma's are stored as offsets from 1."""
        weight = tensors.get(name)
        return weight + 1.0 if offset else weight

    with torch.no_grad():
        bias = any(f"model.layers.0.self_attn.{n}.bias" in tensors for n in ("q_proj", "qkv_proj"))
        model = LlamaModel(
            config, dtype=dtype, device=device, qkv_bias=bias,
            rope_freq_factors=_freq_factors(directory, config, max_model_len), layer_class=decoder_layer_class(config),
        )
        model.embed_tokens.copy_(tensors.get("model.embed_tokens.weight"))
        model.norm.copy_(norm("model.norm.weight"))
        if not config.tie_word_embeddings:
            model.lm_head.copy_(tensors.get("lm_head.weight"))
        # Any: Gemma's and the MoE layers add norms and experts to the Llama layer
        for i, layer in enumerate(cast("list[Any]", list(model.layers))):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            fused = architecture(config.architecture).fused_projections  # type: ignore[union-attr]
            if fused:  # Phi-3: qkv_proj and gate_up_proj as stored
                layer.qkv_proj.copy_(tensors.get(attn + "qkv_proj.weight"))
            else:
                layer.qkv_proj.copy_(torch.cat([tensors.get(attn + f"{x}_proj.weight") for x in "qkv"]))
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(
                    tensors.get(attn + "qkv_proj.bias") if fused
                    else torch.cat([tensors.get(attn + f"{x}_proj.bias") for x in "qkv"])
                )
            layer.o_proj.copy_(tensors.get(attn + "o_proj.weight"))
            if config.qk_norm:
                layer.q_norm.copy_(norm(attn + "q_norm.weight"))
                layer.k_norm.copy_(norm(attn + "k_norm.weight"))
            layer.attn_norm.copy_(norm(p + "input_layernorm.weight"))
            if hasattr(layer, "post_attn_norm"):  # Gemma: norms before and after attention and the FFN
                layer.post_attn_norm.copy_(norm(p + "post_attention_layernorm.weight"))
                layer.ffn_norm.copy_(norm(p + "pre_feedforward_layernorm.weight"))
                layer.post_ffn_norm.copy_(norm(p + "post_feedforward_layernorm.weight"))
            else:
                layer.ffn_norm.copy_(tensors.get(p + "post_attention_layernorm.weight"))
            inter = config.intermediate_size
            if config.num_experts:  # stacked experts (transformers 5) or one module per expert
                mlp = p + "mlp."
                if mlp + "gate.weight" not in tensors:  # Mixtral's hub checkpoints: w1 gate, w3 up, w2 down
                    moe = p + "block_sparse_moe."
                    layer.router.copy_(tensors.get(moe + "gate.weight"))
                    for e in range(config.num_experts):
                        ex = f"{moe}experts.{e}."
                        layer.experts_gate_up_proj[e].copy_(torch.cat((tensors.get(ex + "w1.weight"), tensors.get(ex + "w3.weight"))))
                        layer.experts_down_proj[e].copy_(tensors.get(ex + "w2.weight"))
                    continue
                layer.router.copy_(tensors.get(mlp + "gate.weight"))
                if mlp + "experts.gate_up_proj" in tensors:
                    layer.experts_gate_up_proj.copy_(tensors.get(mlp + "experts.gate_up_proj"))
                    layer.experts_down_proj.copy_(tensors.get(mlp + "experts.down_proj"))
                else:
                    for e in range(config.num_experts):
                        ex = f"{mlp}experts.{e}."
                        layer.experts_gate_up_proj[e].copy_(
                            torch.cat((tensors.get(ex + "gate_proj.weight"), tensors.get(ex + "up_proj.weight")))
                        )
                        layer.experts_down_proj[e].copy_(tensors.get(ex + "down_proj.weight"))
            elif fused:
                layer.gate_up_proj.copy_(tensors.get(p + "mlp.gate_up_proj.weight"))
            else:
                layer.gate_up_proj[:inter].copy_(tensors.get(p + "mlp.gate_proj.weight"))
                layer.gate_up_proj[inter:].copy_(tensors.get(p + "mlp.up_proj.weight"))
            if not config.num_experts:
                layer.down_proj.copy_(tensors.get(p + "mlp.down_proj.weight"))
    model.eval()
    logger.info("loaded %s in %.1f s", directory.name, time.perf_counter() - started)
    return model, config, tokenizer

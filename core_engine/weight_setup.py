"""The weights' formats at load: the quantization policy's decision applied to the engine
config, then the model's products packed as decided (and logged, with why).

Used by :class:`~core_engine.llm_engine.LLMEngine` and by the tensor-parallel ranks
(:mod:`~core_engine.distributed.launcher`), which pack their shards the same way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec

from core_engine.config import EngineConfig, resolve_dtype
from core_engine.policy import QuantizationContext, QuantizationDecision, QuantizationPolicy
from core_engine.tokenizer import Tokenizer

__all__ = ["apply_quantization_policy", "pack_weights", "packs_from_blocks"]

logger = logging.getLogger("core_engine.llm_engine")


_FORMAT_TO_WEIGHTS = {"auto": "auto", "fp16": "float16", "int8": "int8", "int4": "int4"}


def _weights_to_format(weights: str, *, what: str) -> tuple[str, str | None]:
    """A decision's weight dtype -> (weight_format, dtype or None to keep the config's)."""
    if weights in ("auto", "int8", "int4"):
        return weights, None
    if weights == "float16":
        return "fp16", None
    if weights in ("float32", "bfloat16"):
        return "dense", weights
    raise ValueError(f"the quantization policy chose {what}={weights!r}; the engine stores weights as "
                     "'auto', 'int4', 'int8', 'float16', 'bfloat16' or 'float32'")


def apply_quantization_policy(config: EngineConfig, policy: QuantizationPolicy) -> EngineConfig:
    """Ask ``policy`` for the weight and KV cache formats (once, before the weights are read)
    and return the config that honours its answer; ``ValueError`` when it cannot be honoured.

    The context's ``requested`` is what the config asks for, so the default policy keeps it.
    """
    if config.weight_format == "dense":
        weights = str(resolve_dtype(config.dtype, config.device)).removeprefix("torch.")
    else:
        weights = _FORMAT_TO_WEIGHTS[config.weight_format]
    requested = QuantizationDecision(
        weights=weights,  # type: ignore[arg-type]
        kv_cache=config.kv_cache_dtype,
        layer_weights=dict(config.layer_weight_formats) if config.layer_weight_formats else None,  # type: ignore[arg-type]
        weight_memory_bytes=config.weight_memory_bytes,
    )
    context = QuantizationContext(
        model_name=config.model_name or Path(config.model_path).stem,
        model_path=config.model_path,
        device=config.device,
        file_type=_file_type(config.model_path),
        max_model_len=config.max_model_len,
        requested=requested,
    )
    decision = policy.choose_quantization(context)
    if not isinstance(decision, QuantizationDecision):
        raise ValueError(f"the quantization policy answered {type(decision).__name__}, not a QuantizationDecision")
    if decision == requested:
        return config
    changes: dict[str, Any] = {}
    if decision.kv_cache != config.kv_cache_dtype:
        changes["kv_cache_dtype"] = decision.kv_cache
    if decision.weights != requested.weights:
        changes["weight_format"], dtype = _weights_to_format(decision.weights, what="weights")
        if dtype is not None:
            changes["dtype"] = dtype
    if decision.layer_weights != requested.layer_weights:
        changes["layer_weight_formats"] = {
            pattern: _weights_to_format(w, what=f"layer_weights[{pattern!r}]")[0]
            for pattern, w in (decision.layer_weights or {}).items()
        } or None
    if decision.weight_memory_bytes != requested.weight_memory_bytes:
        changes["weight_memory_bytes"] = decision.weight_memory_bytes
    if changes:
        logger.info("quantization policy for %s: %s", context.model_name, changes)
        config = msgspec.structs.replace(config, **changes)  # validates the new combination
    return config


def _file_type(model_path: str) -> str | None:
    try:
        from core_engine.gguf_loader import GGUFFile

        return GGUFFile(model_path).file_type
    except Exception:  # the load proper reports unreadable files
        return None


def _describe_formats(formats: dict[str, str]) -> str:
    """``{"layers.3.qkv": "dense", ..."layers.3.down": "dense", "head": "int8"}`` -> "head=int8, layers.3.*=dense"."""
    by_layer: dict[str, dict[str, str]] = {}
    for name, fmt in formats.items():
        layer, _, product = name.rpartition(".")
        by_layer.setdefault(layer or name, {})[product] = fmt
    parts = []
    for layer, products in sorted(by_layer.items()):
        if layer != "head" and len(products) == 4 and len(set(products.values())) == 1:
            parts.append(f"{layer}.*={next(iter(products.values()))}")
        else:
            parts.extend(f"{layer}.{p}={f}" if layer != "head" else f"head={f}" for p, f in sorted(products.items()))
    return ", ".join(parts)


def packs_from_blocks(config: EngineConfig, dtype: Any, file_type: str | None, *, budget: bool = True) -> bool:
    """Whether :func:`pack_weights` stores every product of a GGUF file of ``file_type`` in a
    block format (int4/int8, from the file's blocks or requantised from the file): then the
    loader need not dequantise the products at all (``load_model(packs_from_blocks=...)``).
    Not with a weight budget, whose sensitivities are measured on the dense weights."""
    from core_engine.model.linear import resolve_weight_format

    if budget and config.weight_memory_bytes is not None:
        return False
    blocks = ("int4", "int8")
    try:
        formats = {resolve_weight_format(f, dtype=dtype, device=config.device, file_type=file_type)
                   for f in (config.weight_format, *(config.layer_weight_formats or {}).values())}
    except ValueError:
        return False  # pack_weights refuses it, with the dense weights loaded as before
    return formats <= set(blocks)


def pack_weights(model: Any, config: EngineConfig, tokenizer: Tokenizer, *, budget: bool = True) -> None:
    """Store ``model``'s products as ``config`` (after the policy) says, and log what was
    chosen and why; with ``config.weight_memory_bytes`` the layers' sensitivities decide
    which stay dense (see :mod:`core_engine.model.sensitivity`)."""
    from core_engine.model.formats import auto_weight_format

    source = getattr(model, "block_source", None)
    # The loaded file's metadata (reading the header again costs seconds on a busy machine).
    file_type = source.gguf_file.file_type if source is not None else _file_type(config.model_path)
    layer_formats = dict(config.layer_weight_formats or {})
    why = ""
    if config.weight_format == "auto":
        why = f" (auto: {auto_weight_format(config.device, model.dtype, file_type).reason})"
    if budget and config.weight_memory_bytes is not None:
        from core_engine.model.sensitivity import fit_weight_budget

        fitted = fit_weight_budget(model, config.weight_memory_bytes, tokenizer, weight_format=config.weight_format,
                                   layer_formats=layer_formats, file_type=file_type)
        layer_formats = {**fitted.layer_formats, **layer_formats}
        why += f"; budget {config.weight_memory_bytes / 2**20:.0f} MiB: {fitted.summary}"
    weight_format = model.set_weight_format(config.weight_format, layer_formats=layer_formats or None, file_type=file_type)
    others = _describe_formats(model.layer_formats)
    logger.info(
        "matmul weights: %s%s%s; %.0f MiB read per step, %.0f MiB resident", weight_format, f" ({others})" if others else "",
        why, model.matmul_weight_bytes() / 2**20, model.resident_weight_bytes() / 2**20,
    )
    if source is not None and source.requantized:
        logger.info("requantised from the file's own type: %s", "; ".join(source.requantized[:8]) +
                    (f" (+{len(source.requantized) - 8} more)" if len(source.requantized) > 8 else ""))

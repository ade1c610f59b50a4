"""The decoder architectures the core engine runs, by GGUF ``general.architecture`` name.

Every architecture is the shared Llama-family decoder (:mod:`core_engine.model.llama`: RMSNorm,
fused QKV with RoPE, GQA attention, SwiGLU) plus what its own module declares: how the file
stores the q/k rows, and the layer class when its layers differ (e.g. Qwen3's q/k norms).
Adding one is a module next to these and a line in :func:`architectures` (``docs/models.md``).
"""

from __future__ import annotations

from functools import cache

from core_engine.model.architecture import Architecture
from core_engine.model.config import LlamaConfig

__all__ = ["Architecture", "architecture", "architectures", "decoder_layer_class"]


@cache
def architectures() -> dict[str, Architecture]:
    """Every architecture the engine runs, by name (each module declares its own)."""
    from core_engine.model import gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe

    return {a.name: a for a in (
        llama.ARCHITECTURE, qwen2.ARCHITECTURE, qwen3.ARCHITECTURE, qwen3moe.ARCHITECTURE, phi3.ARCHITECTURE,
        gemma2.ARCHITECTURE, gemma3.ARCHITECTURE,
    )}


def architecture(name: str) -> Architecture | None:
    """The :class:`Architecture` called ``name``, or None if the engine does not run it."""
    return architectures().get(name)


def decoder_layer_class(config: LlamaConfig) -> type:
    """The decoder layer of ``config``'s architecture: its module's own class, or the Llama
    layer with q/k norms (Qwen3) and/or a mixture of experts (what the loaders pass to
    :class:`~core_engine.model.llama.LlamaModel`)."""
    from core_engine.model.llama import LlamaDecoderLayer
    from core_engine.model.moe import MoEDecoderLayer, QKNormMoEDecoderLayer
    from core_engine.model.qwen3 import QKNormDecoderLayer

    spec = architecture(config.architecture)
    if spec is not None and spec.layer_class is not None:
        return spec.layer_class
    return {
        (False, False): LlamaDecoderLayer, (True, True): QKNormMoEDecoderLayer,
        (False, True): MoEDecoderLayer, (True, False): QKNormDecoderLayer,
    }[(config.qk_norm, bool(config.num_experts))]

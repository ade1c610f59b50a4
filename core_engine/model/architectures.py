"""The decoder architectures the core engine runs, by GGUF ``general.architecture`` name.

Every architecture is the shared Llama-family decoder (:mod:`core_engine.model.llama`: RMSNorm,
fused QKV with RoPE, GQA attention, SwiGLU) plus what its own module declares: how the file
stores the q/k rows, and the layer class when its layers differ (e.g. Qwen3's q/k norms).
Adding one is a module next to these and a line in :func:`architectures` (``docs/models.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

__all__ = ["Architecture", "architecture", "architectures"]


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """What the loader and the model need to know about one architecture."""

    #: ``general.architecture`` in GGUF files.
    name: str
    #: llama.cpp's converter permutes the q/k rows of this architecture for its interleaved
    #: ("normal") RoPE; the loader undoes it. False where the file keeps Hugging Face's
    #: rotate-half order (llama.cpp runs those with NeoX RoPE).
    permuted_qk_rows: bool
    #: Per-head RMSNorm of q and k before RoPE (``blk.N.attn_q_norm`` / ``attn_k_norm``).
    qk_norm: bool = False
    #: The file holds q|k|v as one tensor (``attn_qkv``) and gate|up as one (``ffn_up``), as
    #: Phi-3's checkpoints do (``qkv_proj``, ``gate_up_proj``).
    fused_projections: bool = False
    #: Mixture-of-experts FFN (``ffn_gate_inp``, ``ffn_{gate,up,down}_exps``).
    moe: bool = False
    #: The module's own decoder layer (a ``LlamaDecoderLayer`` subclass) where the shared
    #: choice (q/k norms, experts) does not fit; None: the shared one.
    layer_class: type | None = None
    #: The file's norm weights are stored as offsets from 1 (Gemma's Hugging Face checkpoints
    #: multiply by ``1 + w``; llama.cpp's converter adds the 1, so its GGUFs hold ``w`` itself).
    hf_norm_offset: bool = False
    #: The architecture's own hyper-parameters, as :class:`~core_engine.model.config.LlamaConfig`
    #: fields: from a GGUF (called with a reader of ``{arch}.*`` keys, ``read(key, default)``,
    #: and the config read so far) and from a ``config.json`` (its dict and the config so far).
    gguf_hparams: Callable[[Callable[[str, Any], Any], Any], dict[str, Any]] | None = None
    hf_hparams: Callable[[Mapping[str, Any], Any], dict[str, Any]] | None = None


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

"""What one decoder architecture declares (:class:`Architecture`); the registry of them is
:mod:`core_engine.model.architectures`, which imports every architecture's module."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Architecture"]


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

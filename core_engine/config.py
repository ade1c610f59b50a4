"""Engine configuration: one frozen Struct, validated on construction."""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["EngineConfig", "SpeculationConfig", "resolve_dtype"]

DType = Literal["auto", "bfloat16", "float16", "float32"]
WeightFormat = Literal["auto", "dense", "fp16", "int8"]


class SpeculationConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding mechanisms the engine loads (see :mod:`core_engine.spec_decode`).

    Which of them a request uses at a step, and how many tokens it proposes, is the
    :class:`~core_engine.policy.SpeculationPolicy`'s answer, clipped to ``max_proposal``.
    """

    #: "ngram": prompt lookup (needs nothing); "draft": a second GGUF with the same vocabulary.
    methods: tuple[Literal["ngram", "draft"], ...] = ("ngram",)
    #: The draft model's GGUF (needed for "draft"; may be the target's own file).
    draft_model_path: str | None = None
    #: Most tokens one request proposes in one step.
    max_proposal: int = 16
    #: n-gram lookup: the longest suffix matched first, down to ``ngram_min`` tokens.
    ngram_max: int = 3
    ngram_min: int = 1
    #: Draft model KV pool (None: as many blocks as the target's pool).
    draft_kv_cache_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.methods:
            raise ValueError("speculation.methods: name at least one of 'ngram', 'draft'")
        if "draft" in self.methods and not self.draft_model_path:
            raise ValueError("speculation.draft_model_path: the 'draft' method needs a draft GGUF")
        if self.max_proposal < 1:
            raise ValueError(f"speculation.max_proposal must be >= 1, got {self.max_proposal}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"speculation: need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
            )


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How to build an :class:`~core_engine.llm_engine.LLMEngine`.

    The KV pool is ``kv_cache_memory_bytes // bytes_per_block`` blocks of ``block_size`` tokens,
    allocated once at start-up (see :mod:`core_engine.paged_attention` for the layout).
    """

    model_path: str
    #: "auto": bfloat16 where the CPU/GPU runs bf16 matmuls natively, else float32.
    dtype: DType = "auto"
    #: How the matmul weights are stored (see :mod:`core_engine.model.linear`): "auto" and
    #: "dense" keep them in ``dtype``; "fp16" (CPU) packs them as fp16 for fbgemm; "int8"
    #: (CPU, the fast path) uses int8 weights and int8 GEMMs, lossy but as close to the exact
    #: model as llama.cpp's own 8-bit arithmetic.
    weight_format: WeightFormat = "auto"
    device: str = "cpu"
    #: Memory for the KV-cache pool (all layers, K and V).
    kv_cache_memory_bytes: int = 512 * 2**20
    block_size: int = 16
    #: Chunked-prefill token budget per step (decodes count one token each).
    max_num_batched_tokens: int = 512
    #: Most requests in one step (the rest wait).
    max_num_seqs: int = 128
    #: Context window; None: the model's trained context length.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    #: torch intra-op threads on CPU (None: leave torch's setting alone).
    num_threads: int | None = None
    #: Seed of the generator used by requests that bring no seed (None: nondeterministic).
    seed: int | None = None
    #: torch.compile the pure-decode step (compiled at start-up: minutes on a small CPU; on
    #: the dev machine it cut decode step time by roughly a fifth at batch 1 and 16).
    compile_decode: bool = False
    #: Speculative decoding (None: off, and nothing of it runs).
    speculation: SpeculationConfig | None = None

    def __post_init__(self) -> None:
        for name in ("kv_cache_memory_bytes", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"EngineConfig.num_threads must be >= 1, got {self.num_threads}")


def resolve_dtype(name: str, device: str):  # -> torch.dtype (torch imported lazily)
    """The torch dtype for ``name`` on ``device``; "auto" picks bf16 where it is fast."""
    import torch

    if name != "auto":
        return getattr(torch, name)
    from core_engine.gguf_loader import preferred_dtype

    return preferred_dtype(device)

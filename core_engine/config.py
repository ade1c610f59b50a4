"""Engine configuration: one frozen Struct, validated on construction."""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from core_engine.policy import KVCacheDType

__all__ = ["EngineConfig", "SpeculationConfig", "check_weight_combination", "resolve_dtype"]

DType = Literal["auto", "bfloat16", "float16", "float32"]
WeightFormat = Literal["auto", "dense", "fp16", "int8", "int4"]


def check_weight_combination(weight_format: str, dtype: str, device: str, *, prefix: str = "") -> None:
    """Raise ValueError naming the combination when ``weight_format`` cannot run with ``dtype``
    on ``device`` (checked when a config is read, before anything is loaded).

    On CPU every format runs with ``dtype`` "auto", "float32" or "bfloat16" (the int8/int4
    kernels take either activation dtype), except "fp16", fbgemm's fp32-only kernel; on CUDA
    the formats are "auto", "dense" and "int4" (the Triton W4A16 kernel).
    """
    formats = get_args(WeightFormat)
    if weight_format not in formats:
        raise ValueError(f"{prefix}weight_format must be one of {', '.join(formats)}; got {weight_format!r}")
    if dtype not in get_args(DType):
        raise ValueError(f"{prefix}dtype must be one of {', '.join(get_args(DType))}; got {dtype!r}")
    combo = f"{prefix}weight_format={weight_format!r} with {prefix}dtype={dtype!r} on {device!r}"
    if device.startswith("cuda"):
        if weight_format in ("fp16", "int8"):
            raise ValueError(f"{combo}: on CUDA the weight formats are 'auto', 'dense' and 'int4'")
        return
    if weight_format == "fp16" and dtype not in ("auto", "float32"):
        raise ValueError(f"{combo}: fbgemm's fp16-weight kernel computes in float32 (use dtype 'float32' or 'auto')")
    if weight_format in ("int8", "int4") and dtype == "float16":
        raise ValueError(f"{combo}: the CPU int8/int4 kernels take float32 or bfloat16 activations")


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
    #: The name policies see (``QuantizationContext.model_name``); None: the file's stem.
    model_name: str | None = None
    #: "auto": bfloat16 where the CPU/GPU runs bf16 matmuls natively, else float32.
    dtype: DType = "auto"
    #: How the matmul weights are stored (see :mod:`core_engine.model.formats`): "auto" is
    #: the fastest format within the accuracy bound on this hardware (a 4-bit file: int4 with
    #: its 8-bit tensors at int8); "dense" keeps them in ``dtype``; "fp16" (CPU) packs them
    #: as fp16 for fbgemm; "int8"/"int4" are blocks of 32 with fp16 scales (Q8_0/Q4_1), taken
    #: from the file's own blocks where they match.
    weight_format: WeightFormat = "auto"
    #: Per-product formats over ``weight_format``: product name or glob ("head",
    #: "layers.0.*", "layers.*.down") -> format.
    layer_weight_formats: dict[str, str] | None = None
    #: A budget for the resident weights (bytes): the engine measures each layer's
    #: sensitivity at load and keeps the most sensitive ones dense while the budget allows.
    weight_memory_bytes: int | None = None
    device: str = "cpu"
    #: Memory for the KV-cache pool (all layers, K and V).
    kv_cache_memory_bytes: int = 512 * 2**20
    #: How K/V are stored (see :mod:`core_engine.kv_quant`): "auto" is the compute dtype;
    #: "int8" / "fp8_*" keep codes with a float32 scale per block and kv head, so the same
    #: memory holds ~2x the tokens of bf16 (~4x of fp32). fp8 needs a torch that casts it on
    #: ``device``.
    kv_cache_dtype: KVCacheDType = "auto"
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
    #: KV tiers below the pool (see :mod:`core_engine.kv_offload`): host memory for evicted
    #: prefix blocks (0: no host tier), and a disk directory with its byte budget (None: no
    #: disk tier). Blocks on disk are reused by a restarted engine with the same model file.
    kv_host_memory_bytes: int = 0
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 8 * 2**30
    #: Most of each tier's blocks one tenant's cached prefixes may hold (a fraction; None:
    #: no quota). A tenant at its quota recycles its own least recently used blocks.
    kv_tenant_quota: float | None = None
    #: Of the prefix pins (``SamplingParams.pin_prefix``; a quarter of the pool at most), the
    #: share one tenant's requests may hold (None: no per-tenant cap).
    kv_pin_tenant_share: float | None = 0.5
    #: Ranks the weights are split over (:mod:`core_engine.distributed`): this engine is
    #: rank 0 and starts the others as processes; gloo on CPU, NCCL on CUDA (rank r on cuda:r).
    tensor_parallel_size: int = 1
    #: How long a collective waits for a rank before the step fails (a rank that died or hangs).
    tensor_parallel_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        check_weight_combination(self.weight_format, self.dtype, self.device, prefix="EngineConfig.")
        for fmt in (self.layer_weight_formats or {}).values():
            check_weight_combination(fmt, self.dtype, self.device, prefix="EngineConfig.layer_weight_formats: ")
        if self.weight_memory_bytes is not None and self.weight_memory_bytes < 1:
            raise ValueError(f"EngineConfig.weight_memory_bytes must be >= 1, got {self.weight_memory_bytes}")
        for name in ("kv_cache_memory_bytes", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_dtype not in get_args(KVCacheDType):
            raise ValueError(
                f"EngineConfig.kv_cache_dtype must be one of {list(get_args(KVCacheDType))}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_host_memory_bytes < 0 or self.kv_disk_bytes < 0:
            raise ValueError("EngineConfig.kv_host_memory_bytes and kv_disk_bytes must be >= 0")
        if self.kv_tenant_quota is not None and not 0.0 < self.kv_tenant_quota <= 1.0:
            raise ValueError(f"EngineConfig.kv_tenant_quota must be in (0, 1], got {self.kv_tenant_quota}")
        if self.kv_pin_tenant_share is not None and not 0.0 < self.kv_pin_tenant_share <= 1.0:
            raise ValueError(f"EngineConfig.kv_pin_tenant_share must be in (0, 1], got {self.kv_pin_tenant_share}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"EngineConfig.num_threads must be >= 1, got {self.num_threads}")
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"EngineConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_timeout_s <= 0:
            raise ValueError(f"EngineConfig.tensor_parallel_timeout_s must be > 0, got {self.tensor_parallel_timeout_s}")
        if self.tensor_parallel_size == 1:
            return
        # What runs on rank 0 alone and would need every rank's part of the model or pool.
        refused = {
            "compile_decode": self.compile_decode,
            "weight_memory_bytes": self.weight_memory_bytes is not None,
            "kv_host_memory_bytes / kv_disk_dir": self.kv_host_memory_bytes > 0 or self.kv_disk_dir is not None,
            "speculation.methods 'draft'": self.speculation is not None and "draft" in self.speculation.methods,
        }
        for name, used in refused.items():
            if used:
                raise ValueError(
                    f"EngineConfig.tensor_parallel_size={self.tensor_parallel_size}: {name} does not run with "
                    "tensor parallelism yet (n-gram speculation, prefix caching and every weight/KV format do)"
                )


def resolve_dtype(name: str, device: str, weight_format: str = "auto"):  # -> torch.dtype (lazy torch)
    """The torch dtype for ``name`` on ``device``; "auto" picks bf16 where it is fast (fp32 for
    the fp32-only "fp16" weight format)."""
    import torch

    if name != "auto":
        return getattr(torch, name)
    if weight_format == "fp16" and not device.startswith("cuda"):
        return torch.float32
    from core_engine.gguf_loader import preferred_dtype

    return preferred_dtype(device)

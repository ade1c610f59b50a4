"""The ``core_engine`` backend: infermux's own PyTorch engine.

By default the gateway runs this backend in a supervised worker process (option
``engine_process``, default true; :mod:`backends.worker`): the engine's Python work then
does not share the gateway's GIL, and a crash there fails and restarts only this backend.
The class below is the in-process code either way (``engine_process = false`` runs it in the
gateway's process, for tests and notebooks).

Many requests share one :class:`~core_engine.async_llm.AsyncLLM` (continuous batching, paged KV
cache, prefix caching). This module only translates: a :class:`GenerationRequest` becomes token
ids (chat rendered with the model's template) and engine :class:`~core_engine.sampling_params.
SamplingParams`; engine outputs become :class:`GenerationChunk` s with usage (including
``cached_tokens``), engine phases and logprobs; engine errors become :mod:`backends.errors`.
Closing the iterator aborts the engine request, which frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import msgspec

from backends._option import decode_options
from backends.base import (
    BackendConfig,
    Capabilities,
    EnginePhases,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
    ModelInfo,
    SpeculationStats,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from backends.base import SamplingParams as WireParams
from backends.chat_plan import ChatOptions, ChatPlan, load_chat, pinned_prefixes, plan_chat
from backends.errors import (
    BackendConfigError,
    BackendError,
    BackendUnavailableError,
    ContextLengthExceededError,
    InfermuxError,
    InvalidRequestError,
    UnsupportedParameterError,
)
from backends.model_loading import load_with_progress, resolve_model_path
from backends.prefix_cache import CacheEvents, PrefixCacheIndex
from backends.resume import resumed_output, resumed_prompt
from backends.threads import default_num_threads
from backends.token_ids import as_prompt, detokenized, tokenized
from core_engine.chat.content_text import ControlTexts
from core_engine.chat.formats import ChatFormat
from core_engine.chat.template import ChatTemplate, ChatTemplateError

__all__ = [
    "KV_DECODE_LABEL",
    "KV_PREFILL_LABEL",
    "CoreEngineBackend",
    "CoreEngineOptions",
    "KVTransferOptions",
    "create_backend",
]

logger = logging.getLogger(__name__)


#: Disaggregated serving (``backends/disaggregated.py``): a request labelled
#: ``KV_PREFILL_LABEL = <transfer id>`` is prefilled only and its KV sent under that id; one
#: labelled ``KV_DECODE_LABEL = <transfer id>`` continues from the KV received under it.
KV_PREFILL_LABEL = "infermux.kv_prefill"
KV_DECODE_LABEL = "infermux.kv_decode"


class SpeculationOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``options.speculation`` (see ``core_engine.config.SpeculationConfig``)."""

    methods: tuple[Literal["ngram", "draft"], ...] = ("ngram",)
    draft_model_path: str | None = None
    max_proposal: int = 16
    ngram_max: int = 3
    ngram_min: int = 1
    draft_kv_cache_memory_mb: int | None = None


class KVTransferOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``options.kv_transfer`` (see ``core_engine.kv_transfer.transport.KVTransferConfig``)."""

    #: "shm": shared memory, prefill and decode engines on one host; "tcp": ZeroMQ.
    transport: Literal["shm", "tcp"] = "shm"
    #: tcp: the decode engine's ``tcp://host:port`` (it listens there, prefill engines connect).
    address: str | None = None
    #: How long a decode waits for its KV, and how long an unclaimed transfer is kept.
    timeout_s: float = 30.0
    ttl_s: float = 60.0
    #: tcp: the largest transfer in bytes, and the unclaimed transfers a decode side keeps.
    max_message_bytes: int = 512 * 1024 * 1024
    max_pending_transfers: int = 32
    #: tcp, ZeroMQ CURVE (required off loopback): this engine's certificate with its secret
    #: key; prefill: the decode engine's public certificate; decode: the directory of the
    #: prefill engines' public certificates.
    secret_key_file: str | None = None
    server_key_file: str | None = None
    authorized_keys_dir: str | None = None


class CoreEngineOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a ``kind = "core_engine"`` backend (see ``core_engine.config.EngineConfig``)."""

    #: GGUF file; default: the embedded SmolLM2-135M-Instruct.
    model_path: str | None = None
    #: "auto" (bf16 where the hardware has native bf16, else fp32), "bfloat16", "float32"...
    dtype: str = "auto"
    #: "auto" (the fastest format within the accuracy bound on this hardware: a 4-bit file
    #: runs int4 with its 8-bit tensors at int8), "dense" (weights in ``dtype``), "fp16"
    #: (fbgemm-packed, CPU, float32 compute), "int8" or "int4" (blocks of 32 as in Q8_0/Q4_1).
    #: What the built-in quantization policy answers unless a plugin decides otherwise.
    weight_format: Literal["auto", "dense", "fp16", "int8", "int4"] = "auto"
    #: Per-product formats over ``weight_format`` (product name or glob -> format), e.g.
    #: ``{"head" = "int8", "layers.0.*" = "dense"}``.
    layer_weight_formats: dict[str, str] | None = None
    #: A budget for the resident weights: the most sensitive layers (measured at load) stay
    #: dense while it allows.
    weight_memory_mb: int | None = None
    device: str = "cpu"
    kv_cache_memory_mb: int = 512
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    #: Torch threads (default: backends/threads.py, ``INFERMUX_NUM_THREADS`` or 2; None: torch's own).
    num_threads: int | None = msgspec.field(default_factory=default_num_threads)
    #: Seed for requests that send none (None: nondeterministic).
    seed: int | None = None
    #: ``model_info().id`` (default: the file name without ``.gguf``).
    model_id: str | None = None
    #: Speculative decoding mechanisms to load (absent: off). Per request and step the
    #: speculation policy (hook ``infermux_choose_speculation``) picks the method and k.
    speculation: SpeculationOptions | None = None
    #: How the KV cache stores K/V: "auto" (the compute dtype), "int8" (per-block, per-head
    #: scales; ~2x the tokens of bf16 in the same memory), "fp8_e4m3"/"fp8_e5m2" (where torch
    #: has the dtype), "bfloat16", "float16", "float32". What the built-in quantization policy
    #: answers unless its settings or a plugin (hook ``infermux_choose_quantization``) decide
    #: otherwise.
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "float32", "int8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    #: KV tiers (absent: off): host memory for evicted prefix blocks, and a disk directory
    #: (with its byte budget) whose blocks survive restarts. Hook ``infermux_plan_kv_offload``
    #: decides per step what else moves.
    kv_host_bytes: int | None = None
    kv_disk_dir: str | None = None
    kv_disk_bytes: int | None = None
    #: Most of each tier one tenant's cached prefixes may hold (0..1; absent: no quota).
    kv_tenant_quota: float | None = None
    #: Of the pinned prefixes (Anthropic ``cache_control``; a quarter of the pool at most),
    #: the share one tenant's requests may hold (0..1; a pin beyond it is not made: the
    #: prefix stays cached as any other, evictable).
    kv_pin_tenant_share: float = 0.5
    #: Run the engine in its own supervised worker process (default); false: in the
    #: gateway's process (tests, notebooks; plugins registered by code then answer its hooks).
    engine_process: bool = True
    #: Ranks the weights are split over (tensor parallelism; this engine starts the other
    #: ranks as processes: gloo on CPU, NCCL on CUDA with rank r on cuda:r).
    tensor_parallel_size: int = 1
    #: How long a step waits for a rank that died or hangs before the engine fails (and its
    #: worker process is started again).
    tensor_parallel_timeout_s: float = 30.0
    #: Disaggregated serving: "prefill" sends each prefilled prompt's KV over ``kv_transfer``,
    #: "decode" receives it and continues the request, "both" (default) does either when
    #: ``kv_transfer`` is set. Every role still serves whole requests too.
    role: Literal["prefill", "decode", "both"] = "both"
    kv_transfer: KVTransferOptions | None = None
    #: ``POST /v1/embeddings``: how a sequence's final hidden states (after the final norm,
    #: before the LM head) become its vector, which is then L2-normalised: "mean" over its
    #: tokens, or "last" (its last token's, as embedding models trained that way expect).
    embedding_pooling: Literal["mean", "last"] = "mean"
    #: Chat formatting: a template file instead of the model's, tool-call and reasoning
    #: formats when the template does not show them (:class:`backends.chat_plan.ChatOptions`).
    chat: ChatOptions | None = None

    def __post_init__(self) -> None:
        # A combination no CPU runs is refused when the config is read (torch is not needed).
        from core_engine.config import check_weight_combination

        check_weight_combination(self.weight_format, self.dtype, self.device)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_timeout_s <= 0:
            raise ValueError(f"tensor_parallel_timeout_s: must be > 0, got {self.tensor_parallel_timeout_s}")
        if self.tensor_parallel_size > 1 and self.kv_transfer is not None:
            raise ValueError(
                "kv_transfer: disaggregated serving reads and writes one rank's KV pool; it does not run with "
                "tensor_parallel_size > 1 yet"
            )
        for fmt in (self.layer_weight_formats or {}).values():
            check_weight_combination(fmt, self.dtype, self.device, prefix="layer_weight_formats: ")


class CoreEngineBackend:
    """The native engine behind the Backend contract; see the module docstring."""

    kind = "core_engine"

    def __init__(self, config: BackendConfig) -> None:
        self.name = config.name
        self.config = config
        self.options = decode_options(config, CoreEngineOptions)
        if config.worker_process is not None and "engine_process" in config.options:
            if config.worker_process != self.options.engine_process:
                raise ValueError(
                    f"backends.{config.name}.options.engine_process: contradicts worker_process = "
                    f"{str(config.worker_process).lower()} (set one of them)"
                )
        #: Where the gateway runs this backend unless ``worker_process`` says otherwise.
        self.worker_process_default = self.options.engine_process
        if self.options.kv_cache_memory_mb < 1:
            raise ValueError(f"backends.{config.name}.options.kv_cache_memory_mb: must be at least 1")
        self._check_tier_options()
        self._kv_transfer_config: Any = self._transfer_config()
        self._kv_sender: Any = None  # KVSender (role prefill/both)
        self._kv_receiver: Any = None  # KVReceiver (role decode/both)
        self.capabilities = Capabilities(
            logprobs=True,
            echo=True,
            structured_outputs=True,
            tools=True,
            max_top_logprobs=20,
            # A tensor-parallel rank 0 holds a shard of the hidden state: no embeddings there.
            embeddings=self.options.tensor_parallel_size == 1,
            tokenize=True,
            resume=True,
        )
        self._llm: Any | None = None  # AsyncLLM
        self._template: ChatTemplate | None = None
        self._chat_format = ChatFormat()
        self._bos_text = ""
        self._model_path: Path | None = None
        self._pieces: dict[int, bytes] = {}
        self._counter = 0
        #: Tokens streamed so far, all requests (a worker process reports it to the gateway).
        self.num_generated_tokens = 0
        self._policies: Any = None  # EnginePolicies, from use_policies()
        self._spec_config: Any = self._speculation_config()
        #: The engine's prefix cache as the router sees it in-process (:meth:`prefix_cache`).
        self._prefix_cache = PrefixCacheIndex()

    def _check_tier_options(self) -> None:
        o = self.options
        prefix = f"backends.{self.name}.options."
        for key in ("kv_host_bytes", "kv_disk_bytes"):
            value = getattr(o, key)
            if value is not None and value < 1:
                raise BackendConfigError(f"{prefix}{key}: must be a positive number of bytes, got {value}")
        if o.kv_disk_bytes is not None and o.kv_disk_dir is None:
            raise BackendConfigError(f"{prefix}kv_disk_bytes: set kv_disk_dir too (the disk tier's directory)")
        if o.kv_tenant_quota is not None and not 0.0 < o.kv_tenant_quota <= 1.0:
            raise BackendConfigError(f"{prefix}kv_tenant_quota: must be in (0, 1], got {o.kv_tenant_quota}")
        if not 0.0 < o.kv_pin_tenant_share <= 1.0:
            raise BackendConfigError(f"{prefix}kv_pin_tenant_share: must be in (0, 1], got {o.kv_pin_tenant_share}")
        if (o.kv_host_bytes or o.kv_disk_dir) and not o.enable_prefix_caching:
            raise BackendConfigError(f"{prefix}kv_host_bytes/kv_disk_dir: the KV tiers need enable_prefix_caching")

    def _transfer_config(self) -> Any:
        o = self.options
        prefix = f"backends.{self.name}.options."
        if o.kv_transfer is None:
            if o.role != "both":
                raise BackendConfigError(f"{prefix}role: role = {o.role!r} needs kv_transfer (the KV transport)")
            return None
        from core_engine.kv_transfer.transport import KVTransferConfig

        try:
            return KVTransferConfig(**msgspec.structs.asdict(o.kv_transfer))
        except ValueError as exc:
            raise BackendConfigError(f"{prefix}{exc}") from exc

    def _open_transport(self) -> None:
        """The KV transport ends this role needs (in the engine's process, after the load)."""
        config = self._kv_transfer_config
        if config is None:
            return
        from core_engine.kv_transfer import KVTransferError, open_receiver, open_sender

        try:
            if self.options.role in ("decode", "both"):
                self._kv_receiver = open_receiver(config)
            if self.options.role in ("prefill", "both"):
                self._kv_sender = open_sender(config)
        except KVTransferError as exc:
            raise BackendConfigError(f"backends.{self.name}.options.{exc}") from exc

    def _close_transport(self) -> None:
        sender, self._kv_sender = self._kv_sender, None
        receiver, self._kv_receiver = self._kv_receiver, None
        for end in (sender, receiver):
            if end is not None:
                end.close()

    def _speculation_config(self) -> Any:
        spec = self.options.speculation
        if spec is None:
            return None
        from core_engine.config import SpeculationConfig

        prefix = f"backends.{self.name}.options."
        path = spec.draft_model_path
        if path is not None:
            path = str(Path(path).expanduser())
            if not Path(path).is_file():
                raise BackendConfigError(f"{prefix}speculation.draft_model_path: file not found: {path}")
        try:
            return SpeculationConfig(
                methods=tuple(spec.methods),
                draft_model_path=path,
                max_proposal=spec.max_proposal,
                ngram_max=spec.ngram_max,
                ngram_min=spec.ngram_min,
                draft_kv_cache_memory_bytes=None
                if spec.draft_kv_cache_memory_mb is None
                else spec.draft_kv_cache_memory_mb * 2**20,
            )
        except ValueError as exc:
            raise BackendConfigError(f"{prefix}{exc}") from exc

    def use_policies(self, policies: Any) -> None:
        """The :class:`~core_engine.policy.EnginePolicies` the engine consults (the gateway's
        plugin hooks); before :meth:`start`, or at any time after (from the next step)."""
        self._policies = policies
        if self._llm is not None:
            self._llm.engine.use_policies(policies)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model on a worker thread (progress logged), then start the engine loop."""
        if self._llm is not None:
            return
        path = self._resolve_model_path()
        self._llm, took = await load_with_progress(self.name, path, lambda: self._load(path))
        try:
            self._open_transport()
        except BaseException:
            await self.aclose()
            raise
        logger.info("backend %s: loaded %s in %.1f s", self.name, path.name, took)

    def _resolve_model_path(self) -> Path:
        from core_engine.hf_loader import is_hf_checkpoint

        self._model_path = resolve_model_path(
            self.name,
            self.options.model_path,
            accepts=lambda path: path.is_file() or is_hf_checkpoint(path),
            expected="a GGUF file or a Hugging Face checkpoint directory with config.json",
        )
        return self._model_path
    def _load(self, path: Path) -> Any:
        try:
            from core_engine.async_llm import AsyncLLM
            from core_engine.config import EngineConfig
        except ImportError as exc:
            raise BackendUnavailableError(
                f"backend {self.name!r}: the core engine needs torch: pip install -e '.[core]' ({exc})"
            ) from exc
        o = self.options
        try:
            config = EngineConfig(
                model_path=str(path),
                dtype=o.dtype,  # type: ignore[arg-type]
                weight_format=o.weight_format,
                layer_weight_formats=o.layer_weight_formats,
                weight_memory_bytes=None if o.weight_memory_mb is None else o.weight_memory_mb * 2**20,
                device=o.device,
                kv_cache_memory_bytes=o.kv_cache_memory_mb * 2**20,
                block_size=o.block_size,
                max_num_batched_tokens=o.max_num_batched_tokens,
                max_num_seqs=o.max_num_seqs,
                max_model_len=o.max_model_len,
                enable_prefix_caching=o.enable_prefix_caching,
                num_threads=o.num_threads,
                seed=o.seed,
                speculation=self._spec_config,
                model_name=self.name,
                kv_cache_dtype=o.kv_cache_dtype,
                kv_host_memory_bytes=o.kv_host_bytes or 0,
                kv_disk_dir=None if o.kv_disk_dir is None else str(Path(o.kv_disk_dir).expanduser()),
                kv_disk_bytes=o.kv_disk_bytes if o.kv_disk_bytes is not None else 8 * 2**30,
                kv_tenant_quota=o.kv_tenant_quota,
                kv_pin_tenant_share=o.kv_pin_tenant_share,
                tensor_parallel_size=o.tensor_parallel_size,
                tensor_parallel_timeout_s=o.tensor_parallel_timeout_s,
            )
            llm = AsyncLLM.from_config(config, policies=self._policies)
        except ValueError as exc:  # options this machine or file cannot run (weight_format...)
            raise BackendConfigError(f"backend {self.name!r}: cannot load {path}: {exc}") from exc
        except (OSError, RuntimeError) as exc:
            raise BackendUnavailableError(f"backend {self.name!r}: could not load {path}: {exc}") from exc
        tokenizer = llm.engine.tokenizer
        self._bos_text = self._special_text(tokenizer, tokenizer.bos_token_id)
        try:
            self._template, self._chat_format = load_chat(
                self.options.chat,
                tokenizer.chat_template,
                bos_token=self._bos_text,
                eos_token=self._special_text(tokenizer, tokenizer.eos_token_id),
                control_texts=ControlTexts(
                    tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)
                ),
            )
        except ChatTemplateError as exc:
            raise BackendConfigError(f"backend {self.name!r}: {exc}") from exc
        return llm

    @staticmethod
    def _special_text(tokenizer: Any, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return tokenizer.token_to_bytes(token_id, skip_special=False).decode("utf-8", errors="replace")

    def model_info(self) -> ModelInfo:
        path = self._model_path
        model_id = self.options.model_id or (path.name.removesuffix(".gguf") if path else self.name)
        llm = self._llm
        return ModelInfo(
            id=model_id,
            context_length=llm.engine.max_model_len if llm is not None else self.options.max_model_len,
            chat_template=llm.engine.tokenizer.chat_template if llm is not None else None,
        )

    async def health(self) -> HealthStatus:
        llm = self._llm
        if llm is None:
            return HealthStatus(ok=False, detail="model not loaded")
        if not llm.is_running:
            return HealthStatus(ok=False, detail="engine loop stopped")
        lost = self._lost_rank()
        if lost is not None:
            return HealthStatus(ok=False, detail=lost)
        return HealthStatus(ok=True, detail=f"{llm.engine.num_unfinished_requests} requests in flight")

    @property
    def fatal(self) -> str | None:
        """Why this backend can serve nothing more until it is built again (its engine loop
        died: a tensor-parallel rank was lost, a kernel raised), else None. A worker process
        exits on it, so that its supervisor starts a fresh engine."""
        llm = self._llm
        if llm is not None and not llm.is_running:
            return "its engine loop stopped"
        return self._lost_rank()

    def _lost_rank(self) -> str | None:
        """A tensor-parallel rank that exited (the next step would fail on it), else None."""
        engine = self.engine
        ranks = None if engine is None else engine.tensor_parallel
        return None if ranks is None else ranks.lost()

    async def aclose(self) -> None:
        self._close_transport()
        llm, self._llm = self._llm, None
        if llm is not None:
            await llm.shutdown()

    def stats(self) -> dict[str, float]:
        """Live engine figures for ``/metrics`` (read at scrape time; empty before start)."""
        engine = self.engine
        if engine is None:
            return {}
        scheduler = engine.scheduler
        admitted = scheduler.num_prompt_tokens_admitted
        figures = {
            "num_running": float(len(scheduler.running)),
            "num_waiting": float(len(scheduler.waiting)),
            "kv_cache_usage": float(engine.kv_cache_manager.usage),
            "prefix_cache_hit_rate": scheduler.num_prompt_tokens_cached / admitted if admitted else 0.0,
        }
        speculator = engine.speculator
        if speculator is not None:
            figures["spec_decode_num_drafts"] = float(scheduler.num_spec_drafts)
            figures["spec_decode_num_draft_tokens"] = float(scheduler.num_spec_draft_tokens)
            figures["spec_decode_num_accepted_tokens"] = float(scheduler.num_spec_accepted_tokens)
            if speculator.ngram is not None:
                figures["spec_decode_ngram_seconds"] = speculator.ngram.seconds
        if engine.tensor_parallel is not None:
            figures["tensor_parallel_size"] = float(engine.tensor_parallel.world_size)
        kv = engine.kv_cache_manager
        figures["kv_cache_num_blocks"] = float(kv.num_blocks)
        figures["kv_cache_num_free_blocks"] = float(kv.num_free_blocks)
        figures["kv_cache_capacity_tokens"] = float(kv.num_blocks * kv.block_size)
        handoff = engine.handoff
        if self._kv_transfer_config is not None:
            figures["kv_transfer_blocks:exported"] = float(handoff.num_exported_blocks)
            figures["kv_transfer_blocks:written"] = float(handoff.num_written_blocks)
            figures["kv_transfer_blocks:reused"] = float(handoff.num_reused_blocks)
        if engine.tiers is not None:
            figures |= engine.tiers.stats()
            for tier, tokens in engine.tiers.hit_tokens.items():
                figures[f"kv_hit_rate:{tier}"] = tokens / admitted if admitted else 0.0
        return figures

    def take_kv_events(self) -> CacheEvents | None:
        """The block hashes that entered / left the engine's prefix cache since the last
        call (None: nothing changed, or not loaded). The worker process sends them over."""
        engine = self.engine
        if engine is None:
            return None
        kv = engine.kv_cache_manager
        batch = kv.block_pool.take_kv_events()
        if batch.is_empty:
            return None
        return CacheEvents(block_size=kv.block_size, stored=batch.stored, removed=batch.removed, reset=batch.reset)

    def prefix_cache(self) -> PrefixCacheIndex:
        """The engine's cached block hashes, up to date (in-process: drained now)."""
        events = self.take_kv_events()
        if events is not None:
            self._prefix_cache.apply(events)
        return self._prefix_cache

    @property
    def engine(self) -> Any:
        """The :class:`~core_engine.llm_engine.LLMEngine` (tests, metrics); None before start."""
        return self._llm.engine if self._llm is not None else None

    # -- serving --------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream one choice; closing the iterator aborts the engine request. A request
        labelled ``KV_PREFILL_LABEL`` is prefilled only (one chunk: the first token), one
        labelled ``KV_DECODE_LABEL`` continues from the KV a prefill engine sent."""
        if request.kind == "embedding":
            return self._embed(request)
        if request.kind in ("tokenize", "detokenize"):
            return self._tokenize(request)
        if KV_PREFILL_LABEL in request.labels:
            return self._prefill_only(request, request.labels[KV_PREFILL_LABEL])
        if request.kind == "chat":
            return self._chat(request)
        if request.resume is not None:
            return self._resumed(request, None)
        return self._generate(request)

    async def _tokenize(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The prompt's token ids (as a generation of it would see them), or the text of
        ``prompt``'s ids; one chunk. Worked out on a worker thread: a body of megabytes takes
        seconds, which on the event loop would stall every stream of this process (the
        tokenizer and the template are read-only; the word cache is a dict)."""
        llm = self._llm
        if llm is None:
            raise BackendUnavailableError(f"backend {self.name!r} is not loaded")
        yield await asyncio.to_thread(self._tokenized, request, llm.engine)

    def _tokenized(self, request: GenerationRequest, engine: Any) -> GenerationChunk:
        tokenizer, vocab_size = engine.tokenizer, engine.model_config.vocab_size
        if request.kind == "detokenize":
            return detokenized(request, vocab_size, lambda ids: tokenizer.decode(ids, skip_special=False))
        prompt_request = as_prompt(request)
        plan = None
        if prompt_request.kind == "chat":
            if self._template is None:
                raise BackendUnavailableError(f"backend {self.name!r} is not loaded")
            plan = plan_chat(prompt_request, self._template, self._chat_format)
        prompt_ids, _ = self._prompt(prompt_request, tokenizer, vocab_size, plan)
        return tokenized(prompt_ids)

    async def _embed(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Every input in one chunk: tokenized here, pooled on the engine's thread between
        steps (``LLMEngine.embed``: all inputs in as few forwards as the token budget allows)."""
        from core_engine.errors import EngineDeadError, InvalidParamError, RequestTooLongError

        llm = self._llm
        if llm is None:
            raise BackendUnavailableError(f"backend {self.name!r} is not loaded")
        hidden_size = llm.engine.model_config.hidden_size
        if request.dimensions is not None and request.dimensions != hidden_size:
            raise UnsupportedParameterError(
                f"the model {request.model!r} gives vectors of {hidden_size} dimensions only "
                f"(backend {self.name!r} cannot shorten them)",
                param="dimensions",
            )
        tokenizer = llm.engine.tokenizer
        token_ids: list[list[int]] = []
        for i, item in enumerate(request.inputs or ()):
            ids = list(item) if isinstance(item, tuple) else tokenizer.encode(item, add_special=True, parse_special=True)
            if not ids:
                raise InvalidRequestError("the input has no tokens", param=f"input[{i}]")
            token_ids.append(ids)
        pooling = self.options.embedding_pooling
        try:
            vectors = await llm.call(lambda engine: engine.embed(token_ids, pooling))
        except RequestTooLongError as exc:
            raise ContextLengthExceededError(exc.message, param=exc.param) from exc
        except InvalidParamError as exc:
            raise InvalidRequestError(exc.message, param=exc.param) from exc
        except EngineDeadError as exc:
            raise BackendUnavailableError(f"backend {self.name!r}: {exc}") from exc
        yield GenerationChunk(
            embeddings=tuple(v.cpu().numpy().astype("<f4").tobytes() for v in vectors),
            finish_reason="stop",
            usage=Usage(prompt_tokens=sum(len(ids) for ids in token_ids), completion_tokens=0),
        )
    async def _chat(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if self._template is None:
            raise BackendUnavailableError(f"backend {self.name!r} is not loaded")
        plan = plan_chat(request, self._template, self._chat_format)
        if request.resume is not None:
            chunks = self._resumed(request, plan)
        else:
            chunks = plan.parse(self._generate(request, plan))
        async for chunk in chunks:
            yield chunk

    async def _resumed(self, request: GenerationRequest, plan: ChatPlan | None) -> AsyncIterator[GenerationChunk]:
        """Continue another backend's partial answer (``request.resume``, backends/resume.py):
        the prompt followed by its output, re-texted over the whole output."""
        llm = self._llm
        resume = request.resume
        if llm is None:
            raise BackendUnavailableError(f"backend {self.name!r} is not loaded")
        assert resume is not None
        tokenizer = llm.engine.tokenizer
        prompt_ids, _ = self._prompt(request, tokenizer, llm.engine.model_config.vocab_size, plan)
        prompt_ids = resumed_prompt(
            prompt_ids, resume, lambda text: tokenizer.encode(text, add_special=False, parse_special=False)
        )
        async for chunk in resumed_output(
            self._generate(request, plan, prompt_ids),
            resume,
            piece=lambda token_id: self._piece(tokenizer, token_id),
            stop=request.params.stop,
            num_prompt_tokens=len(prompt_ids),
        ):
            yield chunk

    def _transfer_end(self, end: Any, role: str) -> Any:
        if end is None:
            raise InvalidRequestError(
                f"backend {self.name!r} has no KV transport for {role} (options role and kv_transfer)"
            )
        return end

    async def _prefill_only(self, request: GenerationRequest, transfer_id: str) -> AsyncIterator[GenerationChunk]:
        """Prefill, send the prompt's KV under ``transfer_id``, answer the first token."""
        from core_engine.errors import EngineDeadError, InvalidParamError, RequestTooLongError
        from core_engine.kv_transfer import KVTransferError

        llm = self._llm
        if llm is None:
            raise BackendUnavailableError(f"backend {self.name!r} is not loaded")
        sender = self._transfer_end(self._kv_sender, "prefill")
        plan = None
        if request.kind == "chat" and self._template is not None:
            plan = plan_chat(request, self._template, self._chat_format)
        prompt_ids, _ = self._prompt(request, llm.engine.tokenizer, llm.engine.model_config.vocab_size, plan)
        params = self._engine_params(request.params, request.kind == "completion")
        self._counter += 1
        req_id = f"{request.request_id}-{request.choice_index}-prefill-{self._counter}"
        try:
            engine_request = llm.engine.make_prefill_request(
                req_id, prompt_ids, params, labels=request.labels, tenant=request.tenant,
                cache_salt=request.cache_salt,
            )
        except RequestTooLongError as exc:
            raise ContextLengthExceededError(exc.message, param=exc.param) from exc
        except InvalidParamError as exc:
            raise InvalidRequestError(exc.message, param=exc.param) from exc
        last = None
        stream = llm.generate(engine_request)
        try:
            async for out in stream:
                last = out
        except EngineDeadError as exc:
            raise BackendUnavailableError(f"backend {self.name!r}: {exc}") from exc
        finally:
            await stream.aclose()
        if last is None or last.prefilled is None:
            raise BackendError(f"backend {self.name!r}: the prefill ended without KV ({last and last.finish_reason})")
        try:
            await asyncio.to_thread(sender.send, transfer_id, last.prefilled)
        except KVTransferError as exc:
            raise BackendUnavailableError(f"backend {self.name!r}: {exc}") from exc
        yield GenerationChunk(
            token_ids=(last.prefilled.meta.first_token_id,),
            finish_reason="length",
            usage=Usage(prompt_tokens=last.num_prompt_tokens, completion_tokens=1, cached_tokens=last.num_cached_tokens),
        )

    async def _generate(
        self, request: GenerationRequest, plan: ChatPlan | None = None, prompt_ids: list[int] | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """The engine's chunks for ``request`` (``prompt_ids``: the prompt, when the caller
        made it: a resumed answer's)."""
        from core_engine.errors import EngineDeadError, InvalidParamError, RequestTooLongError

        llm = self._llm
        if llm is None:
            raise BackendUnavailableError(f"backend {self.name!r} is not loaded")
        params = request.params
        prompt_param = "messages" if request.kind == "chat" else "prompt"
        if prompt_ids is None:
            prompt_ids, prompt_text = self._prompt(request, llm.engine.tokenizer, llm.engine.model_config.vocab_size, plan)
        else:
            prompt_text = ""
        pins: tuple[tuple[int, float], ...] = ()
        if plan is not None and request.prefix_pins and self._template is not None:
            pins = tuple(
                (len(self._chat_ids(text, llm.engine.tokenizer)), ttl_s)
                for text, ttl_s in pinned_prefixes(request, self._template, self._chat_format)
            )
        engine_params = self._engine_params(
            params,
            request.kind == "completion",
            plan.structured_outputs if plan is not None else request.structured_outputs,
            plan.thinking if plan is not None else None,
            pins,
        )
        self._counter += 1
        req_id = f"{request.request_id}-{request.choice_index}-{self._counter}"
        want_logprobs = params.logprobs or params.top_logprobs > 0
        eog = llm.engine.eos_token_ids | frozenset(params.stop_token_ids)
        num_emitted = 0
        stream = None
        try:
            try:
                if engine_params.structured_outputs is None:
                    engine_request = llm.engine.make_request(
                        req_id, prompt_ids, engine_params, labels=request.labels, tenant=request.tenant,
                        cache_salt=request.cache_salt,
                    )
                else:  # compiling the constraint may take milliseconds: off the event loop
                    engine_request = await asyncio.to_thread(
                        llm.engine.make_request, req_id, prompt_ids, engine_params,
                        labels=request.labels, tenant=request.tenant, cache_salt=request.cache_salt,
                    )
            except RequestTooLongError as exc:
                raise ContextLengthExceededError(
                    exc.message, param=prompt_param if exc.param == "prompt" else exc.param
                ) from exc
            except InvalidParamError as exc:
                raise InvalidRequestError(
                    exc.message, param=prompt_param if exc.param == "prompt" else exc.param
                ) from exc
            prefilled = None
            if KV_DECODE_LABEL in request.labels:
                prefilled = await self._receive(request.labels[KV_DECODE_LABEL])
            stream = llm.generate(engine_request, prefilled=prefilled)
            async for out in stream:
                chunk_prompt_logprobs = None
                if out.prompt_logprobs is not None:
                    chunk_prompt_logprobs = self._prompt_logprobs(llm.engine.tokenizer, prompt_ids, out.prompt_logprobs)
                if num_emitted == 0 and params.echo and request.kind == "completion":
                    if engine_params.prompt_logprobs is not None and chunk_prompt_logprobs is None:
                        continue  # prompt logprobs arrive once the whole prompt is prefilled
                    yield GenerationChunk(prompt_text=prompt_text, prompt_logprobs=chunk_prompt_logprobs)
                    num_emitted += 1
                token_ids = list(out.new_token_ids)
                self.num_generated_tokens += len(token_ids)
                logprobs = list(out.logprobs or ())
                # The terminating EOS / stop token is not part of the completion (as llama.cpp).
                if out.finished and out.finish_reason == "stop" and token_ids and token_ids[-1] in eog:
                    if not isinstance(out.stop_reason, str):
                        token_ids.pop()
                        logprobs = logprobs[: len(token_ids)]
                if not (out.new_text or token_ids or out.finished):
                    continue
                entries = None
                if want_logprobs:
                    entries = tuple(self._logprob_entry(llm.engine.tokenizer, lp) for lp in logprobs)
                final = out.finished
                num_emitted += 1
                yield GenerationChunk(
                    text=out.new_text,
                    token_ids=tuple(token_ids),
                    logprobs=entries,
                    finish_reason=out.finish_reason if final else None,  # type: ignore[arg-type]
                    # The engine's stop_reason is the stop string or the stop token id.
                    stop_sequence=out.stop_reason if final and isinstance(out.stop_reason, str) else None,
                    usage=self._usage(out, eog) if final else None,
                    phases=_phases(out.metrics) if final and out.metrics is not None else None,
                    speculation=_speculation(out.speculation) if final else None,
                )
        except InfermuxError:
            raise
        except EngineDeadError as exc:
            raise BackendUnavailableError(f"backend {self.name!r}: {exc}") from exc
        except (InvalidParamError, RequestTooLongError) as exc:  # pragma: no cover - mapped above
            raise InvalidRequestError(exc.message, param=exc.param) from exc
        except Exception as exc:
            logger.exception("core engine generation failed")
            raise BackendError(f"core engine generation failed: {exc}") from exc
        finally:
            if stream is not None:
                await stream.aclose()  # aborts the engine request if it is still running

    async def _receive(self, transfer_id: str) -> Any:
        """The KV a prefill engine sent under ``transfer_id`` (a retryable error if it never
        comes whole: the caller prefills again)."""
        from core_engine.kv_transfer import KVTransferError

        receiver = self._transfer_end(self._kv_receiver, "decode")
        try:
            return await asyncio.to_thread(receiver.receive, transfer_id)
        except KVTransferError as exc:
            raise BackendUnavailableError(f"backend {self.name!r}: {exc}") from exc

    def _prompt(
        self, request: GenerationRequest, tokenizer: Any, vocab_size: int, plan: ChatPlan | None
    ) -> tuple[list[int], str]:
        if plan is not None:
            assert self._template is not None
            return self._chat_ids(plan.text, tokenizer), self._template.control_texts.text(plan.text)
        prompt = request.prompt
        if isinstance(prompt, tuple):
            bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param="prompt"
                )
            return list(prompt), tokenizer.decode(prompt, skip_special=False)
        # A raw prompt is the client's whole prompt, template included: its special-token
        # texts are parsed (as vLLM and llama.cpp do); chat content never is (_chat_ids).
        text = prompt or ""
        ids = tokenizer.encode(text, add_special=True, parse_special=True)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return ids, text

    def _chat_ids(self, text: str, tokenizer: Any) -> list[int]:
        """Token ids of a rendered chat (``text``: marked, :mod:`core_engine.chat.content_text`):
        the template's control tokens parsed, the content's control-token texts as text; BOS
        added unless the template wrote it."""
        assert self._template is not None
        return self._template.control_texts.encode(
            text,
            lambda piece, add_special, parse_special: tokenizer.encode(
                piece, add_special=add_special, parse_special=parse_special
            ),
            add_special=not (self._bos_text and text.startswith(self._bos_text)),
        )

    @staticmethod
    def _engine_params(
        params: WireParams,
        is_completion: bool,
        structured: dict[str, Any] | None = None,
        thinking: Any = None,
        pin_prefix: tuple[tuple[int, float], ...] = (),
    ) -> Any:
        from core_engine.errors import InvalidParamError
        from core_engine.sampling_params import SamplingParams
        from core_engine.structured import StructuredOutput

        want_logprobs = params.logprobs or params.top_logprobs > 0
        try:
            constraint = None if structured is None else StructuredOutput.from_request(structured)
            return SamplingParams(
                structured_outputs=constraint,
                thinking=thinking,
                pin_prefix=pin_prefix,
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k or None,
                min_p=params.min_p,
                seed=params.seed,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                repetition_penalty=params.repetition_penalty,
                stop=params.stop,
                stop_token_ids=params.stop_token_ids,
                ignore_eos=params.ignore_eos,
                logprobs=params.top_logprobs if want_logprobs else None,
                prompt_logprobs=params.top_logprobs if (want_logprobs and params.echo and is_completion) else None,
            )
        except InvalidParamError as exc:
            raise InvalidRequestError(exc.message, param=exc.param) from exc

    def _piece(self, tokenizer: Any, token_id: int) -> bytes:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = tokenizer.token_to_bytes(token_id, skip_special=False)
            self._pieces[token_id] = piece
        return piece

    def _logprob_entry(self, tokenizer: Any, record: Any, *, text_offset: int | None = None) -> TokenLogprob:
        piece = self._piece(tokenizer, record.token_id)
        return TokenLogprob(
            token=piece.decode("utf-8", errors="replace"),
            logprob=record.logprob,
            token_id=record.token_id,
            bytes=list(piece),
            top_logprobs=tuple(
                TopLogprob(
                    token=self._piece(tokenizer, t).decode("utf-8", errors="replace"),
                    logprob=lp,
                    token_id=t,
                    bytes=list(self._piece(tokenizer, t)),
                )
                for t, lp in record.top
            ),
            text_offset=text_offset,
        )

    def _prompt_logprobs(self, tokenizer: Any, prompt_ids: list[int], records: Any) -> tuple[TokenLogprob, ...]:
        entries = []
        offset = 0
        for token_id, record in zip(prompt_ids, records, strict=True):
            if record is None:
                piece = self._piece(tokenizer, token_id)
                entries.append(
                    TokenLogprob(
                        token=piece.decode("utf-8", errors="replace"), logprob=None, token_id=token_id,
                        bytes=list(piece), text_offset=offset,
                    )
                )
            else:
                entries.append(self._logprob_entry(tokenizer, record, text_offset=offset))
            offset += len(entries[-1].token)
        return tuple(entries)

    @staticmethod
    def _usage(out: Any, eog: frozenset[int]) -> Usage:
        completion = out.num_output_tokens
        if out.finish_reason == "stop" and not isinstance(out.stop_reason, str) and completion:
            completion -= 1  # the EOS / stop token that ended the request is not output
        return Usage(
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=completion,
            cached_tokens=out.num_cached_tokens,
            cached_tokens_by_tier=out.cached_tokens_by_tier,
        )


def _phases(metrics: Any) -> EnginePhases:
    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else max(0.0, b - a)

    return EnginePhases(
        queued_s=span(metrics.arrival_time, metrics.first_scheduled_time),
        prefill_s=span(metrics.first_scheduled_time, metrics.first_token_time),
        decode_s=span(metrics.first_token_time, metrics.finished_time),
    )


def _speculation(metrics: Any) -> SpeculationStats | None:
    if metrics is None:
        return None
    return SpeculationStats(
        method=metrics.method,
        num_drafts=metrics.num_drafts,
        num_draft_tokens=metrics.num_draft_tokens,
        num_accepted_tokens=metrics.num_accepted_tokens,
    )


def create_backend(config: BackendConfig) -> CoreEngineBackend:
    """Factory registered for kind ``"core_engine"``."""
    return CoreEngineBackend(config)

"""Engine policies: the decisions the engine asks for, and sensible defaults.

The engine owns the *mechanisms* (quantized weights and KV blocks, the device → host → disk
KV tiers, n-gram and draft-model speculation); a *policy* decides how to use them. Each
policy is a small Protocol with one method taking a frozen context Struct and answering a
frozen decision Struct, so that the engine can be used alone (``EnginePolicies()`` holds
the defaults below) and the gateway's plugins can supply their own (``plugins/policy.py``
adapts the hooks ``infermux_choose_quantization``, ``infermux_plan_kv_offload`` and
``infermux_choose_speculation`` to these Protocols).

When the engine consults each policy:

- :class:`QuantizationPolicy` once per model load, before weights are read: weight and KV
  cache dtypes. The engine raises if it cannot honour the answer.
- :class:`KVOffloadPolicy` once per scheduler step while a host (or disk) tier exists:
  which requests' KV blocks move down a tier, which come back (prefetch).
- :class:`SpeculationPolicy` per request and step while speculation is available: the
  method and how many tokens to propose.

Policies run on the engine's step path: they must be fast, synchronous and free of I/O.
This module imports nothing beyond msgspec (no torch), and nothing from the gateway.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Literal, Protocol, runtime_checkable

import msgspec

__all__ = [
    "AdaptiveSpeculationPolicy",
    "DefaultQuantizationPolicy",
    "EnginePolicies",
    "FixedSpeculationPolicy",
    "GuardedSpeculationPolicy",
    "KVCacheDType",
    "KVOffloadContext",
    "KVOffloadDecision",
    "KVOffloadPolicy",
    "KVResidency",
    "KVTier",
    "QuantizationContext",
    "QuantizationDecision",
    "QuantizationPolicy",
    "SpeculationContext",
    "SpeculationDecision",
    "SpeculationMethod",
    "SpeculationPolicy",
    "WatermarkOffloadPolicy",
    "WeightDType",
]

#: "auto": as the engine would pick (the compute dtype for dequantized GGUF weights).
WeightDType = Literal["auto", "bfloat16", "float16", "float32", "int8", "int4"]
#: "auto": the compute dtype. int8 / fp8 halve (or quarter) KV memory at some accuracy cost.
KVCacheDType = Literal["auto", "bfloat16", "float16", "float32", "int8", "fp8_e4m3", "fp8_e5m2"]
KVTier = Literal["device", "host", "disk"]
SpeculationMethod = Literal["ngram", "draft"]


# -- quantization -------------------------------------------------------------------------


class QuantizationDecision(msgspec.Struct, frozen=True, kw_only=True):
    """How to hold the weights and the KV cache of one model.

    ``weights`` is the format of every product ("auto": the fastest within the accuracy
    bound on this hardware; "bfloat16"/"float32": dense in that dtype; "float16": fp16
    weights). ``layer_weights`` names other formats for some products (product name or glob
    over ``layers.{i}.{qkv,o,gate_up,down}`` and ``head`` -> format), e.g. ``{"head": "int8",
    "layers.0.*": "float32"}``. ``weight_memory_bytes`` asks the engine to meet a budget for
    the resident weights with the least loss: it measures each layer's sensitivity at load
    and keeps the most sensitive layers dense while they fit.
    """

    weights: WeightDType = "auto"
    kv_cache: KVCacheDType = "auto"
    layer_weights: dict[str, WeightDType] | None = None
    weight_memory_bytes: int | None = None


class QuantizationContext(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine knows about a model it is about to load."""

    #: The backend's name in the gateway config, else the file stem.
    model_name: str
    model_path: str
    #: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
    device: str
    #: Weight type of the file ("Q4_1", "F16", "BF16"...) when known.
    file_type: str | None = None
    num_params: int | None = None
    #: Memory the device has free for weights and KV (bytes) when known.
    device_memory_bytes: int | None = None
    max_model_len: int | None = None
    #: What the engine's configuration asks for (backend options ``weight_format`` and
    #: ``kv_cache_dtype``); the default policy answers it unchanged.
    requested: QuantizationDecision = QuantizationDecision()


@runtime_checkable
class QuantizationPolicy(Protocol):
    """Chooses weight and KV cache dtypes at model load."""

    def choose_quantization(self, context: QuantizationContext) -> QuantizationDecision:
        """The dtypes for the model in ``context`` (called once per load)."""
        ...


class DefaultQuantizationPolicy:
    """What the engine's configuration asks for (``context.requested``: "auto" unless the
    backend options name dtypes), unless the model's name has an explicit override."""

    def __init__(self, overrides: Mapping[str, QuantizationDecision] | None = None) -> None:
        self.overrides = dict(overrides or {})

    def choose_quantization(self, context: QuantizationContext) -> QuantizationDecision:
        return self.overrides.get(context.model_name, context.requested)


# -- KV offload ---------------------------------------------------------------------------


class KVResidency(msgspec.Struct, frozen=True, kw_only=True):
    """Where one request's KV blocks are and how the scheduler sees the request.

    A waiting request's blocks are its prompt's cached prefix; when they are spread over
    several tiers the request appears once per tier.
    """

    req_id: str
    status: Literal["running", "waiting", "preempted"]
    tier: KVTier
    num_blocks: int
    #: Scheduler steps since the request last ran (0 for running requests).
    num_idle_steps: int = 0
    #: Position in the waiting queue (0 = next to be scheduled); None when not waiting.
    queue_position: int | None = None


class KVOffloadContext(msgspec.Struct, frozen=True, kw_only=True):
    """The KV memory picture at the start of one scheduler step."""

    num_device_blocks: int
    #: Device blocks that hold nothing (neither referenced nor a cached prefix): handing
    #: one out evicts nothing.
    num_free_device_blocks: int
    #: Free blocks in the host tier (pinned CPU memory); 0 when there is none.
    num_free_host_blocks: int = 0
    #: Free blocks on disk; None when there is no disk tier.
    num_free_disk_blocks: int | None = None
    requests: tuple[KVResidency, ...] = ()


class KVOffloadDecision(msgspec.Struct, frozen=True, kw_only=True):
    """Moves for this step. Unknown or impossible ids are ignored by the engine."""

    #: Requests whose device blocks move to ``offload_tier`` (never a running request).
    offload: tuple[str, ...] = ()
    offload_tier: Literal["host", "disk"] = "host"
    #: Requests whose offloaded blocks are copied back to the device ahead of their turn.
    prefetch: tuple[str, ...] = ()


@runtime_checkable
class KVOffloadPolicy(Protocol):
    """Decides what leaves device memory and what is brought back early."""

    def plan_kv_offload(self, context: KVOffloadContext) -> KVOffloadDecision:
        """The moves for one scheduler step (called once per step while tiers exist)."""
        ...


class WatermarkOffloadPolicy:
    """Keep device memory between two watermarks.

    Below ``low_watermark`` (a fraction of device blocks blank), offload the cached device
    blocks of idle non-running requests (preempted ones, and waiting ones past the first
    ``prefetch_depth`` in the queue), longest idle first, until ``high_watermark`` would be
    blank again or the host tier is full. With room above ``high_watermark``, prefetch up to
    ``prefetch_depth`` waiting requests whose prefix is in a lower tier, next in the queue
    first, so that they find their KV on the device when scheduled.
    """

    def __init__(
        self, *, low_watermark: float = 0.05, high_watermark: float = 0.2, prefetch_depth: int = 2
    ) -> None:
        if not 0.0 <= low_watermark <= high_watermark <= 1.0:
            raise ValueError(
                "kv_offload: need 0 <= low_watermark <= high_watermark <= 1, got "
                f"{low_watermark} and {high_watermark}"
            )
        if prefetch_depth < 0:
            raise ValueError(f"kv_offload.prefetch_depth must be >= 0, got {prefetch_depth}")
        self.low_watermark = low_watermark
        self.high_watermark = high_watermark
        self.prefetch_depth = prefetch_depth

    def plan_kv_offload(self, context: KVOffloadContext) -> KVOffloadDecision:
        total = context.num_device_blocks
        free = context.num_free_device_blocks
        low = math.ceil(self.low_watermark * total)
        high = math.ceil(self.high_watermark * total)
        offload: list[str] = []
        if free < low:
            host_room = context.num_free_host_blocks
            # Not the requests about to run: they would only pay the way back up.
            idle = sorted(
                (
                    r
                    for r in context.requests
                    if r.tier == "device"
                    and r.status != "running"
                    and (r.queue_position is None or r.queue_position >= self.prefetch_depth)
                ),
                key=lambda r: -r.num_idle_steps,
            )
            for residency in idle:
                if free >= high:
                    break
                if residency.num_blocks > host_room:
                    continue
                offload.append(residency.req_id)
                free += residency.num_blocks
                host_room -= residency.num_blocks
        prefetch: list[str] = []
        if not offload:
            queued = sorted(
                (
                    r
                    for r in context.requests
                    if r.tier != "device" and r.status == "waiting" and r.queue_position is not None
                ),
                key=lambda r: r.queue_position or 0,
            )
            for residency in queued[: self.prefetch_depth]:
                if free - residency.num_blocks < high:
                    break
                prefetch.append(residency.req_id)
                free -= residency.num_blocks
        return KVOffloadDecision(offload=tuple(offload), prefetch=tuple(prefetch))


# -- speculative decoding -----------------------------------------------------------------


class SpeculationContext(msgspec.Struct, frozen=True, kw_only=True):
    """One request at one step, as far as speculation is concerned."""

    req_id: str
    #: Methods the engine has loaded ("ngram" needs nothing; "draft" needs a draft model).
    methods: tuple[SpeculationMethod, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    temperature: float = 1.0
    #: Requests in this step's batch (speculation pays off at small batches).
    num_running: int = 1
    #: Tokens proposed and accepted for this request so far.
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    #: The request's labels (``GenerationRequest.labels``) when the engine has them.
    labels: Mapping[str, str] = {}
    #: The tenant the gateway resolved for the request (``GenerationRequest.tenant``).
    tenant: str | None = None

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed so far; None before anything was proposed."""
        if self.num_proposed_tokens == 0:
            return None
        return self.num_accepted_tokens / self.num_proposed_tokens


class SpeculationDecision(msgspec.Struct, frozen=True, kw_only=True):
    """``method`` None (or ``num_speculative_tokens`` 0): decode normally this step."""

    method: SpeculationMethod | None = None
    num_speculative_tokens: int = 0


@runtime_checkable
class SpeculationPolicy(Protocol):
    """Chooses the speculation method and the number of proposed tokens per request."""

    def choose_speculation(self, context: SpeculationContext) -> SpeculationDecision:
        """The decision for this request at this step."""
        ...


class AdaptiveSpeculationPolicy:
    """Speculate at small batches, with a proposal length that follows the acceptance rate.

    Prefers a draft model over n-gram lookup when both exist. Before ``warmup_tokens`` were
    proposed it uses half of ``max_tokens``; then ``k`` grows with the acceptance rate, and
    speculation stops for a request whose rate fell below ``min_acceptance`` (its proposals
    cost more verification than they save).

    Batch size: in the core engine a decode step is memory-bound (its cost barely grows with
    the rows it scores: 101 ms for 1 + 8 rows against 97.5 ms for one on the dev CPU) until
    the batch's rows reach ``batch_tokens``; past that, each proposed row costs compute.
    (llama.cpp's CPU kernels grow almost linearly with rows, so there a rejected proposal
    costs more; the acceptance cut-off is what protects it.) So ``k`` is also capped at ``batch_tokens // num_running - 1``, which shrinks
    smoothly as the batch grows (16 tokens at 1 stream, 3 at 8, 1 at 15 with the defaults)
    instead of falling off a cliff at one batch size, and is 0 from ``max_batch`` running
    requests on (off: the engine then proposes nothing and verifies nothing).
    """

    def __init__(
        self,
        *,
        max_tokens: int = 16,
        min_acceptance: float = 0.3,
        max_batch: int = 16,
        warmup_tokens: int = 16,
        batch_tokens: int = 32,
    ) -> None:
        if max_tokens < 0:
            raise ValueError(f"speculation.max_tokens must be >= 0, got {max_tokens}")
        if not 0.0 <= min_acceptance <= 1.0:
            raise ValueError(f"speculation.min_acceptance must be in [0, 1], got {min_acceptance}")
        self.max_tokens = max_tokens
        self.min_acceptance = min_acceptance
        self.max_batch = max_batch
        self.warmup_tokens = warmup_tokens
        self.batch_tokens = batch_tokens

    def choose_speculation(self, context: SpeculationContext) -> SpeculationDecision:
        room = self.batch_tokens // max(1, context.num_running) - 1
        if not context.methods or self.max_tokens == 0 or context.num_running >= self.max_batch or room < 1:
            return SpeculationDecision()
        method: SpeculationMethod = "draft" if "draft" in context.methods else context.methods[0]
        rate = context.acceptance_rate
        if rate is None or context.num_proposed_tokens < self.warmup_tokens:
            k = max(1, self.max_tokens // 2)
        elif rate < self.min_acceptance:
            return SpeculationDecision()
        else:
            k = max(1, min(self.max_tokens, round(self.max_tokens * rate)))
        return SpeculationDecision(method=method, num_speculative_tokens=min(k, room))


class FixedSpeculationPolicy:
    """Always ``num_tokens`` with ``method`` (or the first method loaded), at any batch size.

    For measurements and exactness tests; serving wants :class:`AdaptiveSpeculationPolicy`.
    """

    def __init__(self, num_tokens: int, method: SpeculationMethod | None = None) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self.num_tokens = num_tokens
        self.method = method

    def choose_speculation(self, context: SpeculationContext) -> SpeculationDecision:
        method = self.method if self.method is not None else (context.methods[0] if context.methods else None)
        if method is None or method not in context.methods:
            return SpeculationDecision()
        return SpeculationDecision(method=method, num_speculative_tokens=self.num_tokens)


class GuardedSpeculationPolicy:
    """``policy``, except that an exception or an answer that is not a
    :class:`SpeculationDecision` is logged once (per ``use``) and
    :class:`AdaptiveSpeculationPolicy` answers: a broken policy cannot stop an engine loop."""

    def __init__(self, policy: SpeculationPolicy, *, owner: str = "engine") -> None:
        self.policy = policy
        self._owner = owner
        self._fallback = AdaptiveSpeculationPolicy()
        self._warned = False

    def use(self, policy: SpeculationPolicy) -> None:
        """Ask ``policy`` from now on (its failure is logged once again)."""
        self.policy = policy
        self._warned = False

    def choose_speculation(self, context: SpeculationContext) -> SpeculationDecision:
        try:
            decision = self.policy.choose_speculation(context)
            if isinstance(decision, SpeculationDecision):
                return decision
            raise TypeError(f"answered {type(decision).__name__}, not a SpeculationDecision")
        except Exception:
            if not self._warned:
                self._warned = True
                logging.getLogger(__name__).warning(
                    "%s: the speculation policy failed; AdaptiveSpeculationPolicy decides instead",
                    self._owner,
                    exc_info=True,
                )
        return self._fallback.choose_speculation(context)


# -- the bundle the engine receives ---------------------------------------------------------


class EnginePolicies(msgspec.Struct, frozen=True, kw_only=True):
    """The three policies an engine consults; the defaults need no plugins."""

    quantization: QuantizationPolicy = msgspec.field(default_factory=DefaultQuantizationPolicy)
    kv_offload: KVOffloadPolicy = msgspec.field(default_factory=WatermarkOffloadPolicy)
    speculation: SpeculationPolicy = msgspec.field(default_factory=AdaptiveSpeculationPolicy)

"""One generation request as the engine tracks it (vLLM's ``Request`` / nano-vllm's ``Sequence``).

The scheduler moves a request ``WAITING -> RUNNING -> FINISHED_*``; preemption sends it back to
the front of the queue as ``PREEMPTED`` with its KV blocks freed and ``num_computed_tokens``
reset (recompute: prompt plus the tokens generated so far are prefilled again; with the
prefix cache most of them are usually still cached).
"""

from __future__ import annotations

import enum
import time
from typing import Any

from core_engine.sampling_params import SamplingParams

__all__ = ["FinishReason", "Request", "RequestStatus"]


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Everything at or above ``FINISHED_STOPPED`` is final."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


FinishReason = str  # "stop" | "length" | "abort"

_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Token-level state of one request: what is known, what is computed, what is cached.

    ``all_token_ids`` is prompt + output. ``num_computed_tokens`` of them have K/V in the cache
    (prefix-cache hits count as computed). ``num_cached_tokens`` is how many prompt tokens the
    prefix cache supplied at first scheduling (reported as ``cached_tokens`` in usage).
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        labels: dict[str, str] | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        #: Resolved limit (``sampling_params.max_tokens`` capped by the context window).
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        #: The stop token id or stop string that ended the request, if any.
        self.stop_reason: int | str | None = None
        #: Per-request ``torch.Generator`` for seeded sampling (set by the engine).
        self.generator: Any = None
        #: The llguidance matcher of a constrained request (``SamplingParams.structured_outputs``).
        self.matcher: Any = None
        #: The thinking budget (``SamplingParams.thinking``), a
        #: :class:`~core_engine.chat.budget.ThinkingBudget`; its constraint waits for it.
        self.thinking: Any = None
        #: Chained hashes of the full blocks of ``all_token_ids`` (the prefix cache's keys).
        self.block_hashes: list[bytes] = []
        #: KV tiers: cached prompt tokens by the tier they came from ("device", "host",
        #: "disk"; set at first admission), and whether the disk blocks of its prefix were
        #: read already (a request waits for one disk read at most).
        self.cached_tokens_by_tier: dict[str, int] | None = None
        self.kv_disk_read = False
        #: Logprob records waiting to be emitted (filled by the scheduler, drained by the engine).
        self.pending_logprobs: list[Any] = []
        self.prompt_logprobs: list[Any] = []
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        #: What the policies see of the request's origin (labels; the tenant also keys the
        #: KV cache quota).
        self.labels: dict[str, str] = dict(labels or {})
        self.tenant = tenant
        #: The prefix-cache partition (``GenerationRequest.cache_salt``): it salts the first
        #: block's hash, so this request hits only prefixes computed under the same salt
        #: (None: the one unsalted partition).
        self.cache_salt = cache_salt
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        #: Speculative decoding: this step's proposed tokens (after the last sampled one), the
        #: draft's probabilities for them when it sampled (k, vocab) (None: point-mass proposals),
        #: the method that proposed them, and the request's totals so far.
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: Any = None
        self.spec_method: str | None = None
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        #: Prefill only (disaggregated serving): the request stops after its first token and
        #: the engine exports its prompt's KV blocks (:mod:`core_engine.kv_transfer`).
        self.kv_export = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    @property
    def active_matcher(self) -> Any:
        """The constraint's matcher once it applies (after a thinking block), else None."""
        if self.matcher is None or (self.thinking is not None and not self.thinking.is_done):
            return None
        return self.matcher

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.thinking is not None:
            self.thinking.observe(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Set a ``FINISHED_*`` status if the last token ends the request; True if it did."""
        token_id = self.output_token_ids[-1]
        if not self.sampling_params.ignore_eos and token_id in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif token_id in self.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = token_id
        elif self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
        else:
            return False
        return True

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

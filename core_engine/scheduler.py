"""Continuous batching with chunked prefill, recompute preemption and speculative decodes.

Each :meth:`Scheduler.schedule` call builds one step under a token budget
(``max_num_batched_tokens``): running requests first (decodes take one token each, an
unfinished prefill takes the next chunk), then waiting requests in arrival order, their prompt
cut into chunks so that a long prompt never stalls the running decodes. When the KV pool cannot
grow a running request, the newest running request is preempted (blocks freed, recomputed later)
instead of failing. A decode whose request carries proposed tokens (``Request.spec_token_ids``,
set by :mod:`core_engine.spec_decode` before the step) takes ``1 + k`` tokens of the budget and
lookahead KV slots; when the budget or the pool is short its proposal shrinks or goes before
anyone is preempted. :meth:`Scheduler.update_from_output` appends the sampled tokens (several
for a verified proposal) one at a time through the token-level stop rules, gives the rejected
proposals' blocks back, and frees finished requests.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from core_engine.kv_cache_manager import KVCacheManager
from core_engine.request import Request, RequestStatus

__all__ = ["ModelRunnerOutput", "ScheduledRequest", "Scheduler", "SchedulerOutput"]


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    #: Tokens already in the KV cache before this step (the chunk's first position).
    num_computed_tokens: int
    #: Tokens fed this step (1 for a decode, a chunk for a prefill).
    num_new_tokens: int
    #: The request's whole block table after allocation.
    block_ids: list[int]
    #: True when this chunk reaches the last known token, so a new token is sampled.
    sample: bool
    #: Proposed tokens fed after the last known one (speculative decoding; counted in
    #: ``num_new_tokens``): the runner verifies them and samples up to ``len + 1`` tokens.
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """What the model runner executes this step."""

    #: Decodes first (one token each), then prefill chunks.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    #: Sum of ``num_new_tokens`` (never above the token budget).
    total_num_scheduled_tokens: int = 0
    #: Requests preempted while building this step (blocks already freed).
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    """What the model runner returns, aligned with ``SchedulerOutput.scheduled``."""

    #: Sampled token per scheduled request (None where ``sample`` was False).
    sampled_token_ids: list[int | None]
    #: Per request: a logprob record for the sampled token (None when not asked for).
    logprobs: list[object | None] | None = None
    #: Per request: prompt logprob records computed this step (None when not asked for).
    prompt_logprobs: list[list[object] | None] | None = None
    #: Speculative items (index into ``scheduled``): every token the verification emitted,
    #: in order (accepted proposals, then the target's own token), and their logprob records
    #: (None when not asked for). ``sampled_token_ids`` is None at those indices.
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[int, list[Any]] = field(default_factory=dict)


class Scheduler:
    """Owns the ``waiting`` queue and the ``running`` list; talks to the KV-cache manager."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int = 2048,
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: Total preemptions so far (metrics, tests).
        self.num_preemptions = 0
        #: Prompt tokens of admitted requests, and how many of them the prefix cache served
        #: (counted once per request, at first admission; metrics).
        self.num_prompt_tokens_admitted = 0
        self.num_prompt_tokens_cached = 0
        #: Called with each request whose KV blocks were freed (finish, abort, preemption):
        #: the draft model frees its own blocks for it.
        self.release_listeners: list[Callable[[Request], None]] = []
        #: Called with each request that finished (or was aborted) while it still holds its
        #: KV blocks: a prefill-only request's blocks are exported there
        #: (:mod:`core_engine.kv_transfer`).
        self.finish_listeners: list[Callable[[Request], None]] = []
        #: The KV tiers below the device pool (:class:`~core_engine.kv_offload.tiers.KVTiers`),
        #: consulted for prefix hits the device pool lacks; None: device only.
        self.tiers: Any = None
        #: Speculative decoding totals (vLLM's spec_decode counters), and accepted tokens by
        #: position in the proposal (index 0: the first proposed token).
        self.num_spec_drafts = 0
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0
        self.num_spec_accepted_per_pos: list[int] = []

    # -- queue management ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, or stop on a stop string) requests now and free their blocks."""
        assert status.is_finished
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def _free_request(self, request: Request) -> None:
        request.finished_time = time.monotonic()
        for listener in self.finish_listeners:
            listener(request)
        for num_tokens, ttl_s in request.sampling_params.pin_prefix:
            self.kv_cache_manager.pin_prefix(request, num_tokens, ttl_s, request.finished_time)
        self.kv_cache_manager.free(request)
        request.spec_token_ids = []
        del self.requests[request.req_id]
        for listener in self.release_listeners:
            listener(request)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.spec_token_ids = []
        for listener in self.release_listeners:
            listener(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts and allocate their KV slots."""
        self.kv_cache_manager.expire_pins(time.monotonic())
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        kv = self.kv_cache_manager

        # 1. Running requests, oldest first; preempt from the newest end when the pool is short.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request with nothing to compute: {request}"
            if request.spec_token_ids:
                # A proposal rides on a decode only, within the budget, and only where the
                # pool has room without preempting anyone.
                num_spec = min(len(request.spec_token_ids), budget - 1) if num_new == 1 else 0
                if num_spec and kv.allocate_slots(request, 1, num_lookahead_tokens=num_spec) is not None:
                    del request.spec_token_ids[num_spec:]
                    self._append(request, 1, decodes, prefills)
                    budget -= 1 + num_spec
                    i += 1
                    continue
                request.spec_token_ids = []
            while kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.req_id)
                if victim is request:
                    break
            else:
                self._append(request, num_new, decodes, prefills)
                budget -= num_new
                i += 1
                continue
            break  # the current request was itself preempted: nothing behind it remains

        # 2. Waiting requests in order, unless this step already had to preempt. A request
        #    whose cached prefix is being read from disk stays in its place; those behind it go.
        index = 0
        while (
            index < len(self.waiting)
            and budget > 0
            and not out.preempted_req_ids
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[index]
            computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            if self.tiers is not None:
                found = self.tiers.extend_hits(request, computed_blocks)
                if found is None:
                    index += 1
                    continue
                computed_blocks, num_hit_tokens = found
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if kv.allocate_slots(request, num_new, computed_blocks) is None:
                break  # wait for blocks to be freed
            del self.waiting[index]
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.monotonic()
                self.num_prompt_tokens_admitted += request.num_prompt_tokens
                self.num_prompt_tokens_cached += num_hit_tokens
                if self.tiers is not None:
                    self.tiers.note_admitted(request, computed_blocks)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._append(request, num_new, decodes, prefills)
            budget -= num_new

        out.scheduled = decodes + prefills
        out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        return out

    def _append(
        self,
        request: Request,
        num_new: int,
        decodes: list[ScheduledRequest],
        prefills: list[ScheduledRequest],
    ) -> None:
        start = request.num_computed_tokens
        spec = list(request.spec_token_ids) if num_new == 1 else []
        item = ScheduledRequest(
            request=request,
            num_computed_tokens=start,
            num_new_tokens=num_new + len(spec),
            block_ids=self.kv_cache_manager.get_block_ids(request.req_id),
            sample=start + num_new == request.num_tokens,
            spec_token_ids=spec,
        )
        (decodes if num_new == 1 and start > 0 else prefills).append(item)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens, stop and free finished requests.

        Returns the requests that produced something this step (a token, prompt logprobs, or
        a finish), in scheduling order.
        """
        now = time.monotonic()
        updated: list[Request] = []
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        for idx, item in enumerate(scheduler_output.scheduled):
            request = item.request
            if request.is_finished:  # finished by the caller between schedule and update
                continue
            if item.spec_token_ids:
                self._apply_verified(request, item, runner_output.spec_token_ids[idx],
                                     runner_output.spec_logprobs.get(idx), now)
                updated.append(request)
                continue
            request.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens
            produced = False
            computed = prompt_logprobs[idx] if prompt_logprobs is not None else None
            if computed is not None:
                request.prompt_logprobs.extend(computed)
                produced = True
            token_id = runner_output.sampled_token_ids[idx]
            if token_id is not None:
                request.append_output_token(token_id)
                if request.first_token_time is None:
                    request.first_token_time = now
                if logprobs is not None and logprobs[idx] is not None:
                    request.pending_logprobs.append(logprobs[idx])
                produced = True
                if request.check_stop(self.max_model_len):
                    self.running.remove(request)
                    self._free_request(request)
            if produced:
                updated.append(request)
        return updated

    def _apply_verified(
        self, request: Request, item: ScheduledRequest, tokens: list[int], logprobs: list[Any] | None, now: float
    ) -> None:
        """Append a verified proposal's tokens one at a time, as plain decoding would have."""
        num_proposed = len(item.spec_token_ids)
        num_accepted = len(tokens) - 1
        request.spec_token_ids = []
        request.spec_draft_probs = None
        request.num_drafts += 1
        request.num_draft_tokens += num_proposed
        request.num_accepted_tokens += num_accepted
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += num_proposed
        self.num_spec_accepted_tokens += num_accepted
        per_pos = self.num_spec_accepted_per_pos
        per_pos.extend([0] * (num_accepted - len(per_pos)))
        for pos in range(num_accepted):
            per_pos[pos] += 1
        # The last known token and the accepted proposals now have valid K/V.
        request.num_computed_tokens = item.num_computed_tokens + 1 + num_accepted
        if request.first_token_time is None:
            request.first_token_time = now
        for j, token_id in enumerate(tokens):
            request.append_output_token(token_id)
            if logprobs is not None:
                request.pending_logprobs.append(logprobs[j])
            if request.check_stop(self.max_model_len):
                self.running.remove(request)
                self._free_request(request)
                return
        # The rejected proposals' slots: blocks past the known tokens go back to the pool.
        self.kv_cache_manager.trim(request, request.num_tokens)

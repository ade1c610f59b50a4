"""The engine's speculation step: ask the policy, run the proposers, hand tokens to the scheduler.

Called by :meth:`~core_engine.llm_engine.LLMEngine.step` before scheduling. For every running
request that is decoding (its last sampled token is the only one without K/V), the
:class:`~core_engine.policy.SpeculationPolicy` is asked — per request, per step, with the
batch size and the request's acceptance so far — for a method and a ``k``. ``k`` is clipped to
``max_proposal`` and to what the request may still emit (``max_tokens``, the context window),
and the proposers run batched: one n-gram lookup over all n-gram requests, one set of draft
forwards over all draft requests. Their tokens go to ``Request.spec_token_ids``; the scheduler
fits them into the step and the model runner verifies them in the same forward as everyone
else's decode. A policy that raises or answers nonsense is logged once and the built-in
:class:`~core_engine.policy.AdaptiveSpeculationPolicy` decides instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core_engine.policy import (
    AdaptiveSpeculationPolicy,
    GuardedSpeculationPolicy,
    SpeculationContext,
    SpeculationMethod,
    SpeculationPolicy,
)
from core_engine.spec_decode.draft import DraftProposer
from core_engine.spec_decode.ngram import NgramProposer

__all__ = ["Speculator"]


class Speculator:
    """Proposals for one engine step; see the module docstring."""

    def __init__(
        self,
        *,
        methods: Sequence[SpeculationMethod],
        max_proposal: int,
        max_model_len: int,
        policy: SpeculationPolicy | None = None,
        ngram: NgramProposer | None = None,
        draft: DraftProposer | None = None,
    ) -> None:
        self.methods: tuple[SpeculationMethod, ...] = tuple(methods)
        self.max_proposal = max_proposal
        self.max_model_len = max_model_len
        self._policy = GuardedSpeculationPolicy(policy or AdaptiveSpeculationPolicy())
        self.ngram = ngram
        self.draft = draft
        #: Requests asked about and requests given a proposal, since start.
        self.num_decisions = 0
        self.num_proposals = 0

    @property
    def policy(self) -> SpeculationPolicy:
        return self._policy.policy

    @policy.setter
    def policy(self, policy: SpeculationPolicy) -> None:
        self._policy.use(policy)

    def release(self, request: Any) -> None:
        """The request's KV is gone (finished, aborted, preempted)."""
        if self.ngram is not None and request.is_finished:
            self.ngram.release(request)
        if self.draft is not None:
            self.draft.release(request)

    def propose(self, running: Sequence[Any]) -> None:
        """Set ``spec_token_ids`` on the decoding requests of ``running`` that speculate now."""
        num_running = len(running)
        chosen: dict[str, tuple[list[Any], list[int]]] = {"ngram": ([], []), "draft": ([], [])}
        for request in running:
            request.spec_token_ids = []
            request.spec_draft_probs = None
            if request.num_computed_tokens != request.num_tokens - 1 or not request.output_token_ids:
                continue  # still reading its prompt
            if request.matcher is not None:
                continue  # constrained: proposals would need a mask per position
            if request.thinking is not None and not request.thinking.is_done:
                continue  # a budget may force the next token
            room = min(request.max_tokens - request.num_output_tokens - 1, self.max_model_len - request.num_tokens - 1)
            if room < 1:
                continue
            params = request.sampling_params
            decision = self._policy.choose_speculation(
                SpeculationContext(
                    req_id=request.req_id,
                    methods=self.methods,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_output_tokens=request.num_output_tokens,
                    temperature=params.temperature,
                    num_running=num_running,
                    num_proposed_tokens=request.num_draft_tokens,
                    num_accepted_tokens=request.num_accepted_tokens,
                    labels=request.labels,
                    tenant=request.tenant,
                )
            )
            self.num_decisions += 1
            k = min(decision.num_speculative_tokens, self.max_proposal, room)
            if decision.method not in self.methods or k < 1:
                continue
            bucket = chosen[decision.method]
            bucket[0].append(request)
            bucket[1].append(k)
        requests, ks = chosen["ngram"]
        if requests and self.ngram is not None:
            for request, tokens in zip(requests, self.ngram.propose(requests, ks), strict=True):
                self._set(request, tokens, None, "ngram")
        requests, ks = chosen["draft"]
        if requests and self.draft is not None:
            for request, (tokens, q) in zip(requests, self.draft.propose(requests, ks), strict=True):
                self._set(request, tokens, q, "draft")

    def _set(self, request: Any, tokens: list[int], q: Any, method: str) -> None:
        if not tokens:
            return
        request.spec_token_ids = tokens
        request.spec_draft_probs = q
        request.spec_method = method
        self.num_proposals += 1

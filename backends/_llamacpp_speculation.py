"""N-gram (prompt-lookup) proposals for the llama.cpp runner, one proposer per sequence.

A :class:`NgramProposer` holds a sequence's tokens so far (prompt, then every emitted
token) in a preallocated ``np.intc`` buffer and asks llama-cpp-python's own
:class:`~llama_cpp.llama_speculative.LlamaPromptLookupDecoding` for a continuation: the
longest suffix of up to ``ngram_size`` tokens that occurred before, and the tokens that
followed its first occurrence (at most ``k``). The runner verifies them
(:mod:`backends._llamacpp_loop`) and reports back how many were accepted; the counters
become the request's :class:`~backends.base.SpeculationStats`.

:func:`choose` asks the speculation policy for one sequence's decision at one step. A
policy that raises (or answers something else than a ``SpeculationDecision``) is logged
once per runner and :class:`~core_engine.policy.AdaptiveSpeculationPolicy` answers
instead, so a broken policy cannot stop the loop.
"""

from __future__ import annotations

import numpy as np
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from backends.base import SpeculationStats
from core_engine.policy import (
    GuardedSpeculationPolicy,
    SpeculationContext,
    SpeculationMethod,
    SpeculationPolicy,
)

__all__ = ["METHODS", "NgramProposer", "SpeculationChooser"]

#: The methods this backend can run (a draft model is not one of them).
METHODS: tuple[SpeculationMethod, ...] = ("ngram",)


class NgramProposer:
    """Prompt-lookup proposals for one sequence, and its speculation counters."""

    def __init__(self, prompt: list[int], *, capacity: int, ngram_size: int) -> None:
        self._lookup = LlamaPromptLookupDecoding(max_ngram_size=ngram_size)
        self._ids = np.empty(max(capacity, len(prompt)) + 1, dtype=np.intc)
        self._ids[: len(prompt)] = prompt
        self._length = len(prompt)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def push(self, token: int) -> None:
        """An emitted token: it is part of what the next lookup searches."""
        if self._length == len(self._ids):  # a sequence at n_ctx emits no more; defensive
            self._ids = np.concatenate([self._ids, np.empty(len(self._ids), dtype=np.intc)])
        self._ids[self._length] = token
        self._length += 1

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that may follow the tokens so far (none when nothing matches)."""
        if k <= 0:
            return []
        found = self._lookup.find_candidate_pred_tokens(
            self._ids[: self._length], self._lookup.max_ngram_size, k
        )
        return found.tolist()

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified draft of ``num_draft_tokens`` tokens, ``num_accepted`` of them kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted

    def stats(self) -> SpeculationStats:
        return SpeculationStats(
            method="ngram" if self.num_drafts else None,
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
        )


class SpeculationChooser:
    """Asks ``policy`` for a sequence's proposal length at one step; see the module."""

    def __init__(self, policy: SpeculationPolicy, *, max_proposal: int, name: str) -> None:
        self._policy = GuardedSpeculationPolicy(policy, owner=f"backend {name}")
        self.max_proposal = max_proposal

    @property
    def policy(self) -> SpeculationPolicy:
        return self._policy.policy

    def use_policy(self, policy: SpeculationPolicy) -> None:
        """Ask ``policy`` from now on (a failure of it is logged once again)."""
        self._policy.use(policy)

    def choose(self, context: SpeculationContext) -> int:
        """How many n-gram tokens to propose (0: decode plainly this step)."""
        decision = self._policy.choose_speculation(context)
        if decision.method != "ngram":  # None, or a method this backend does not run
            return 0
        return max(0, min(decision.num_speculative_tokens, self.max_proposal))

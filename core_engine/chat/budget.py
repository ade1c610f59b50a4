"""A thinking budget: after ``budget`` tokens of reasoning, the end marker is forced.

The engines (the core engine's model runner, the llama.cpp backend's sampling loop) ask
:meth:`ThinkingBudget.forced_token` before committing each sampled token of a request and
report every committed token to :meth:`observe`. Markers are matched on the output's bytes,
not on token ids, so a model that spells ``</think>`` in several tokens is still seen closing
its block. The answer follows the forced marker as the model continues (vLLM's
``thinking_token_budget`` and llama-server's ``reasoning_budget`` do the same).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

__all__ = ["ThinkingBudget", "ThinkingParams"]


class ThinkingParams(msgspec.Struct, frozen=True, kw_only=True):
    """What a request's thinking budget needs (``SamplingParams.thinking``)."""

    start: str
    end: str
    #: Reasoning tokens allowed before the end marker is forced (>= 0).
    budget: int
    #: The rendered prompt opened the block: the output starts inside it.
    open_at_start: bool = False


class ThinkingBudget:
    """Per-request state: in the block or not, tokens spent, tokens still to force."""

    def __init__(
        self, params: ThinkingParams, end_token_ids: Sequence[int], token_bytes: Callable[[int], bytes]
    ) -> None:
        self.params = params
        self._start = params.start.encode()
        self._end = params.end.encode()
        self._end_ids = list(end_token_ids)
        self._token_bytes = token_bytes
        self._tail = b""
        self.in_reasoning = params.open_at_start
        #: The block closed (or the output began with something else): constraints apply now.
        self.is_done = False
        self.num_reasoning_tokens = 0
        self._forcing: list[int] = []
        if self.in_reasoning and params.budget == 0:
            self._forcing = list(self._end_ids)

    def forced_token(self) -> int | None:
        """The token the next step must produce instead of sampling, or None."""
        return self._forcing[0] if self._forcing else None

    def observe(self, token_id: int) -> None:
        """A token was appended to the output."""
        if self._forcing and token_id == self._forcing[0]:
            self._forcing.pop(0)
        if self.is_done:
            return
        piece = self._token_bytes(token_id)
        if not self.in_reasoning:
            self._tail += piece
            stripped = self._tail.lstrip()
            if stripped.startswith(self._start):
                self.in_reasoning = True
                self._tail = stripped[len(self._start):]
                self._count_and_check()
            elif stripped and not self._start.startswith(stripped):
                self.is_done = True  # the answer began without a thinking block
            return
        self._tail = (self._tail + piece)[-(len(self._end) + len(piece)):]
        self._count_and_check()

    def _count_and_check(self) -> None:
        self.num_reasoning_tokens += 1
        if self._end in self._tail:
            self.in_reasoning, self.is_done = False, True
            self._forcing = []
            self._tail = b""
        elif self.num_reasoning_tokens >= self.params.budget and not self._forcing:
            self._forcing = list(self._end_ids)

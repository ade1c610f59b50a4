"""The one ``llama_batch`` the llama.cpp runner refills every step.

Allocated once with room for ``n_batch`` tokens; each step writes its rows (token, position,
sequence id, whether the row's logits are wanted) and hands it to one ``llama_decode``.
Rows are addressed by index: ``llama_get_logits_ith(ctx, i)`` and
``llama_sampler_sample(chain, ctx, i)`` read the logits of row ``i``.
"""

from __future__ import annotations

from typing import Any

import llama_cpp

__all__ = ["TokenBatch"]


class TokenBatch:
    """A preallocated ``llama_batch`` of one sequence id per token."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.num_tokens = 0
        self._raw = llama_cpp.llama_batch_init(capacity, 0, 1)
        self._token = self._raw.token
        self._pos = self._raw.pos
        self._logits = self._raw.logits
        # Every row belongs to one sequence: set the counts once, keep the rows' id slots.
        self._seq_ids = [self._raw.seq_id[i] for i in range(capacity)]
        for i in range(capacity):
            self._raw.n_seq_id[i] = 1

    def clear(self) -> None:
        self.num_tokens = 0

    @property
    def room(self) -> int:
        """How many more rows fit."""
        return self.capacity - self.num_tokens

    def add(self, token: int, position: int, seq_id: int, wants_logits: bool) -> int:
        """Append a row; returns its index."""
        i = self.num_tokens
        self._token[i] = token
        self._pos[i] = position
        self._seq_ids[i][0] = seq_id
        self._logits[i] = wants_logits
        self.num_tokens = i + 1
        return i

    def decode(self, ctx: Any) -> int:
        """``llama_decode`` over the rows added since :meth:`clear`; its return code."""
        self._raw.n_tokens = self.num_tokens
        return int(llama_cpp.llama_decode(ctx, self._raw))

    def free(self) -> None:
        if self._raw is not None:
            llama_cpp.llama_batch_free(self._raw)
            self._raw = None

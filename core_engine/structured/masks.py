"""The batch's token masks: computed by llguidance while the forward pass runs, applied to
the logits before sampling.

llguidance fills one bitmask row per constrained sequence (32 tokens per int32, bit ``i`` of
word ``w`` allows token ``32 w + i``) on its own threads (``LLExecutor``, GIL released), so
:meth:`TokenMasks.start` hands the work to a helper thread before the model runs and the
sampler waits for it after: the masks cost the step only what outlasts the forward pass.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

__all__ = ["TokenMasks", "apply_token_bitmask"]

_BITS = torch.arange(32, dtype=torch.int32)


class TokenMasks:
    """Fills the bitmasks of a batch's constrained rows (see the module docstring)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._executor: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-masks")
        #: Seconds per constrained row of the last mask computations (the benchmark's figure).
        self.row_seconds: deque[float] = deque(maxlen=4096)

    def start(self, matchers: Sequence[Any | None]) -> Future[Tensor] | None:
        """Begin the masks of ``matchers`` (one per sampled row; None: unconstrained). The
        future's result is an (rows, words) int32 bitmask (unconstrained rows all ones)."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        bitmask = torch.full((len(matchers), self._words), -1, dtype=torch.int32)

        def fill() -> Tensor:
            started = time.perf_counter()
            self._executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), self._words * 4, len(matchers))
            per_row = (time.perf_counter() - started) / len(rows)
            self.row_seconds.extend([per_row] * len(rows))
            return bitmask

        return self._pool.submit(fill)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, fallback_ids: Sequence[int]) -> Tensor:
    """``logits`` (B, V) with every token a row's mask forbids at -inf (a new tensor). A row whose
    mask allows nothing (a matcher in an error state) keeps ``fallback_ids`` (end of
    sequence), so sampling always has a token."""
    num_rows, vocab = logits.shape
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(num_rows, -1)[:, :vocab].to(torch.bool)
    empty = ~allowed.any(dim=1)
    if bool(empty.any()) and fallback_ids:
        ids = torch.tensor(list(fallback_ids), dtype=torch.long)
        allowed[empty.nonzero().squeeze(1).unsqueeze(1), ids.unsqueeze(0)] = True
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

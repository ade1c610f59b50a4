"""The batch's token masks: computed by llguidance each step, applied to the logits before
sampling.

llguidance fills one bitmask row per constrained sequence (32 tokens per int32, bit ``i`` of
word ``w`` allows token ``32 w + i``) on its own threads (``LLExecutor``, GIL released).
Where that work can overlap the forward pass, :meth:`TokenMasks.start` hands it to a helper
thread before the model runs and the sampler waits for it after: the masks cost the step only
what outlasts the forward. That holds when the forward runs on an accelerator, or on fewer
CPU threads than the process has cores. When the forward's threads already take every core
(the CPU engine's default), an overlapped mask only preempts them: each of the forward's
parallel regions waits for its slowest thread, and on 2 cores a batch of 16 constrained rows
slowed the forward by 0.6-2.3 ms for masks that take 0.2 ms alone (docs/benchmarks.md,
"Structured outputs"). There the masks are computed first, row by row on the engine's own
thread (``LLMatcher.unsafe_compute_mask_ptr``), in the time they take: no executor threads
are woken to spin beside the forward.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["TokenMasks", "apply_token_bitmask", "overlaps_forward"]


def overlaps_forward(device: torch.device) -> bool:
    """Whether mask work on a helper thread runs beside the forward pass on ``device``
    rather than taking cores from it (module docstring)."""
    if device.type != "cpu":
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


class _Ready:
    """A mask computed already (the interface of the overlapped one's future)."""

    def __init__(self, bitmask: Tensor) -> None:
        self._bitmask = bitmask

    def result(self) -> Tensor:
        return self._bitmask


class TokenMasks:
    """Fills the bitmasks of a batch's constrained rows (see the module docstring)."""

    def __init__(self, vocab_size: int, *, overlap: bool) -> None:
        self.vocab_size = vocab_size
        #: Masks are computed on a helper thread while the forward runs (else before it).
        self.overlap = overlap
        self._words = (vocab_size + 31) // 32
        self._executor: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-masks") if overlap else None
        #: Seconds per constrained row of the last mask computations (the benchmark's figure).
        self.row_seconds: deque[float] = deque(maxlen=4096)

    def start(self, matchers: Sequence[Any | None]) -> Future[Tensor] | _Ready | None:
        """Begin the masks of ``matchers`` (one per sampled row; None: unconstrained). The
        result is an (rows, words) int32 bitmask (unconstrained rows all ones)."""
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        bitmask = torch.full((len(matchers), self._words), -1, dtype=torch.int32)
        row_bytes = self._words * 4
        if self._pool is None:
            for matcher, i in rows:
                started = time.perf_counter()
                matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), row_bytes)
                self.row_seconds.append(time.perf_counter() - started)
            return _Ready(bitmask)
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()

        def fill() -> Tensor:
            started = time.perf_counter()
            self._executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), row_bytes, len(matchers))
            per_row = (time.perf_counter() - started) / len(rows)
            self.row_seconds.extend([per_row] * len(rows))
            return bitmask

        return self._pool.submit(fill)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, fallback_ids: Sequence[int]) -> Tensor:
    """``logits`` (B, V) with every token a row's mask forbids at -inf (a new tensor). A row whose
    mask allows nothing (a matcher in an error state) keeps ``fallback_ids`` (end of
    sequence), so sampling always has a token.

    The logits get an additive bias, 0 where allowed and -inf where not, gathered byte by
    byte of the mask from a table of the 256 bytes' 8 biases. Unlike ``masked_fill``, whose
    time depends on the mask's pattern, this is one gather and one add: 0.145 instead of
    1.45 ms for 16 rows of a 49k vocabulary with random bits (benchmarks/token_bitmask.py;
    docs/structured-outputs.md, "What it costs")."""
    num_rows, vocab = logits.shape
    empty = ~bitmask.any(dim=1)
    if fallback_ids and bool(empty.any()):
        bitmask = bitmask.clone()
        for row in empty.nonzero().squeeze(1).tolist():
            for token_id in fallback_ids:
                word, bit = divmod(token_id, 32)
                bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32's bit 31: the sign
    # Little-endian words: byte k of word w holds the bits of tokens 32 w + 8 k to 32 w + 8 k + 7.
    index = bitmask.contiguous().view(torch.uint8).reshape(-1).to(device=logits.device, dtype=torch.int64)
    bias = _byte_biases(logits.device).index_select(0, index).view(num_rows, -1)[:, :vocab]
    return bias.add_(logits)


_BYTE_BIASES: dict[torch.device, Tensor] = {}


def _byte_biases(device: torch.device) -> Tensor:
    """(256, 8) float32: row ``b`` is the bias of the 8 tokens whose bits byte ``b`` holds."""
    table = _BYTE_BIASES.get(device)
    if table is None:
        bits = torch.from_numpy(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"))
        table = torch.zeros((256, 8)).masked_fill_(bits == 0, float("-inf")).to(device)
        _BYTE_BIASES[device] = table
    return table

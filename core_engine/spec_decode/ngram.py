"""N-gram prompt lookup: propose what followed the last time the current suffix appeared.

For each request, the last ``n`` tokens (``n`` from ``ngram_max`` down to ``ngram_min``) are
searched in its prompt and output so far; at the most recent earlier occurrence, the tokens
that followed it are the proposal (up to ``k``). Input-grounded generation (edits, quotes,
code rewrites, summaries that copy) repeats long spans of the prompt, so these proposals are
often right; open-ended text rarely matches and proposes nothing.

Vectorised over the batch: the token histories are right-aligned in one ``(B, L)`` array
(each request's history is kept in a growing numpy buffer, so a step copies only the new
tokens), and every ``n`` is one sliding-window comparison for all requests at once. The time
spent is accumulated in :attr:`NgramProposer.seconds` (reported in ``/metrics``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["NgramProposer"]

_PAD = -1  # never a token id: a window with padding matches no suffix


class NgramProposer:
    """Proposals for a batch of requests; see the module docstring."""

    def __init__(self, *, ngram_max: int = 3, ngram_min: int = 1) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}
        #: Time spent proposing (seconds) and calls, since start.
        self.seconds = 0.0
        self.num_calls = 0

    def release(self, request: Any) -> None:
        self._buffers.pop(request.req_id, None)

    def _history(self, request: Any) -> np.ndarray:
        tokens = request.all_token_ids
        buf, n = self._buffers.get(request.req_id, (None, 0))
        if buf is None or len(buf) < len(tokens):
            grown = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
            if buf is not None:
                grown[:n] = buf[:n]
            buf = grown
        if n > len(tokens):
            n = 0  # the history shrank (a stop string cut it): copy it again
        buf[n : len(tokens)] = tokens[n:]
        self._buffers[request.req_id] = (buf, len(tokens))
        return buf[: len(tokens)]

    def propose(self, requests: Sequence[Any], ks: Sequence[int]) -> list[list[int]]:
        """Up to ``ks[i]`` proposed tokens for ``requests[i]`` (possibly none)."""
        started = time.perf_counter()
        histories = [self._history(r) for r in requests]
        width = max(len(h) for h in histories)
        arr = np.full((len(histories), width), _PAD, dtype=np.int64)
        for i, h in enumerate(histories):
            arr[i, width - len(h) :] = h
        lengths = np.array([len(h) for h in histories])
        out: list[list[int]] = [[] for _ in requests]
        todo = np.ones(len(requests), dtype=bool)
        for n in range(min(self.ngram_max, width - 1), self.ngram_min - 1, -1):
            if not todo.any():
                break
            suffix = arr[:, width - n :]  # (B, n)
            # Windows starting at 0 .. width-n-1: each has at least one token after it.
            windows = np.lib.stride_tricks.sliding_window_view(arr, n, axis=1)[:, :-1]  # (B, W, n)
            match = (windows == suffix[:, None, :]).all(axis=2)  # (B, W)
            match &= (lengths >= n + 1)[:, None]
            found = match.any(axis=1) & todo
            if not found.any():
                continue
            last = match.shape[1] - 1 - np.argmax(match[:, ::-1], axis=1)  # most recent start
            for row in np.flatnonzero(found).tolist():
                begin = int(last[row]) + n
                out[row] = arr[row, begin : begin + ks[row]].tolist()
            todo &= ~found
        self.seconds += time.perf_counter() - started
        self.num_calls += 1
        return out

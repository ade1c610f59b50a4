"""Stop strings over streamed text: matched across token boundaries, never leaked.

One implementation for every engine that detokenizes locally (the core engine, llama.cpp,
MLX, the mock backend). Text is released only up to the point where it can no longer be the
start of a stop string: the longest suffix that is a prefix of some stop string is held back
until the next delta decides it. On a match the text is cut before the stop string (or after
it with ``include_stop_str_in_output``) and the request finishes.

Each delta may carry a payload (a backend's token id and logprob entry): a payload is
released with the first character of its text that goes out, so the tokens reported match the
text shown (a token that straddles the cut still contributed to the output).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

__all__ = ["StopChecker", "StopRelease"]

T = TypeVar("T")


class StopRelease(Generic[T]):
    """Text safe to show now, the payloads of the deltas it draws on, and whether a stop hit."""

    __slots__ = ("text", "payloads", "stopped")

    def __init__(self, text: str, payloads: list[T], stopped: bool) -> None:
        self.text = text
        self.payloads = payloads
        self.stopped = stopped


class StopChecker(Generic[T]):
    """Per-request stop-string state. Feed deltas with :meth:`push` (or :meth:`append` for text
    alone), drain with :meth:`flush` when the request ends for another reason."""

    def __init__(self, stop: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_len = max((len(s) for s in self.stop), default=0)
        #: The text not released yet (at most the longest stop string's length less one
        #: between calls): released text is dropped, so a long output costs nothing here.
        self._held = ""
        #: (start, end, payload) of each delta not yet released, offsets into ``_held``.
        self._pending: list[tuple[int, int, T]] = []
        #: The stop string that matched, once one has.
        self.matched: str | None = None

    def push(self, delta: str, payload: T | None = None) -> StopRelease[T]:
        """Add one delta (``payload``: what it came with; None for text without a token) and
        return what may go out now. After a match every call returns nothing, stopped."""
        if self.matched is not None:
            return StopRelease("", [], True)
        start = len(self._held)
        # A new match must end inside the new delta, so it starts at most max_len-1 chars back
        # (and within the held text: released text never ends with the start of a stop).
        search_from = max(0, start - self._max_len + 1)
        self._held += delta
        if payload is not None:
            self._pending.append((start, len(self._held), payload))
        if not self.stop:
            return self._release(len(self._held))
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self._held.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            self.matched = s
            released = self._release(idx + len(s) if self.include_stop_str_in_output else idx)
            self._pending = []
            return StopRelease(released.text, released.payloads, True)
        return self._release(len(self._held) - self._held_back())

    def append(self, delta: str) -> str:
        """:meth:`push` for text alone: what may be shown now."""
        return self.push(delta).text

    def flush(self) -> StopRelease[T]:
        """The request ended for another reason: everything still held back goes out."""
        if self.matched is not None:
            return StopRelease("", [], True)
        return self._release(len(self._held))

    def _held_back(self) -> int:
        # Longest suffix of the unreleased text that is a proper prefix of a stop string.
        text = self._held
        for n in range(min(self._max_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _release(self, end: int) -> StopRelease[T]:
        out, self._held = self._held[:end], self._held[end:]
        payloads: list[T] = []
        kept: list[tuple[int, int, T]] = []
        for start, stop, payload in self._pending:
            # Released once any of its characters is out (or it has none left to wait for).
            if start < end or stop <= end:
                payloads.append(payload)
            else:
                kept.append((start - end, stop - end, payload))
        self._pending = kept
        return StopRelease(out, payloads, False)

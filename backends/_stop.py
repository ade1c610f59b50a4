"""Stop strings across token boundaries: hold back text that may be the start of a stop.

Backends that detokenize locally push each token's text (with a payload such as its
logprob entry); the buffer releases only text that can no longer be part of a stop string,
and on a match cuts the output right before it, so a stop string never leaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

__all__ = ["StopBuffer", "StopRelease"]

T = TypeVar("T")


class StopRelease(Generic[T]):
    """Text safe to emit now, the payloads of the tokens it completes, and whether a stop hit."""

    __slots__ = ("text", "payloads", "stopped")

    def __init__(self, text: str, payloads: list[T], stopped: bool) -> None:
        self.text = text
        self.payloads = payloads
        self.stopped = stopped


class StopBuffer(Generic[T]):
    """Holds back the shortest tail of the output that could still become a stop string."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stops = tuple(s for s in stop if s)
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._text = ""
        # (start, end) character offsets of each pending token inside ``self._text``.
        self._items: list[tuple[int, int, T]] = []

    @property
    def is_active(self) -> bool:
        return bool(self._stops)

    def push(self, text: str, payload: T | None = None) -> StopRelease[T]:
        """Add one token's text (``payload`` None: text without a token); return what can go out."""
        if not self._stops:
            return StopRelease(text, [] if payload is None else [payload], False)
        start = len(self._text)
        self._text += text
        if payload is not None:
            self._items.append((start, len(self._text), payload))
        # Only the new text (plus a held tail) can contain a stop that was not there before.
        search_from = max(0, start - self._max_hold)
        cut: int | None = None
        for stop in self._stops:
            found = self._text.find(stop, search_from)
            if found != -1 and (cut is None or found < cut):
                cut = found
        if cut is not None:
            released = self._release(cut)
            self._text = ""
            self._items = []
            return StopRelease(released.text, released.payloads, True)
        return self._release(len(self._text) - self._held_length())

    def flush(self) -> StopRelease[T]:
        """End of generation: everything still held is output."""
        released = self._release(len(self._text))
        return released

    def _held_length(self) -> int:
        text = self._text
        for length in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0

    def _release(self, upto: int) -> StopRelease[T]:
        # A token is released with the text once any of its characters is emitted (a token
        # that straddles the cut still contributed to the output).
        payloads: list[T] = []
        kept: list[tuple[int, int, T]] = []
        for start, end, payload in self._items:
            if start < upto or end <= upto:
                payloads.append(payload)
            else:
                kept.append((start - upto, end - upto, payload))
        text = self._text[:upto]
        self._text = self._text[upto:]
        self._items = kept
        return StopRelease(text, payloads, False)

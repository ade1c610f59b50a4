"""Stop strings over streamed text: matched across token boundaries, never leaked.

Text is released only up to the point where it can no longer be the start of a stop string:
the longest suffix that is a prefix of some stop string is held back until the next delta
decides it. On a match the text is cut before the stop string (or after it with
``include_stop_str_in_output``) and the request finishes.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopChecker"]


class StopChecker:
    """Per-request stop-string state. Feed deltas with :meth:`append`, drain with :meth:`flush`."""

    def __init__(self, stop: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_len = max((len(s) for s in self.stop), default=0)
        self._text = ""
        self._num_released = 0
        #: The stop string that matched, once one has.
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._text[: self._num_released]

    def append(self, delta: str) -> str:
        """Add decoded text; return what may be shown now. After a match, returns the text up
        to the stop string and sets :attr:`matched`; later calls return ""."""
        if self.matched is not None:
            return ""
        if not self.stop:
            self._text += delta
            self._num_released = len(self._text)
            return delta
        # A new match must end inside the new delta, so it starts at most max_len-1 chars back.
        search_from = max(0, len(self._text) - self._max_len + 1)
        self._text += delta
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self._text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            end = idx + len(s) if self.include_stop_str_in_output else idx
            self.matched = s
            return self._release(max(end, self._num_released))
        return self._release(len(self._text) - self._held_back())

    def flush(self) -> str:
        """The request ended for another reason: release whatever was held back."""
        if self.matched is not None:
            return ""
        return self._release(len(self._text))

    def _held_back(self) -> int:
        # Longest suffix of the text that is a proper prefix of a stop string.
        text = self._text
        for n in range(min(self._max_len - 1, len(text) - self._num_released), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _release(self, end: int) -> str:
        out = self._text[self._num_released : end]
        self._num_released = max(self._num_released, end)
        return out

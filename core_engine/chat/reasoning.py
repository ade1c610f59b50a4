"""Split a reasoning model's output into its thinking and its answer, as it streams.

The thinking sits between a start and an end marker (:data:`~core_engine.chat.formats.
REASONING_MARKERS`). Templates of DeepSeek-R1 distills and Qwen3 often *open* the block in
the prompt, so the output starts inside it (``open_at_start``). Text that may be the start of
a marker is held back until the next delta says whether it is one, so the split does not
depend on how the text was cut into deltas (tests feed every split).
"""

from __future__ import annotations

__all__ = ["ReasoningParser", "held_back"]


def held_back(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """``feed(delta) -> (reasoning, content)``; ``finish()`` flushes what was held back.

    Before the start marker, leading whitespace is held; a marker there opens the block, any
    other text makes the rest the answer (a model that did not think). Inside the block all
    text is reasoning up to the end marker; after it, everything is content (the whitespace
    right after the end marker is dropped, as the templates put it there).
    """

    def __init__(self, start: str, end: str, *, open_at_start: bool = False) -> None:
        self.start = start
        self.end = end
        self._state = "reasoning" if open_at_start else "before"
        self._buffer = ""
        self._strip_next = False

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    @property
    def is_done(self) -> bool:
        """The block closed (or never opened): the rest is the answer."""
        return self._state == "content"

    def feed(self, delta: str) -> tuple[str, str]:
        self._buffer += delta
        reasoning: list[str] = []
        content: list[str] = []
        while self._buffer:
            if self._state == "before":
                stripped = self._buffer.lstrip()
                if not stripped:
                    break  # only whitespace so far: wait
                if stripped.startswith(self.start):
                    self._buffer = stripped[len(self.start):]
                    self._state = "reasoning"
                    continue
                if self.start.startswith(stripped):
                    break  # maybe the marker, cut
                self._state = "content"
                continue
            if self._state == "reasoning":
                index = self._buffer.find(self.end)
                if index >= 0:
                    reasoning.append(self._buffer[:index])
                    self._buffer = self._buffer[index + len(self.end):]
                    self._state = "content"
                    self._strip_next = True
                    continue
                keep = held_back(self._buffer, self.end)
                reasoning.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            # content
            if self._strip_next:
                stripped = self._buffer.lstrip()
                if not stripped:
                    break
                self._buffer = stripped
                self._strip_next = False
            content.append(self._buffer)
            self._buffer = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back at the end of the output."""
        rest, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            return rest, ""
        if self._state == "content" and self._strip_next:
            return "", rest.lstrip()
        return "", rest

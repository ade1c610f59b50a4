"""A minimal incremental Server-Sent Events parser (bytes in, ``data`` payloads out).

Only ``data`` fields matter for the OpenAI streaming protocol; ``event``, ``id``, ``retry``
and comment lines are skipped. Works on raw bytes so no text decoding happens per line.
"""

from __future__ import annotations

__all__ = ["SSEParser"]


class SSEParser:
    """Feed network bytes; get the ``data`` payload of every completed event."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        """Return the payloads of the events completed by ``chunk`` (possibly none)."""
        self._buffer += chunk
        events: list[bytes] = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline == -1:
                return events
            line = self._buffer[:newline]
            self._buffer = self._buffer[newline + 1 :]
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            # Other fields (event, id, retry) and ":" comments carry nothing we use.

    def close(self) -> list[bytes]:
        """End of stream: an event not followed by a blank line still counts."""
        events = self.feed(b"\n") if self._buffer else []
        if self._data:
            events.append(b"\n".join(self._data))
            self._data = []
        return events

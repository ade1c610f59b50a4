"""A minimal incremental Server-Sent Events parser (bytes in, ``data`` payloads out).

Only ``data`` fields matter for the OpenAI streaming protocol; ``event``, ``id``, ``retry``
and comment lines are skipped. Lines end in LF or CRLF. Works on raw bytes so no text
decoding happens per line, and a whole network read at a time: events end at a blank line,
so the buffer is cut into events with one ``split``, and the usual event (one ``data:``
line) costs a prefix check and a slice.
"""

from __future__ import annotations

__all__ = ["SSEParser"]


class SSEParser:
    """Feed network bytes; get the ``data`` payload of every completed event."""

    def __init__(self) -> None:
        #: The event still incomplete (CRLF already turned into LF).
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """Return the payloads of the events completed by ``chunk`` (possibly none)."""
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\r" in buffer:
            # A CR at the very end stays: its LF may come with the next read.
            buffer = buffer.replace(b"\r\n", b"\n")
        events = buffer.split(b"\n\n")
        self._buffer = events.pop()
        payloads = []
        for event in events:
            payload = _payload(event)
            if payload is not None:
                payloads.append(payload)
        return payloads

    def close(self) -> list[bytes]:
        """End of stream: an event not followed by a blank line still counts."""
        event, self._buffer = self._buffer, b""
        if event.endswith(b"\r"):
            event = event[:-1]
        payload = _payload(event)
        return [] if payload is None else [payload]


def _payload(event: bytes) -> bytes | None:
    """The ``data`` of one event (its lines joined by LF), None when it has none."""
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # the usual event: a single data line
    values = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            values.append(value[1:] if value.startswith(b" ") else value)
        # Other fields (event, id, retry) and ":" comments carry nothing we use.
    return b"\n".join(values) if values else None

"""SSE framing as upstream servers send it: split anywhere, CRLF or LF, comments."""

from __future__ import annotations

from backends._sse import SSEParser


def test_events_split_across_network_reads() -> None:
    stream = b'data: {"a": 1}\r\n\r\n: keep-alive\n\nevent: x\ndata: {"b"\ndata: : 2}\n\ndata: [DONE]\n\n'
    parser = SSEParser()
    events: list[bytes] = []
    for i in range(len(stream)):  # one byte at a time: the worst split
        events += parser.feed(stream[i : i + 1])
    events += parser.close()
    assert events == [b'{"a": 1}', b'{"b"\n: 2}', b"[DONE]"]


def test_last_event_without_blank_line_is_kept() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: tail") == []
    assert parser.close() == [b"tail"]

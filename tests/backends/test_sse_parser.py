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


def test_events_of_one_read_crlf_and_blank_line_runs() -> None:
    parser = SSEParser()
    read = b"data: a\r\n\r\n\n\ndata: b\r\ndata: c\r\nid: 7\r\n\r\n: ping\n\ndata:d\n\ndata: e\r"
    assert parser.feed(read) == [b"a", b"b\nc", b"d"]
    assert parser.feed(b"\n\r\n") == [b"e"]
    assert parser.feed(b"data: f\n") == []
    assert parser.close() == [b"f"]

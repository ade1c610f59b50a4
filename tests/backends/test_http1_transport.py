"""The native HTTP/1.1 client's response parsing, fed as the network splits it."""

from __future__ import annotations

import pytest

from backends._http1_transport import _Parse

RESPONSE = (
    b"HTTP/1.1 100 Continue\r\n\r\n"
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n1\r\n \r\nB\r\nworld\r\n!!!!\r\n0\r\ntrailer: x\r\n\r\n"
)


@pytest.mark.parametrize("step", [1, 2, 3, 7, len(RESPONSE)])
def test_a_chunked_response_split_anywhere_parses_the_same(step: int) -> None:
    parse = _Parse()
    body = b""
    for i in range(0, len(RESPONSE), step):
        assert not parse.done
        parse.feed(RESPONSE[i : i + step])
        if parse.body:
            body += parse.take()
    assert parse.done and parse.head_done and parse.keep_alive and not parse.extra
    assert parse.status == 200  # the interim 100 is skipped
    assert (b"Content-Type", b"text/event-stream") in parse.headers
    assert body == b"hello world\r\n!!!!"


def test_lengths_connection_close_and_bytes_after_the_response() -> None:
    parse = _Parse()
    parse.feed(b"HTTP/1.1 429 Too Many\r\nRetry-After: 7\r\nContent-Length: 2\r\n\r\nokHTTP")
    assert (parse.status, parse.take(), parse.done) == (429, b"ok", True)
    assert parse.extra  # not reusable

    until_close = _Parse()
    until_close.feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nsome")
    assert not until_close.done and not until_close.keep_alive
    assert until_close.ends_with_the_connection()


@pytest.mark.parametrize(
    "bad",
    [b"NOT HTTP\r\n\r\n", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"],
)
def test_malformed_responses_are_value_errors(bad: bytes) -> None:
    with pytest.raises(ValueError):
        _Parse().feed(bad)

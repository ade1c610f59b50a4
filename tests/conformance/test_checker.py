"""The checker can fail: a deliberately wrong endpoint (a stdlib HTTP server on loopback)
gets fail verdicts with the evidence, n/a where it declares a lack, and a check that crashes
on a malformed body is a failure, not the end of the run."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main

CHUNK = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


class WrongEndpoint(BaseHTTPRequestHandler):
    """finish_reason twice in a stream, errors outside the envelope, a malformed body."""

    authorizations: list[str | None] = []

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"null")
        self.authorizations.append(self.headers.get("authorization"))
        if self.path == "/v1/embeddings":
            self._send(404, "application/json", b'{"detail": "Not Found"}')
        elif "model" not in body:
            self._send(400, "application/json", b'{"detail": "model is required"}')
        elif body.get("stream"):
            deltas = [{"role": "assistant", "content": "Hi"}, {"content": " there"}]
            chunks = [dict(CHUNK, choices=[{"index": 0, "delta": d, "finish_reason": None}]) for d in deltas]
            chunks += [dict(CHUNK, choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}])] * 2
            frames = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            self._send(200, "text/event-stream", frames.encode())
        else:
            malformed = {"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [5]}
            self._send(200, "application/json", json.dumps(malformed).encode())

    def _send(self, status: int, content_type: str, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def wrong_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), WrongEndpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_wrong_endpoint_fails_with_the_evidence(wrong_url: str, tmp_path: Path) -> None:
    WrongEndpoint.authorizations.clear()
    json_path, html_path = tmp_path / "r.json", tmp_path / "r.html"
    checks = ["chat.body", "chat.stream.shape", "errors.missing_model", "embeddings.float"]
    argv = ["conformance", "--url", wrong_url, "--model", "m", "--api", "openai", "--api-key", "sk-test"]
    for name in checks:
        argv += ["--check", name]
    status = main([*argv, "--json", str(json_path), "--html", str(html_path)])

    assert status == 1
    results = {c["name"]: c for c in json.loads(json_path.read_text())["checks"]}
    assert {name: results[name]["verdict"] for name in checks} == {
        "chat.body": "fail", "chat.stream.shape": "fail", "errors.missing_model": "fail", "embeddings.float": "n/a",
    }
    stream = results["chat.stream.shape"]["evidence"]
    assert "finish_reason must be set exactly once, it was set 2 times" in stream
    assert '"finish_reason": "stop"' in stream and "POST /v1/chat/completions" in stream
    error = results["errors.missing_model"]["evidence"]
    assert "the body has no `error` object" in error and '{"detail": "model is required"}' in error
    assert "the check raised" in results["chat.body"]["evidence"]  # and the run went on
    assert "answers 404" in results["embeddings.float"]["evidence"]
    assert "finish_reason must be set exactly once" in html_path.read_text()
    assert set(WrongEndpoint.authorizations) == {"Bearer sk-test"}

"""A minimal OpenAI-shaped upstream for the gateway-overhead benchmark (raw ASGI, uvicorn).

Every answer is precomputed bytes, so the upstream costs almost nothing and what a gateway
adds in front of it stands out. Streams send a role chunk, ``--chunks`` content chunks (one
ASGI send each, as a token-by-token server does), a finish chunk, a usage chunk and
``[DONE]``.

    python benchmarks/fast_upstream.py --port 9000 --chunks 16
"""

from __future__ import annotations

import argparse
import json
from typing import Any

UPSTREAM_MODEL = "upstream-model"

__all__ = ["UPSTREAM_MODEL", "run_upstream", "upstream_app"]


def upstream_app(chunks: int) -> Any:
    """A raw ASGI app: every answer is precomputed, so the upstream costs almost nothing."""
    words = [f" w{i}" for i in range(chunks)]
    base = {"id": "chatcmpl-bench", "created": 0, "model": UPSTREAM_MODEL}
    usage = {"prompt_tokens": 8, "completion_tokens": chunks, "total_tokens": 8 + chunks}
    full = json.dumps(
        base
        | {
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(words)},
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        }
    ).encode()

    def event(payload: dict[str, Any]) -> bytes:
        return (
            b"data: "
            + json.dumps(base | {"object": "chat.completion.chunk"} | payload).encode()
            + b"\n\n"
        )

    role = event(
        {
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ]
        }
    )
    content = [
        event({"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]})
        for w in words
    ]
    tail = (
        event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        + event({"choices": [], "usage": usage})
        + b"data: [DONE]\n\n"
    )
    models = json.dumps(
        {"object": "list", "data": [{"id": UPSTREAM_MODEL, "object": "model"}]}
    ).encode()
    json_headers = [(b"content-type", b"application/json")]
    sse_headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": json_headers})
            await send({"type": "http.response.body", "body": models})
            return
        if b'"stream":true' not in body.replace(b" ", b""):
            await send({"type": "http.response.start", "status": 200, "headers": json_headers})
            await send({"type": "http.response.body", "body": full})
            return
        await send({"type": "http.response.start", "status": 200, "headers": sse_headers})
        await send({"type": "http.response.body", "body": role, "more_body": True})
        for piece in content:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": tail})

    return app


def run_upstream(port: int, chunks: int) -> None:
    import uvicorn

    uvicorn.run(
        upstream_app(chunks), host="127.0.0.1", port=port, log_level="warning", access_log=False
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=16)
    arguments = parser.parse_args()
    run_upstream(arguments.port, arguments.chunks)
